"""The feed-forward sublayers' config section :class:`MoEConfig`, which checks itself.

Needs no Flax (the initialisation schemes' module, which does, is imported by :meth:`check`
only), so that it imports with the layer's pure functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparsemixer_jax.moe.dispatch import ACTIVATIONS, DISPATCHES, GROUPED_IMPLS, is_activation
from sparsemixer_jax.section import read_fields

#: The language model's initialisation (:attr:`MoEConfig.init`): the Hugging Face types' own,
#: every weight ``normal(init_std)``, biases zero.
NORMAL_INIT = "normal"
# The fields a model family sets (the language model's Hugging Face types): no task's config
# schema holds them, and a config section is read without them.
_FAMILY = {"family": True}


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """How a model's feed-forward sublayers are built: which are MoE layers
    (:class:`sparsemixer_jax.moe.MoEFeedForward`) and how they run, read from ``config.model``.

    ``activation``, ``activation_dropout`` and ``init`` are the dense feed-forward layers' too
    (``num_experts = 0`` makes every layer dense), and ``init`` is the whole model's
    initialisation scheme; they are held here because the MoE layer, the one user of every
    field, is configured by this section alone (with the router's :class:`RouterConfig`).

    Attributes:
      num_experts: experts per MoE layer; 0 = a dense model.
      moe_every: MoE replaces the feed-forward layer of layers ``0, k, 2k, ...``.
      dispatch: ``"auto"``, ``"ragged"``, ``"padded"`` or ``"grouped"``
        (:mod:`sparsemixer_jax.moe.dispatch`).
      grouped_impl: the kernels of ``"grouped"``: ``"mosaic"`` (Hopper GPUs), ``"mosaic_2wg"``
        (the same with two consumer warpgroups, 128 x 256 tiles), ``"tokamax"`` or ``"xla"``.
      capacity_factor: 0 for dropless; ``> 0`` caps every expert at
        ``ceil(capacity_factor * rows / N)`` rows.
      expert_buffer_factor: on a mesh with an expert axis of ``E > 1`` devices, 0 gives every
        device's expert exchange room for all rows (dropless, ``E`` times a balanced routing's
        rows); ``f > 0`` sizes it at ``f`` times a balanced routing's rows and drops the rows
        past it (:mod:`sparsemixer_jax.moe.expert_parallel`). No effect on one device.
      activation: the nonlinearity, ``"relu"`` (fairseq's translation Transformer) or
        ``"gelu"`` (BERT / ELECTRA).
      activation_dropout: dropout rate after the nonlinearity.
      init: the initialisation scheme (:mod:`sparsemixer_jax.initializers`), e.g. ``"fairseq"``
        (the default: the paper's code, as the experiment configs initialise), ``"flax"`` or
        ``"flax,router=fairseq"``.
      num_shared_experts: always-on experts beside the routed ones (DeepSeek, Qwen2-MoE), run
        as one dense feed-forward of width ``num_shared_experts * mlp_dim`` on every token;
        0 = none.
      shared_expert_gate: the shared experts' output is multiplied by ``sigmoid(x w)``, a
        learned scalar gate per token (Qwen2-MoE).

    Set by a model family (the language model's types; no config schema holds them):

    Attributes:
      gated: gated experts without biases, ``(act(x w_gate) * (x w_up)) w_down`` (SwiGLU with
        ``activation="silu"``: Mixtral, Qwen-MoE, OLMoE, Phi-3.5-MoE), instead of
        ``act(x wi + bi) wo + bo``. Every dispatch, capacity and expert parallelism take them.
      expert_biases: gated experts with biases ``b_gate``, ``b_up`` ``[N, mlp]`` and ``b_down``
        ``[N, emb]`` (gpt-oss), zeros at init.
      router_bias: whether the router ``Linear`` has a bias (most Hugging Face MoE language
        models' routers have none; gpt-oss's has one).
      selection_bias: the layer holds a per-expert selection bias as its bias state (GLM-4.5's
        ``e_score_correction_bias``), also without bias balancing.
      input_jitter: in training, the layer's input is multiplied by ``U(1 - e, 1 + e)`` per
        element (Mixtral's ``router_jitter_noise``, Phi-3.5-MoE's ``input_jitter_noise``); 0:
        none.
      init_std: the standard deviation of ``init="normal"`` (the types' ``initializer_range``).
      input_gates: each chosen expert's gate is the sigmoid of its router logit and scales the
        expert's input, the outputs summed unscaled (Llama 4; the router only selects: its
        ``switch`` top-k of the logits), instead of the router's gates scaling the outputs.
    """

    num_experts: int = 0
    moe_every: int = 1
    dispatch: str = "auto"
    grouped_impl: str = "mosaic"
    capacity_factor: float = 0.0
    expert_buffer_factor: float = 0.0
    activation: str = "relu"
    activation_dropout: float = 0.1
    init: str = "fairseq"
    num_shared_experts: int = 0
    shared_expert_gate: bool = False
    gated: bool = dataclasses.field(default=False, metadata=_FAMILY)
    expert_biases: bool = dataclasses.field(default=False, metadata=_FAMILY)
    router_bias: bool = dataclasses.field(default=True, metadata=_FAMILY)
    selection_bias: bool = dataclasses.field(default=False, metadata=_FAMILY)
    input_jitter: float = dataclasses.field(default=0.0, metadata=_FAMILY)
    init_std: float = dataclasses.field(default=0.02, metadata=_FAMILY)
    input_gates: bool = dataclasses.field(default=False, metadata=_FAMILY)

    @classmethod
    def from_config(cls, section: Any, where: str = "config.model.") -> MoEConfig:
        """The fields of ``section`` (``config.model``), checked (:meth:`check`); the fields a
        model family sets (:func:`family_fields`) keep their defaults."""
        return cls(**read_fields(cls, section, where, skip=family_fields())).check(where)

    def check(self, where: str = "") -> MoEConfig:
        """``self`` if every field is usable, else a one-line ValueError naming the first one
        that is not with the prefix ``where`` (``"config.model."`` names config fields)."""
        if self.num_experts < 0:
            raise ValueError(f"{where}num_experts must be >= 0 (0 = dense), got "
                             f"{self.num_experts}")
        shared = self.num_shared_experts
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            raise ValueError(f"{where}num_shared_experts must be an int >= 0 (0 = none), got "
                             f"{shared!r}")
        if shared and not self.num_experts:
            raise ValueError(f"{where}num_shared_experts={shared} needs routed experts beside "
                             f"them, but num_experts=0 (a dense model)")
        if self.shared_expert_gate and not shared:
            raise ValueError(f"{where}shared_expert_gate=True has no effect with "
                             f"num_shared_experts=0")
        if self.expert_biases and not self.gated:
            raise ValueError(f"{where}expert_biases=True is for gated experts (the others always "
                             "have biases); set gated=True")
        if not 0.0 <= self.input_jitter < 1.0:
            raise ValueError(f"{where}input_jitter must lie in [0, 1), got {self.input_jitter}")
        if not self.init_std > 0:
            raise ValueError(f"{where}init_std must be > 0, got {self.init_std}")
        if not self.moe_every > 0:
            raise ValueError(f"{where}moe_every must be > 0, got {self.moe_every}")
        if not 0.0 <= self.activation_dropout < 1.0:
            raise ValueError(f"{where}activation_dropout must lie in [0, 1), got "
                             f"{self.activation_dropout}")
        if self.capacity_factor < 0:
            raise ValueError(f"{where}capacity_factor must be >= 0 (0 = dropless), got "
                             f"{self.capacity_factor}")
        if not self.expert_buffer_factor >= 0:
            raise ValueError(f"{where}expert_buffer_factor must be >= 0 (0 = room for every "
                             f"row), got {self.expert_buffer_factor}")
        for name, choices in (("dispatch", DISPATCHES), ("activation", ACTIVATIONS)):
            value = getattr(self, name)
            if value not in choices and not (name == "activation" and is_activation(value)):
                raise ValueError(f"{where}{name}={value!r}; choose one of {choices}" if where
                                 else f"unknown {name} {value!r}; expected one of {choices}")
        if self.grouped_impl not in GROUPED_IMPLS:
            raise ValueError(f"{where}grouped_impl={self.grouped_impl!r}; choose one of "
                             f"{GROUPED_IMPLS}")
        if self.init != NORMAL_INIT:
            from sparsemixer_jax.initializers import check_init_scheme

            check_init_scheme(self.init, f"{where}init" if where else "init")
        return self

    def is_moe(self, layer: int) -> bool:
        """Whether the feed-forward sublayer of ``layer`` (from 0) is an MoE layer."""
        return self.num_experts > 0 and layer % self.moe_every == 0


def family_fields() -> tuple[str, ...]:
    """The :class:`MoEConfig` fields a model family sets, which no config schema holds."""
    return tuple(f.name for f in dataclasses.fields(MoEConfig) if f.metadata.get("family"))
