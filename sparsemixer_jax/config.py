"""The config schema: shared section builders, the one validator, defaults for older configs.

Every experiment config (``configs/*.py``) is an ``ml_collections.ConfigDict`` with a ``task``
(``"translation"``, ``"pretraining"`` or ``"finetuning"``) and sections ``data``, ``model``,
``router``, ``optim``, ``runtime``, ``mesh`` plus the loop's intervals. The sections every task
shares are built here, so they hold the same fields with the same defaults everywhere;
:func:`validate` checks a whole config before any data is read or file written; and
:data:`ADDED_FIELD_DEFAULTS` says how to read a config saved before a field existed.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import ml_collections

from sparsemixer_jax import routers
from sparsemixer_jax.data.sources import check_config as check_translation_data
from sparsemixer_jax.data.text import FIRST_WORD_ID
from sparsemixer_jax.electra import generator_config
from sparsemixer_jax.glue_grid import check_config as check_finetuning
from sparsemixer_jax.initializers import check_init_scheme
from sparsemixer_jax.layers import check_attention_impl
from sparsemixer_jax.moe.layer import check_moe_args
from sparsemixer_jax.runtime import check_runtime_config

TASKS = ("translation", "pretraining", "finetuning")
DTYPES = ("float32", "bfloat16")
BALANCE_NORMALIZATIONS = ("per_token", "per_batch")
# config.optim's choices (:mod:`sparsemixer_jax.training.optim` implements them).
SCHEDULES = ("inverse_sqrt", "linear")
WEIGHT_DECAY_MASKS = ("all", "matrices")

# Fields added after runs were saved without them, with the value that reproduces the behaviour
# those runs had; a value may depend on the saved run's task ({task: value}).
ADDED_FIELD_DEFAULTS: dict[str, Any] = {
    "router.top_k": 1,
    "router.balance_normalization": "per_token",
    "model.attention_impl": "einsum",
    "model.grouped_impl": "mosaic",
    "runtime.deterministic": False,
    "runtime.rng_impl": "threefry2x32",
    "runtime.matmul_precision": "default",
    "runtime.triton_ragged_dot": False,
    "optim.schedule": {"translation": "inverse_sqrt", "pretraining": "linear"},
    "optim.weight_decay_mask": {"translation": "all", "pretraining": "matrices"},
    "optim.init_lr": {"pretraining": 0.0},
    "optim.decay_steps": {"translation": 0},
    "model.activation": "relu",
    "router.init_scale": 1.0,
    "model.absolute_positions": {"pretraining": 0},
    "router.default_decay": 0.9,
    "router.normalize_top_k": False,
    "router.successor_jitter": False,
    "router.default_at_eval": True,
    "router.default_mean": "ungated",
    "router.default_update": "after",
    # Runs saved before the scheme was a choice were initialised by the "flax" scheme.
    "model.init": "flax",
}


# ------------------------------------------------------------------------------ section builders


def router_config(name: str = "sparsemixer", **overrides: Any) -> ml_collections.ConfigDict:
    """``config.router``: the routing function and its auxiliary losses."""
    c = ml_collections.ConfigDict()
    c.name = name  # see sparsemixer_jax.routers.ROUTERS
    c.jitter_eps = 0.1  # Switch jitter r; SparseMixer's mask threshold
    c.top_k = 1  # experts per token (GRIN uses 2 with sparsemixer_v2 / v2star)
    c.balance_weight = 0.01
    c.balance_normalization = "per_token"  # | "per_batch": the reference's fairseq objective
    c.z_loss_weight = 0.0
    c.init_scale = 1.0  # multiplies the router's initial variance (model.init's draw); Switch: 0.1
    # Options of the routers with Switch's forward (sparsemixer_jax.routers.RouterOptions);
    # setting one that the chosen router ignores is an error.
    c.normalize_top_k = False  # gates renormalised over the k chosen (Mixtral, norm_topk_prob)
    c.successor_jitter = False  # densemixer / default_moe*: Switch's jitter (their code: none)
    c.default_decay = 0.9  # default_moe*: EMA decay of the default vectors, in (0, 1)
    c.default_at_eval = True  # default_moe_forward: the defaults in the output at inference too
    c.default_mean = "ungated"  # default_moe*: EMA of expert outputs | "gated": of gate * output
    c.default_update = "after"  # default_moe*: EMA step after the term reads it | "before"
    c.update(overrides)
    return c


def runtime_config(**overrides: Any) -> ml_collections.ConfigDict:
    """``config.runtime``: process-wide JAX settings (:mod:`sparsemixer_jax.runtime`)."""
    c = ml_collections.ConfigDict()
    c.deterministic = False  # XLA:GPU deterministic ops: bit-exact resume on GPU, slower
    c.rng_impl = "threefry2x32"  # jax_default_prng_impl: | "rbg" | "unsafe_rbg"
    c.matmul_precision = "default"  # | "highest": full float32 matmuls (no TF32 on GPU)
    c.triton_ragged_dot = False  # ragged_dot's grouped Pallas/Triton GPU lowering
    c.update(overrides)
    return c


def mesh_config(data: int = -1, expert: int = 1) -> ml_collections.ConfigDict:
    """``config.mesh``: the ``(data, expert)`` device mesh; ``data = -1`` takes every device the
    expert axis leaves."""
    return ml_collections.ConfigDict({"data": data, "expert": expert})


def optim_config(schedule: str, **overrides: Any) -> ml_collections.ConfigDict:
    """``config.optim``: AdamW on a schedule (:mod:`sparsemixer_jax.training.optim`)."""
    c = ml_collections.ConfigDict()
    c.schedule = schedule  # "inverse_sqrt" (fairseq) | "linear" (warm-up, then decay to 0)
    c.peak_lr = 7e-4
    c.init_lr = 0.0  # inverse_sqrt: the warm-up starts here
    c.warmup_steps = 0
    c.decay_steps = 0  # linear: the rate reaches 0 here (kept when a run is extended)
    c.b1 = 0.9
    c.b2 = 0.98
    c.eps = 1e-8
    c.weight_decay = 0.0
    c.weight_decay_mask = "all"  # | "matrices": no decay on biases, LayerNorm, omega
    c.clip_norm = 0.0  # 0 = no clipping
    c.update(overrides)
    return c


def moe_model_fields(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Adds the fields every model section has (widths are the task's) to ``c``."""
    c.dropout = 0.1
    c.attention_dropout = 0.1
    c.activation_dropout = 0.1
    c.num_experts = 4  # 0 = dense
    c.moe_every = 2  # MoE replaces the FFN of layers 0, k, 2k, ...
    c.dispatch = "auto"  # see sparsemixer_jax.moe.DISPATCHES
    c.grouped_impl = "mosaic"  # dispatch "grouped": Hopper kernels ("mosaic"), "tokamax", "xla"
    c.capacity_factor = 0.0  # 0 = dropless; > 0 = Switch-style capacity with dropping
    c.compute_dtype = "float32"  # | "bfloat16" (params stay float32)
    c.attention_impl = "einsum"  # | "xla" | "cudnn" | "auto" (jax.nn.dot_product_attention)
    c.activation = "relu"  # FFN and experts: fairseq's Transformer; BERT / ELECTRA use "gelu"
    # Initialisation scheme (sparsemixer_jax.initializers): "fairseq" = the paper's code
    # (PyTorch nn.Linear defaults for router, experts, FFNs) | "flax" (the earlier scheme).
    c.init = "fairseq"
    return c


# ---------------------------------------------------------------------------- older configs


def task_of(config: Any) -> str:
    """The task of a config, also of one saved before configs named it."""
    task = config.get("task") if hasattr(config, "get") else None
    if task:
        return str(task)
    if "grid" in config:
        return "finetuning"
    model = config.get("model") or {}
    return "translation" if "encoder_layers" in model else "pretraining"


def added_field_default(name: str, task: str) -> Any:
    """The value a config saved before field ``name`` existed stands for; KeyError if none."""
    value = ADDED_FIELD_DEFAULTS[name]
    return value[task] if isinstance(value, dict) else value


def with_defaults(config: ml_collections.ConfigDict | dict) -> ml_collections.ConfigDict:
    """A copy of a saved config with every field of :data:`ADDED_FIELD_DEFAULTS` it lacks (and
    ``task``) filled in, so code reads one schema whatever version wrote the config."""
    plain = json.loads(config.to_json()) if hasattr(config, "to_json") else copy.deepcopy(config)
    task = task_of(plain)
    plain.setdefault("task", task)
    for name, value in ADDED_FIELD_DEFAULTS.items():
        section, field = name.split(".")
        if section not in plain or field in plain[section]:
            continue
        if isinstance(value, dict) and task not in value:
            continue
        plain[section][field] = added_field_default(name, task)
    if task != "finetuning":
        plain.setdefault("runtime", runtime_config().to_dict())
    return ml_collections.ConfigDict(plain)


# ------------------------------------------------------------------------------- the validator


def _positive(config: Any, names: list[str]) -> None:
    for name in names:
        section, _, field = name.rpartition(".")
        value = (config[section] if section else config)[field]
        if not value > 0:
            raise ValueError(f"config.{name} must be > 0, got {value}")


def _check_sections(config: Any, sections: tuple[str, ...], schema: str) -> None:
    missing = [s for s in sections if s not in config]
    if missing:
        raise ValueError(f"config has no {', '.join(missing)} section (schema: {schema})")


def _check_model(m: Any, r: Any) -> None:
    _positive({"model": m}, ["model.emb_dim", "model.mlp_dim", "model.num_heads",
                             "model.moe_every"])
    if m.emb_dim % m.num_heads:
        raise ValueError(
            f"config.model.emb_dim={m.emb_dim} is not divisible by num_heads={m.num_heads}"
        )
    if m.num_experts < 0:
        raise ValueError(f"config.model.num_experts must be >= 0 (0 = dense), got {m.num_experts}")
    for name in ("dropout", "attention_dropout"):
        if not 0.0 <= m[name] < 1.0:
            raise ValueError(f"config.model.{name} must lie in [0, 1), got {m[name]}")
    if m.compute_dtype not in DTYPES:
        raise ValueError(
            f"config.model.compute_dtype must be float32 or bfloat16, got {m.compute_dtype!r}"
        )
    # The MoE layer's own check: its settings are validated here, before a run writes anything,
    # with the same rules its constructor applies.
    check_moe_args(activation_dropout=m.activation_dropout, capacity_factor=m.capacity_factor,
                   dispatch=m.dispatch, grouped_impl=m.grouped_impl, activation=m.activation,
                   router_init_scale=r.init_scale, where="config.model.",
                   router_where="config.router.")
    check_init_scheme(m.init, "config.model.init")
    try:
        check_attention_impl(m.attention_impl, m.attention_dropout)
    except ValueError as err:
        raise ValueError(f"config.model.attention_impl: {err}") from None
    if m.attention_impl == "cudnn" and m.compute_dtype != "bfloat16":
        raise ValueError("config.model.attention_impl='cudnn' needs compute_dtype='bfloat16' "
                         f"(cuDNN's fused attention takes 16-bit inputs), got {m.compute_dtype!r}")
    routers.check_router(r.name, top_k=r.top_k, jitter_eps=r.jitter_eps,
                         num_experts=m.num_experts or None, where="config.router.",
                         **routers.options_from_config(r))
    if r.balance_normalization not in BALANCE_NORMALIZATIONS:
        raise ValueError(f"config.router.balance_normalization={r.balance_normalization!r}; "
                         f"choose one of {BALANCE_NORMALIZATIONS}")


def _check_optim(o: Any) -> None:
    if o.schedule not in SCHEDULES:
        raise ValueError(f"config.optim.schedule={o.schedule!r}; choose one of {SCHEDULES}")
    _positive({"optim": o}, ["optim.peak_lr"])
    if o.warmup_steps < 0 or o.init_lr < 0:
        raise ValueError("config.optim.warmup_steps and init_lr must be >= 0")
    if o.schedule == "linear" and not 0 <= o.warmup_steps < o.decay_steps:
        raise ValueError(f"config.optim.warmup_steps={o.warmup_steps} must lie in [0, "
                         f"decay_steps={o.decay_steps}) for the linear schedule")
    if o.weight_decay < 0 or o.clip_norm < 0:
        raise ValueError("config.optim.weight_decay and clip_norm must be >= 0")
    if o.weight_decay_mask not in WEIGHT_DECAY_MASKS:
        raise ValueError(f"config.optim.weight_decay_mask={o.weight_decay_mask!r}; choose one "
                         f"of {WEIGHT_DECAY_MASKS}")
    for name in ("b1", "b2"):
        if not 0.0 <= o[name] < 1.0:
            raise ValueError(f"config.optim.{name} must lie in [0, 1), got {o[name]}")


def _check_mesh(config: Any) -> None:
    expert, data = int(config.mesh.expert), int(config.mesh.data)
    if expert < 1 or (data < 1 and data != -1):
        raise ValueError(
            f"config.mesh: expert must be >= 1 and data >= 1 or -1, got {config.mesh.to_dict()}"
        )
    n = int(config.model.num_experts)
    if n and n % expert:
        raise ValueError(f"config.model.num_experts={n} is not divisible by "
                         f"config.mesh.expert={expert}")


def _check_translation(config: Any) -> None:
    _check_sections(config, ("data", "model", "router", "optim", "decode", "runtime", "mesh"),
                    "configs/wmt.py")
    _positive(config, ["model.encoder_layers", "model.decoder_layers", "decode.beam_size",
                       "data.vocab_size"])
    o = config.optim
    if not 0.0 <= o.label_smoothing < 1.0:
        raise ValueError(
            f"config.optim.label_smoothing must lie in [0, 1), got {o.label_smoothing}"
        )
    if o.tokens_per_update < 0:
        raise ValueError(f"config.optim.tokens_per_update must be >= 0 (0 = no accumulation), "
                         f"got {o.tokens_per_update}")
    check_translation_data(config)


def _check_pretraining(config: Any) -> None:
    _check_sections(config, ("data", "model", "generator", "router", "optim", "runtime", "mesh"),
                    "configs/electra.py")
    # The discriminator's own fields first: a bad model.* is reported as such, not through the
    # generator that inherits it.
    _check_model(config.model, config.router)
    d = config.data
    _positive(config, ["data.vocab_size", "data.batch_size", "model.num_layers"])
    if d.seq_len < 8:
        raise ValueError(f"config.data.seq_len must be >= 8, got {d.seq_len}")
    if d.vocab_size <= FIRST_WORD_ID:
        raise ValueError(f"config.data.vocab_size must exceed {FIRST_WORD_ID} special ids")
    micro = int(d.micro_batch_size) or int(d.batch_size)
    if micro < 0 or d.batch_size % micro:
        raise ValueError(
            f"config.data.micro_batch_size={d.micro_batch_size} must divide "
            f"config.data.batch_size={d.batch_size} (0 = no accumulation)"
        )
    for name in ("mask_prob", "mask_token_prob", "pair_prob"):
        if not 0.0 <= d[name] <= 1.0:
            raise ValueError(f"config.data.{name} must lie in [0, 1], got {d[name]}")
    positions = config.model.absolute_positions
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 0:
        raise ValueError(f"config.model.absolute_positions must be an int >= 0 (0 = none), got "
                         f"{positions!r}")
    if positions and positions < d.seq_len:
        raise ValueError(f"config.model.absolute_positions={positions} is shorter than "
                         f"config.data.seq_len={d.seq_len}: every position needs an embedding")
    if not d.mask_prob > 0:
        raise ValueError("config.data.mask_prob must be > 0: nothing would be replaced")
    if config.optim.disc_weight < 0:
        raise ValueError(f"config.optim.disc_weight must be >= 0, got {config.optim.disc_weight}")


def _check_generator(config: Any) -> None:
    g = generator_config(config).model  # validates config.generator's fields
    if g.emb_dim % g.num_heads:
        raise ValueError(f"config.generator.num_heads={g.num_heads} does not divide emb_dim")
    if not g.num_layers > 0:
        raise ValueError(f"config.generator.num_layers must be > 0, got {g.num_layers}")


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first field of ``config`` that makes no sense.

    Runs before anything is read, written or compiled: a bad config costs nothing.
    """
    task = task_of(config)
    if task not in TASKS:
        raise ValueError(f"config.task={task!r}; choose one of {TASKS}")
    if task == "finetuning":
        check_finetuning(config)
        return
    if task == "translation":
        _check_translation(config)
        _check_model(config.model, config.router)
    else:
        _check_pretraining(config)  # checks config.model too
        _check_generator(config)  # after the discriminator, whose fields it inherits
    _positive(config, ["train_steps", "eval_every", "checkpoint_every", "log_every"])
    _check_optim(config.optim)
    _check_mesh(config)
    check_runtime_config(config.runtime)
