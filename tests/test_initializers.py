"""Each parameter's initial distribution under each scheme of ``model.init``, at the real widths
of ``configs/wmt_n4.py`` (Transformer-base, 4 experts), the model built as users build it.

The expected distributions are written out here from the schemes' sources, not taken from the
library: the paper's code (PyTorch ``nn.Linear``'s ``U(+-1/sqrt(fan_in))`` for weight and bias of
router, experts and dense FFNs; fairseq's Xavier attention weights with default q/k/v biases and
a zero output bias) and the earlier flax scheme. Moments are checked within 4 standard errors.
"""

import math

import numpy as np
import pytest
from flax import nnx

from configs import wmt_n4
from sparsemixer_jax.models.encoder_decoder import Transformer, TransformerConfig
from tests import kit

TRUNCATED_STD = 0.87962566103423978  # std of the standard normal truncated to [-2, 2]


def _uniform(fan_in, scale=1.0):
    return ("uniform", math.sqrt(scale / fan_in))


def _expected(scheme: str, name: str, d: int, f: int):
    """The distribution of parameter ``name`` (a '/'-joined path) at widths ``d``/``f``."""
    parent, leaf = name.split("/")[-2:]
    if "norm" in parent:
        return ("constant", 1.0 if leaf == "scale" else 0.0)
    if leaf == "omega":
        return ("constant", 1.0)
    if leaf == "embedding":
        return ("normal", d**-0.5)
    if parent in ("query", "key", "value"):
        if leaf == "kernel":  # Xavier-uniform with gain 1/sqrt(2)
            return ("uniform", math.sqrt(6 / (2 * d)) / math.sqrt(2))
        return _uniform(d) if scheme == "fairseq" else ("constant", 0.0)
    if parent == "out":
        return ("uniform", math.sqrt(6 / (2 * d))) if leaf == "kernel" else ("constant", 0.0)
    if parent == "router":
        fan_in, is_bias, dense_ffn = d, leaf == "bias", False
    elif leaf in ("wi", "bi", "wo", "bo"):  # the experts: [N, in, out] and [N, out]
        fan_in, is_bias, dense_ffn = (d if leaf in ("wi", "bi") else f), leaf in ("bi", "bo"), False
    else:  # the dense FFN's wi/wo Linear layers
        fan_in, is_bias, dense_ffn = (d if parent == "wi" else f), leaf == "bias", True
    if scheme == "fairseq":
        return _uniform(fan_in)
    if is_bias:
        return ("constant", 0.0)
    if dense_ffn:
        return ("uniform", math.sqrt(6 / (d + f)))  # Xavier-uniform
    return ("truncated", math.sqrt(1 / fan_in))  # truncated-normal router, LeCun-normal experts


def check_distribution(name: str, x: np.ndarray, expected) -> None:
    kind, value = expected
    x = np.asarray(x, np.float64).ravel()
    if kind == "constant":
        np.testing.assert_array_equal(x, value, err_msg=name)
        return
    n = x.size
    m2 = np.mean(x**2)
    se_std = np.sqrt(np.mean((x**2 - m2) ** 2) / n) / (2 * np.sqrt(m2))
    std = {"uniform": value / math.sqrt(3), "normal": value, "truncated": value}[kind]
    assert abs(np.sqrt(m2) - std) < 4 * se_std, (name, np.sqrt(m2), std, se_std)
    assert abs(x.mean()) < 4 * np.sqrt(m2 / n), (name, x.mean())
    top = np.abs(x).max()
    if kind == "uniform":
        # The bound itself is a float32 in the draw: within float32 rounding of it.
        assert top <= value * (1 + 2**-23), (name, top, value)
        if n >= 1000:  # the largest of n draws is within a few b/n of the bound
            assert top > value * (1 - 20 / n), (name, top, value)
    elif kind == "truncated":
        assert top <= 2 * value / TRUNCATED_STD * (1 + 1e-6), (name, top, value)


@pytest.fixture(scope="module")
def wmt_n4_params():
    """``{scheme: {path: array}}`` of ``configs/wmt_n4.py``'s model under each scheme."""
    out = {}
    for scheme in ("fairseq", "flax"):
        config = wmt_n4.get_config()
        config.model.init = scheme
        model = Transformer(*kit.sections(config, TransformerConfig), config.data.vocab_size,
                            rngs=nnx.Rngs(params=0, dropout=1, router=2))
        out[scheme] = {"/".join(map(str, path)): np.asarray(v[...])
                       for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
        del model
    return out, wmt_n4.get_config().model


def test_the_paper_configs_default_to_the_paper_scheme():
    assert wmt_n4.get_config().model.init == "fairseq"


@pytest.mark.parametrize("scheme", ["fairseq", "flax"])
def test_every_parameter_is_drawn_as_its_scheme_says(wmt_n4_params, scheme):
    params, m = wmt_n4_params
    # Pool each kind of parameter over the layers (a router bias has only N values a layer).
    pools: dict[str, list] = {}
    for name, value in params[scheme].items():
        kind = "/".join(p for p in name.split("/") if not p.isdigit() and
                        not p.endswith("_layers"))
        pools.setdefault(kind, []).append(value.ravel())
    assert len(pools) >= 20, sorted(pools)  # every kind of parameter is seen
    for kind, values in pools.items():
        check_distribution(kind, np.concatenate(values), _expected(scheme, kind, m.emb_dim,
                                                                    m.mlp_dim))


def test_the_schemes_differ_where_the_paper_code_does(wmt_n4_params):
    """The departures that matter at initialisation: logits, expert and FFN outputs larger under
    flax; the attention weights the same draw in both."""
    params, _ = wmt_n4_params
    router = "encoder_layers/0/ffn/router/kernel"
    ratio = np.std(params["flax"][router]) / np.std(params["fairseq"][router])
    assert abs(ratio - math.sqrt(3)) < 0.1  # 1/sqrt(d) against 1/sqrt(3 d)
    expert = "encoder_layers/0/ffn/wi"
    assert np.std(params["flax"][expert]) / np.std(params["fairseq"][expert]) > 1.6
    q = "encoder_layers/0/self_attn/query/kernel"  # drawn before any scheme-dependent draw
    np.testing.assert_array_equal(params["flax"][q], params["fairseq"][q])


@pytest.mark.parametrize("scheme", ["fairseq", "flax"])
def test_router_init_scale_multiplies_the_schemes_router_variance(scheme):
    d, n = 256, 128

    def router(scale):
        layer = kit.moe_layer(d, 8, n, router="switch", router_init_scale=scale, init=scheme,
                              rngs=nnx.Rngs(0))
        return np.asarray(layer.router.kernel[...]), np.asarray(layer.router.bias[...])

    kernel, bias = router(0.1)
    expected = _expected(scheme, "ffn/router/kernel", d, 1)
    kind, value = expected
    check_distribution("router kernel x0.1", kernel, (kind, value * math.sqrt(0.1)))
    if scheme == "fairseq":
        assert 0 < np.abs(bias).max() <= math.sqrt(0.1 / d)
    else:
        np.testing.assert_array_equal(bias, 0.0)


def test_unknown_scheme_is_one_clear_line():
    with pytest.raises(ValueError,
                       match=r"init='xavier'; choose one of \('fairseq', 'flax', 'admin'\)"):
        kit.moe_layer(8, 8, 2, init="xavier")
    with pytest.raises(ValueError, match=r"'gate=fairseq' is not COMPONENT=SCHEME"):
        kit.moe_layer(8, 8, 2, init="flax,gate=fairseq")
    config = wmt_n4.get_config()
    config.model.init = "xavier"
    from sparsemixer_jax.tasks import check_config

    with pytest.raises(ValueError, match=r"config\.model\.init='xavier'"):
        check_config(config)


@pytest.mark.parametrize("component", ["router", "experts", "ffn", "attention"])
def test_a_component_set_apart_takes_its_own_scheme(component):
    """``flax,<component>=fairseq`` (the split that tells which part of the scheme matters):
    that component's parameters as fairseq draws them, the rest as flax's."""
    config = wmt_n4.get_config()
    for field, value in (("emb_dim", 64), ("mlp_dim", 256), ("encoder_layers", 2),
                         ("decoder_layers", 2), ("num_heads", 4)):
        config.model[field] = value
    config.model.init = f"flax,{component}=fairseq"
    model = Transformer(*kit.sections(config, TransformerConfig), 50,
                        rngs=nnx.Rngs(params=0, dropout=1, router=2))
    owner = {"router": lambda p: "router" in p,
             "experts": lambda p: p.rsplit("/", 1)[-1] in ("wi", "bi", "wo", "bo"),
             "ffn": lambda p: "/ffn/w" in p and p.endswith(("kernel", "bias"))
             and "router" not in p,
             "attention": lambda p: any(f"/{a}/" in p for a in ("query", "key", "value"))}
    seen = 0
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(map(str, path))
        scheme = "fairseq" if owner[component](name) else "flax"
        seen += scheme == "fairseq"
        check_distribution(name, np.asarray(v[...]), _expected(scheme, name, 64, 256))
    assert seen >= 4


def test_the_fairseq_scheme_draws_every_expert_bias():
    layer = kit.moe_layer(16, 32, 3, init="fairseq", rngs=nnx.Rngs(0))
    for name, fan_in in (("bi", 16), ("bo", 32)):
        bias = np.asarray(getattr(layer, name)[...])
        assert np.all(bias != 0) and np.abs(bias).max() <= fan_in**-0.5
        # Experts are drawn independently, as separate nn.Linear layers.
        assert not np.array_equal(bias[0], bias[1])
