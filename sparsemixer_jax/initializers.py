"""Parameter initialisation schemes (``config.model.init``): which distribution each weight and
bias of the router, the experts, the dense feed-forward and attention is drawn from.

``"fairseq"`` is the paper's code (microsoft/SparseMixer, ``example/moe``, on fairseq 0.12.1):
its router (``gating_network``), experts and dense ``fc1``/``fc2`` are plain PyTorch
``nn.Linear`` layers, whose default draws weight and bias alike from ``U(+-1/sqrt(fan_in))``;
fairseq's ``MultiheadAttention`` redraws the q/k/v weights Xavier-uniform with gain
``1/sqrt(2)`` and the output projection Xavier-uniform with a zero bias, and leaves the q/k/v
biases at ``nn.Linear``'s default.

``"flax"`` is the scheme this project used before it followed the paper's code, kept under its
own name so that runs made with it can be reproduced: a truncated-normal router of variance
``1/fan_in``, LeCun-normal experts, Xavier-uniform dense feed-forward and attention, all biases
zero.

``"admin"`` draws as ``"fairseq"`` and adds Admin's residual scales (Liu et al., 2020,
"Understanding the Difficulty of Training Transformers"), the initialisation the paper uses for
its ELECTRA models: each post-norm sublayer computes ``LayerNorm(omega_i * x + f_i(x))`` with a
trainable ``omega_i [emb]`` that a profiling pass on a batch of data sets to the standard
deviation the residual stream has reached, ``omega_i^2 = Var[omega_{i-1} x_{i-1}] +
Var[f_{i-1}(x_{i-1})]`` (:meth:`sparsemixer_jax.models.encoder.Encoder.set_admin_scales`). The
ELECTRA encoder has them; the translation model refuses the scheme.

Token embeddings and LayerNorms are the models' own in every scheme (fairseq's
``N(0, emb^-1/2)`` table for translation, BERT's ``N(0, 0.02)`` for the ELECTRA encoder;
LayerNorm ones and zeros).

A spec may set a component apart from the rest, to tell which part of a scheme matters:
``"flax,router=fairseq"`` draws the router as the paper's code does and everything else as
``flax``. The components are :data:`COMPONENTS`: ``router``, ``experts``, ``ffn`` (the dense
feed-forward layers) and ``attention``.

``router_init_scale`` multiplies the variance of whatever the scheme draws for the router
(weight and bias), so 1.0 is the scheme itself and 0.1 the Switch Transformer's smaller router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

InitScheme = Literal["fairseq", "flax"]
INIT_SCHEMES: tuple[str, ...] = ("fairseq", "flax", "admin")
# The schemes a component can be drawn by ("admin" draws as "fairseq").
DRAWS: tuple[str, ...] = ("fairseq", "flax")
COMPONENTS: tuple[str, ...] = ("router", "experts", "ffn", "attention")

Initializer = nnx.initializers.Initializer


def component_schemes(spec: str, where: str = "init") -> dict[str, InitScheme]:
    """``{component: scheme}`` of a spec ``"<scheme>[,<component>=<scheme>]..."``; ValueError
    naming ``where`` and the part that is wrong."""
    base, *parts = str(spec).split(",")
    if base not in INIT_SCHEMES:
        raise ValueError(f"{where}={spec!r}; choose one of {INIT_SCHEMES}, optionally followed "
                         f"by ,COMPONENT=SCHEME for COMPONENT in {COMPONENTS}")
    schemes = dict.fromkeys(COMPONENTS, "fairseq" if base == "admin" else base)
    for part in parts:
        component, _, scheme = part.partition("=")
        if component not in COMPONENTS or scheme not in DRAWS:
            raise ValueError(f"{where}={spec!r}: {part!r} is not COMPONENT=SCHEME with "
                             f"COMPONENT in {COMPONENTS} and SCHEME in {DRAWS}")
        schemes[component] = scheme
    return schemes


def check_init_scheme(spec: str, where: str = "init") -> None:
    """ValueError naming ``where`` if ``spec`` is not a scheme of :data:`INIT_SCHEMES`
    (optionally with components set apart, see :func:`component_schemes`)."""
    component_schemes(spec, where)


def uses_admin(spec: str) -> bool:
    """Whether ``spec`` asks for Admin's residual scales (scheme ``"admin"``)."""
    return str(spec).split(",")[0] == "admin"


def scheme_of(spec: str, component: str) -> InitScheme:
    """The scheme ``spec`` gives ``component``."""
    return component_schemes(spec)[component]


def torch_linear_default(fan_in: int, variance_scale: float = 1.0) -> Initializer:
    """PyTorch ``nn.Linear``'s default draw for weight and bias, ``U(+-sqrt(scale / fan_in))``
    (``kaiming_uniform_(a=sqrt(5))`` gives the weight that bound; the bias is drawn to it
    directly); ``variance_scale`` multiplies the variance."""
    bound = math.sqrt(variance_scale / fan_in)

    def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


@dataclass(frozen=True)
class LinearInit:
    """The initialisers of one linear map: ``kernel`` and ``bias`` (called with a key, the
    shape and the dtype, as flax's initialisers are); ``bias=None`` is a zero bias."""

    kernel: Initializer
    bias: Initializer | None = None

    def draw_bias(self, rngs: nnx.Rngs, shape: tuple[int, ...]) -> jax.Array:
        """A float32 bias of ``shape``; a zero bias draws no key, so a scheme with zero biases
        consumes the ``params`` stream exactly as before biases were drawn."""
        if self.bias is None:
            return jnp.zeros(shape, jnp.float32)
        return self.bias(rngs.params(), shape, jnp.float32)

    def linear(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs,
               **kwargs) -> nnx.Linear:
        """An ``nnx.Linear`` with these initialisers (it draws a bias key either way)."""
        bias = self.bias or nnx.initializers.zeros_init()
        return nnx.Linear(in_features, out_features, kernel_init=self.kernel, bias_init=bias,
                          dtype=dtype, rngs=rngs, **kwargs)

# fairseq's attention weights (both schemes): Xavier-uniform, gain 1/sqrt(2) (variance scale
# 1/2) on the query/key/value projections.
_xavier = nnx.initializers.xavier_uniform()
_xavier_qkv = nnx.initializers.variance_scaling(0.5, "fan_avg", "uniform")


def router_init(spec: str, emb_dim: int, variance_scale: float = 1.0) -> LinearInit:
    """The router ``emb_dim -> N``, its variance times ``variance_scale``."""
    if scheme_of(spec, "router") == "fairseq":
        draw = torch_linear_default(emb_dim, variance_scale)
        return LinearInit(draw, draw)
    return LinearInit(
        nnx.initializers.variance_scaling(variance_scale, "fan_in", "truncated_normal"))


def feed_forward_init(spec: str, fan_in: int) -> LinearInit:
    """A dense feed-forward layer (``fc1``/``fc2``) with ``fan_in`` inputs."""
    if scheme_of(spec, "ffn") == "fairseq":
        draw = torch_linear_default(fan_in)
        return LinearInit(draw, draw)
    return LinearInit(_xavier)


def expert_init(spec: str, fan_in: int) -> LinearInit:
    """One expert-stacked layer: kernel ``[N, fan_in, fan_out]``, bias ``[N, fan_out]``."""
    if scheme_of(spec, "experts") == "fairseq":
        draw = torch_linear_default(fan_in)  # each expert an nn.Linear of its own
        return LinearInit(draw, draw)
    return LinearInit(nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,)))


def attention_init(spec: str, emb_dim: int) -> dict[str, LinearInit]:
    """``{"qkv": ..., "out": ...}`` for attention over width ``emb_dim``: the same weights in both
    schemes; fairseq leaves the q/k/v biases at ``nn.Linear``'s default."""
    fairseq = scheme_of(spec, "attention") == "fairseq"
    qkv_bias = torch_linear_default(emb_dim) if fairseq else None
    return {"qkv": LinearInit(_xavier_qkv, qkv_bias), "out": LinearInit(_xavier)}
