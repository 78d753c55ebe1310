"""The tests' shared kit: tiny configs by task, the metrics reader, the MoE layer helpers and the
resume test every training task runs.

Plain functions, imported by the test modules (``from tests import kit``); the fixtures that
build on them (``straight_run``, ``last_checkpoint``) are in ``tests/conftest.py``. Nothing here
imports jax at module level before conftest has set XLA's flags: conftest runs first.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from tests import tiny_electra_config, tiny_lm_config, tiny_wmt_config

# ------------------------------------------------------------------------------ tiny configs


def _transformer_config():
    """Transformer-base (``configs/wmt.py``) shrunk to emb 16, mlp 32, 2 heads, 2 + 2 layers,
    2 experts: the model-level tests' config (the whole model, not a training run)."""
    from configs.wmt import get_config

    config = get_config()
    config.model.update({"encoder_layers": 2, "decoder_layers": 2, "emb_dim": 16, "mlp_dim": 32,
                         "num_heads": 2, "num_experts": 2})
    config.router.name = "sparsemixer"
    return config


def _encoder_config():
    """The pretraining encoder alone: 2 layers, emb 16, mlp 32, 2 heads, T5 buckets 32 / 128,
    no absolute positions, 2 experts in layer 0."""
    from sparsemixer_jax.training.config import moe_model_fields, router_config

    c = ml_collections.ConfigDict()
    c.model = moe_model_fields(ml_collections.ConfigDict(dict(
        num_layers=2, emb_dim=16, mlp_dim=32, num_heads=2, relative_buckets=32,
        relative_max_distance=128, absolute_positions=0)))
    c.model.num_experts, c.model.moe_every = 2, 2
    c.router = router_config()
    return c


TINY_CONFIGS: dict[str, Callable[..., ml_collections.ConfigDict]] = {
    "translation": tiny_wmt_config.get_config,  # a training run: one padded shape
    "pretraining": tiny_electra_config.get_config,  # a training run on a generated corpus
    "lm": tiny_lm_config.get_config,  # a language-modelling run on a generated corpus
    "transformer": _transformer_config,
    "encoder": _encoder_config,
}


def tiny_config(task: str = "translation", corpus: str | None = None, *,
                model: dict | None = None, **overrides) -> ml_collections.ConfigDict:
    """The tiny config of ``task`` (a key of :data:`TINY_CONFIGS`), its ``model`` section updated
    with ``model``, then ``overrides`` (dotted paths, e.g. ``**{"optim.peak_lr": 1e-3}``, or
    top-level fields, e.g. ``train_steps=3``). ``corpus``: the pretraining corpus directory."""
    config = TINY_CONFIGS[task](corpus) if corpus is not None else TINY_CONFIGS[task]()
    if model:
        config.model.update(model)
    config.update_from_flattened_dict(overrides)
    return config


def sections(config: ml_collections.ConfigDict, model_type: type) -> tuple:
    """``(config.model, config.router)`` read into ``model_type`` (``TransformerConfig``,
    ``EncoderConfig``) and a ``RouterConfig``, as a task's ``from_config`` reads them: the typed
    sections the models take (``Transformer(*kit.sections(config, TransformerConfig), ...)``)."""
    from sparsemixer_jax.routers import RouterConfig

    return model_type.from_config(config.model), RouterConfig.from_config(config.router)


def run_for_target(config: ml_collections.ConfigDict, target):
    """The run of ``config`` as the compile command builds it for ``target``: its task's
    ``dispatch`` resolved for the target's platform."""
    from sparsemixer_jax.aot import command

    return command.run_for_target(config, target)


def target_devices_or_skip(spec: str) -> tuple:
    """``(target, devices)`` of a compile-only target (``"h100:1x1x8"``, ``"tpu:v5e:4x4"``;
    :mod:`sparsemixer_jax.aot.targets`), or the test skipped, naming what is missing (the
    packages of ``requirements-compile.txt``)."""
    import pytest

    from sparsemixer_jax.aot import targets

    target = targets.parse_target(spec)
    reason = targets.missing_support(target)
    if reason is not None:
        pytest.skip(reason)
    return target, targets.target_devices(target)


# ------------------------------------------------------------------------------ training runs


def read_metrics(workdir: str) -> list[dict]:
    """The records of ``workdir/metrics.jsonl``, in order."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def built_once(tmp_path_factory, name: str, build: Callable[[str], dict]) -> tuple[str, dict]:
    """``(directory, returned)``: ``build(directory)`` run once per test run, for every
    pytest-xdist worker, and what it returned (JSON-serialisable). The first worker to get here
    builds under an exclusive lock on a file in the directory the workers' temporary
    directories share; the others wait on the lock, then read the finished directory. A build
    that failed part-way (no record of its return value) is removed and built again. The
    directory is shared: a test that changes it must copy it first."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-user/pytest-N, one per run, above every worker's own
    directory, record = str(root / name), str(root / f"{name}.returned.json")
    with open(str(root / f"{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not os.path.exists(record):
            shutil.rmtree(directory, ignore_errors=True)
            returned = build(directory)
            with open(record + ".tmp", "w") as f:
                json.dump(returned, f)
            os.replace(record + ".tmp", record)
    with open(record) as f:
        return directory, json.load(f)


@dataclasses.dataclass(frozen=True)
class Task:
    """A training task as the shared fixtures and tests see it: ``run(workdir, **overrides)``
    trains the task's tiny config with ``overrides`` in ``workdir`` and returns its results."""

    name: str
    run: Callable[..., dict]


def test_extending_a_run_equals_the_uninterrupted_run(task, straight_run, tmp_path, task_steps,
                                                      last_checkpoint):
    """Run for every training task (imported by ``test_train.py`` and ``test_pretrain.py``, each
    with its ``task`` and ``task_steps`` fixtures, so the test shares its module's compilations):
    3 steps, then extended to 6, equals the straight 6-step run bit for bit."""
    workdir = str(tmp_path / "extended")
    task.run(workdir, train_steps=3)
    resumed = task.run(workdir, train_steps=6)
    reference_dir, reference = straight_run
    assert resumed["valid_loss"] == reference["valid_loss"]
    params, meta = last_checkpoint(workdir, task_steps)
    expected, expected_meta = last_checkpoint(reference_dir, task_steps)
    assert meta["step"] == expected_meta["step"] == 6
    assert meta["data"] == expected_meta["data"]
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    # Each step is logged once, although the run was stopped and started again.
    assert [r["step"] for r in read_metrics(workdir) if "loss" in r] == list(range(1, 7))


# ------------------------------------------------- the same training on two meshes or processes
#
# Sharding changes the order in which a cross-device sum adds its terms, and another host's math
# library rounds XLA's elementwise functions (exp, log, tanh) differently; neither changes any
# result by more than float32 rounding. The tolerances below follow from that and from the
# optimizer, not from one host's figures, and the comparisons that use them run one side under
# the other math library (:func:`run_with_other_math`), so a tolerance tuned to one host fails
# on every host.

UNIT_ROUNDOFF = 2.0**-24  # float32: a rounded result is within this relative error of the exact
PLATFORM_MATH = "--xla_cpu_enable_platform_dependent_math"

# Adam in its linear regime, for runs whose parameters are compared after several updates (see
# :func:`adam_parameter_atol`): epsilon at least the gradient norm of every update, the learning
# rate scaled with it (the update is then about ``peak_lr / eps`` = 0.3 times the gradient's
# moving average at the peak rate: SGD with momentum). Config overrides.
LINEAR_ADAM_EPS = 10.0


def linear_adam(eps: float = LINEAR_ADAM_EPS) -> dict[str, float]:
    """Config overrides for Adam in its linear regime with epsilon ``eps``."""
    return {"optim.eps": eps, "optim.peak_lr": 0.3 * eps}


LINEAR_ADAM = linear_adam()
# The tiny ELECTRA's gradient norm reaches about 200 (its discriminator loss weighted 50).
ELECTRA_LINEAR_ADAM = linear_adam(1000.0)


def sum_rtol(n: int) -> float:
    """Relative tolerance between two float32 evaluations of one sum of ``n`` terms of one sign
    (a loss summed over tokens, a squared norm), in any two orders and with elementwise
    functions from any two math libraries. Recursive summation in any order is within
    ``(n - 1) u`` of the exact sum relative to the sum of the terms' magnitudes (Higham,
    *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2; ``u`` is
    :data:`UNIT_ROUNDOFF`), which for terms of one sign is the sum itself; a term computed by a
    few correctly rounded or few-ulp elementwise functions adds at most a few ``u``, covered by
    counting ``n`` terms instead of ``n - 1`` and by the factor 4 (two evaluations, each within
    twice the bound)."""
    return 4.0 * n * UNIT_ROUNDOFF


def adam_parameter_atol(lrs: Sequence[float], grad_norms: Sequence[float], eps: float,
                        grad_rtol: float) -> float:
    """Largest difference of any parameter between two runs of AdamW from the same parameters
    whose every gradient element differs by at most ``grad_rtol * G`` (``G``: the largest of
    ``grad_norms``, which bounds every gradient element), after the updates with learning rates
    ``lrs``, when ``eps >= G`` (asserted).

    Per element, Adam's update is ``m / (sqrt(v) + eps)``, where the bias-corrected ``m`` and
    ``v`` are weighted means of the gradients and their squares (weights summing to 1). So
    ``|m| <= G``; ``m`` changes by at most ``d = grad_rtol * G`` when each gradient does, and so
    does ``sqrt(v)`` (a weighted root mean square is 1-Lipschitz in the largest change of its
    terms). The update therefore changes by at most
    ``d / (sqrt(v) + eps) + |m| d / (sqrt(v) + eps)**2 <= d (1 + G / eps) / eps <= 2 d / eps``,
    and the parameter by the sum over updates of ``lr`` times that. Weight decay multiplies a
    difference by ``1 - lr * wd`` (at most 1), clipping by the global norm scales both runs'
    gradients by factors within ``grad_rtol`` of each other, and a difference in the parameters
    changes the next gradients only through the loss's curvature times a difference of this
    size: second order, inside the bound's factor 2 for the few small steps the tests take.

    At Adam's usual ``eps`` (1e-8 or 1e-6) no such bound exists: an element whose gradient is
    rounding noise (the attention key bias, whose gradient is zero in exact arithmetic) moves by
    about ``lr`` in a direction set by the noise, different for every summation order and math
    library. That is why these runs take :data:`LINEAR_ADAM_EPS`."""
    bound = max(grad_norms)
    assert 0 < bound <= eps, f"gradient norm {bound} above Adam's eps {eps}: no linear regime"
    return 2.0 * grad_rtol * bound * math.fsum(lrs) / eps


def assert_parameters_close(got, want, atol: float, updates: int, label: str = "") -> None:
    """Every leaf of the trees ``got`` and ``want`` (same structure) within ``atol`` plus the
    float32 rounding of ``updates`` additions to a parameter of that leaf's size in each run
    (``2 * updates * u`` relative)."""
    rtol = 2.0 * updates * UNIT_ROUNDOFF
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                   err_msg=f"{label}{jax.tree_util.keystr(path)}")


def assert_same_training(workdir: str, reference: str, additions: int,
                         read_params: Callable[[str], tuple]) -> None:
    """The run in ``workdir`` equals the one in ``reference``, both with Adam in its linear
    regime (:func:`linear_adam`; ``eps`` read from the reference's ``config.json``): every
    update's loss and gradient norm and every validation loss within ``sum_rtol(additions)``
    (``additions``: the longest chain of float32 additions into a gradient element), the last
    checkpoints at the same step and place in the data, their parameters within
    :func:`adam_parameter_atol` of that rounding. ``read_params(workdir)``: ``(params, meta)``
    of the last checkpoint (the ``last_checkpoint`` fixture)."""
    records, expected = read_metrics(workdir), read_metrics(reference)
    grad_rtol = sum_rtol(additions)
    for key in ("loss", "grad_norm", "valid_loss"):
        got = [r[key] for r in records if key in r]
        want = [r[key] for r in expected if key in r]
        assert len(got) == len(want) > 0, key
        np.testing.assert_allclose(got, want, rtol=grad_rtol, err_msg=key)
    params, meta = read_params(workdir)
    want_params, want_meta = read_params(reference)
    assert meta["step"] == want_meta["step"]
    assert meta["data"] == want_meta["data"]  # the same place in the data stream
    train = [r for r in expected if "loss" in r]
    with open(os.path.join(reference, "config.json")) as f:
        eps = json.load(f)["optim"]["eps"]
    atol = adam_parameter_atol([r["lr"] for r in train], [r["grad_norm"] for r in train], eps,
                               grad_rtol)
    assert_parameters_close(params, want_params, atol, meta["step"])


def other_math_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with XLA's CPU elementwise math switched to
    the other implementation: the platform's own (``PLATFORM_MATH=true``, XLA's default) if this
    process uses XLA's portable one, and the portable one otherwise. The other flags stay."""
    env = dict(os.environ if env is None else env)
    flags = env.get("XLA_FLAGS", "").split()
    portable_here = f"{PLATFORM_MATH}=false" in flags
    flags = [f for f in flags if not f.startswith(PLATFORM_MATH)]
    flags.append(f"{PLATFORM_MATH}={'true' if portable_here else 'false'}")
    return {**env, "XLA_FLAGS": " ".join(flags)}


def train_with_other_math(module: str, config: str, workdir: str, overrides: dict) -> None:
    """``python -m module --config config --workdir workdir`` (a training command) with
    ``--config.KEY=VALUE`` for each of ``overrides``, under XLA's other elementwise math."""
    run_with_other_math(module, "--config", config, "--workdir", workdir,
                        *(f"--config.{key}={value}" for key, value in overrides.items()))


def run_with_other_math(module: str, *args: str, timeout: float = 600) -> None:
    """``python -m module *args`` from the repository root under :func:`other_math_env`; its
    output shown if it fails."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=root, env=other_math_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{module} {args}: exit {done.returncode}\n{done.stderr[-4000:]}"


# --------------------------------------------------------------------------- the MoE layer


# The settings moe_layer takes by keyword that are RouterConfig fields, by their keyword name.
_ROUTER_KEYWORDS = {"router": "name", "jitter_eps": "jitter_eps", "top_k": "top_k",
                    "router_init_scale": "init_scale", "default_decay": "default_decay"}


def moe_sections(experts: int, router_options: dict | None = None, **settings) -> tuple:
    """``(MoEConfig, RouterConfig)`` of loose settings: the router's (``router`` its name,
    ``jitter_eps``, ``top_k``, ``router_init_scale``, ``default_decay``, ``router_options``)
    and the layer's (any other :class:`MoEConfig` field), each at its section's default unless
    given; checked as the layer checks them (a ValueError naming the first bad one)."""
    from sparsemixer_jax.moe import MoEConfig
    from sparsemixer_jax.routers import RouterConfig, check_router

    options = {_ROUTER_KEYWORDS[k]: settings.pop(k) for k in list(settings)
               if k in _ROUTER_KEYWORDS}
    options.update(router_options or {})
    moe = MoEConfig(num_experts=experts, **settings)
    if experts >= 1:
        moe.check()
    options.setdefault("jitter_eps", RouterConfig.jitter_eps)
    name = options.pop("name", RouterConfig.name)
    return moe, check_router(name, num_experts=max(experts, 1), where="", **options)


def moe_layer(emb: int, mlp: int, experts: int, mesh=None, **kw):
    """``MoEFeedForward((emb, mlp), *moe_sections(experts, **settings), mesh=mesh)`` of the
    settings in ``kw``, with fixed rngs (unless ``kw`` names them; ``dtype`` too is passed
    on), its state sharded over ``mesh`` when one is given."""
    from sparsemixer_jax.moe import MoEFeedForward
    from sparsemixer_jax.parallel.sharding import shard_state

    rngs = kw.pop("rngs", None) or nnx.Rngs(params=0, dropout=1, router=2)
    extra = {"dtype": kw.pop("dtype")} if "dtype" in kw else {}
    layer = MoEFeedForward((emb, mlp), *moe_sections(experts, **kw), mesh=mesh, rngs=rngs,
                           **extra)
    if mesh is not None:
        shard_state(layer, mesh)
    return layer


def moe_inputs(seed: int, shape: tuple[int, int, int], padding: dict[int, int]):
    """``(x, mask, head)``: normal ``x`` and ``head`` of ``shape`` ``[B, T, emb]`` from
    ``seed``, and a ``[B, T]`` mask that is False from ``padding[row]`` on in those rows."""
    kx, kh = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, shape, jnp.float32)
    mask = jnp.ones(shape[:2], bool)
    for row, start in padding.items():
        mask = mask.at[row, start:].set(False)
    return x, mask, jax.random.normal(kh, shape, jnp.float32)


@nnx.jit(static_argnames=("deterministic", "input_grad"))
def loss_and_grads(layer, x, mask, head, deterministic: bool = False, input_grad: bool = False):
    """``(loss, y, metrics, param grads, input grad)`` of ``sum(y * head) + balance_loss``; the
    input gradient only with ``input_grad`` (None otherwise: nothing more is computed).

    Training mode by default (SparseMixer sampling, its custom router VJP, activation dropout).
    Compiled once per layer configuration (graph structure) and input shape, shared by the tests.
    """

    def loss_fn(layer, x):
        y, metrics = layer(x, mask, deterministic=deterministic)
        return jnp.sum(y * head) + metrics["balance_loss"], (y, metrics)

    if input_grad:
        (loss, (y, metrics)), (grads, dx) = nnx.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True)(layer, x)
        return loss, y, metrics, grads, dx
    (loss, (y, metrics)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(layer, x)
    return loss, y, metrics, grads, None


# ------------------------------------------------------------------------- language models


def lm_logits_and_grads(config, ids: jax.Array, segment_ids: jax.Array, token_mask: jax.Array):
    """``CausalLM(config)`` (params seed 0, router seed 1, evaluation mode) on ``ids [B, T]``
    with packed documents and padding: ``(logits [B, T, V] as numpy, the gradient of the mean
    next-token loss over real tokens with respect to the parameters, nnx.split(model))``."""
    from sparsemixer_jax.models.causal_lm import CausalLM

    model = CausalLM(config, rngs=nnx.Rngs(params=0, router=1))
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        fresh = jax.tree.map(lambda x: x, rest)  # the router's RNG counts, of this trace level
        out = nnx.merge(graphdef, params, fresh).forward(ids, segment_ids=segment_ids,
                                                        token_mask=token_mask)
        logp = jax.nn.log_softmax(out.logits[:, :-1])
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        real = token_mask[:, 1:]
        return jnp.sum(nll * real) / jnp.sum(real), out.logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.asarray(logits), grads, nnx.split(model)


def run_docs_example(monkeypatch, section: str) -> dict:
    """The names that the first ``python`` block under ``section`` (a heading of docs/lm.md,
    e.g. ``"## Routing replay"``) defines, run from the repository's root as the docs say."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "lm.md")) as f:
        text = f.read()
    code = re.search(r"```python\n(.*?)```", text[text.index(section):], re.S).group(1)
    monkeypatch.chdir(root)
    names: dict = {}
    exec(code, names)  # the project's own documentation
    return names
