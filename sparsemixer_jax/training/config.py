"""The config schema: shared section builders, the one validator, defaults for older configs.

Every experiment config (``configs/*.py``) is an ``ml_collections.ConfigDict`` with a ``task``
(``"translation"``, ``"pretraining"``, ``"finetuning"`` or ``"lm"``) and sections ``data``,
``model``, ``router``, ``optim``, ``runtime``, ``mesh`` plus the loop's intervals. The sections
every task shares are built here, so they hold the same fields with the same defaults everywhere
(the typed sections' own: ``tests/test_config_defaults.py``);
:data:`ADDED_FIELD_DEFAULTS` says how to read a config saved before a field existed; and
:func:`validate` checks the rules between sections. Each section's own fields are checked by
its typed value, owned by the code it configures (``RouterConfig.from_config``,
``MoEConfig.from_config``, ...); a task's ``from_config`` (:data:`sparsemixer_jax.tasks.TASKS`
registers each task) builds every section of the task and then calls :func:`validate`, before
any data is read or file written.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import ml_collections

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
    "router.score": "softmax",
    "router.routed_scaling_factor": 1.0,
    "router.bias_update_rate": 0.0,
    "router.balance_scope": "micro_batch",
    "router.num_groups": 1,
    "router.top_groups": 1,
    "router.group_score": "max",
    "model.num_shared_experts": 0,
    "model.shared_expert_gate": False,
    # Runs saved before the scheme was a choice were initialised by the "flax" scheme.
    "model.init": "flax",
    # Language-modelling runs saved before chat data trained on text.
    "data.format": {"lm": "text"},
    "data.on_bad_row": {"lm": "skip"},
    "data.tokenizer": {"lm": "spm"},
    "router.trainable": True,
    "optim.router_lr_scale": 1.0,
    "optim.train_only": "all",
    # Language-modelling runs saved before cuDNN could take packed documents as offsets.
    "model.cudnn_document_mask": {"lm": "bias"},
    "model.max_segments_per_row": {"lm": 64},
    # Runs saved before the expert exchange's buffers were sized had room for every row.
    "model.expert_buffer_factor": 0.0,
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
    # Options of the routers with Switch's forward (sparsemixer_jax.routers.RouterConfig);
    # setting one that the chosen router ignores is an error.
    c.normalize_top_k = False  # gates renormalised over the k chosen (Mixtral, norm_topk_prob)
    c.successor_jitter = False  # densemixer / default_moe*: Switch's jitter (their code: none)
    c.default_decay = 0.9  # default_moe*: EMA decay of the default vectors, in (0, 1)
    c.default_at_eval = True  # default_moe_forward: the defaults in the output at inference too
    c.default_mean = "ungated"  # default_moe*: EMA of expert outputs | "gated": of gate * output
    c.default_update = "after"  # default_moe*: EMA step after the term reads it | "before"
    # Routing options (docs/routing.md: how each composes with each router).
    c.score = "softmax"  # | "sigmoid": DeepSeek-V3 scores, gates renormalised over the chosen
    c.routed_scaling_factor = 1.0  # sigmoid: multiplies the renormalised gates (DeepSeek-V3: 2.5)
    c.bias_update_rate = 0.0  # > 0: loss-free balancing by a selection-only bias (0 = off)
    c.balance_scope = "micro_batch"  # | "sequence" | "global_batch": the balance loss's counts
    c.num_groups = 1  # group-limited routing: experts in num_groups groups (1 = off) ...
    c.top_groups = 1  # ... of which each token keeps top_groups
    c.group_score = "max"  # a group's score: its best expert's | "top2_sum" (DeepSeek-V3, GLM)
    c.trainable = True  # False: every router's weights stay as they start (fine-tuning)
    c.update(overrides)
    return c


def runtime_config(**overrides: Any) -> ml_collections.ConfigDict:
    """``config.runtime``: process-wide JAX settings (:mod:`sparsemixer_jax.training.runtime`)."""
    c = ml_collections.ConfigDict()
    c.deterministic = False  # XLA:GPU deterministic ops: bit-exact resume on GPU, slower
    c.rng_impl = "threefry2x32"  # jax_default_prng_impl: | "rbg" | "unsafe_rbg"
    c.matmul_precision = "default"  # | "highest": full float32 matmuls (no TF32 on GPU)
    c.triton_ragged_dot = False  # ragged_dot's grouped Pallas/Triton GPU lowering
    c.update(overrides)
    return c


def mesh_config(data: int = -1, expert: int = 1, fsdp: int = 1,
                **rules: str | list[str] | None) -> ml_collections.ConfigDict:
    """``config.mesh``: the ``(data, fsdp, expert)`` device mesh (``data = -1`` takes every
    device the other axes leave) and ``rules``, the mesh axes of each logical axis name
    (:mod:`sparsemixer_jax.parallel.partitioning`; keyword arguments override its defaults)."""
    from sparsemixer_jax.parallel.partitioning import DEFAULT_RULES  # plain Python tables, JAX only

    c = ml_collections.ConfigDict({"data": data, "fsdp": fsdp, "expert": expert})
    # Lists, not tuples: the rules must read the same after a round trip through config.json.
    c.rules = ml_collections.ConfigDict(
        {name: list(axes) if isinstance(axes, tuple) else axes
         for name, axes in {**DEFAULT_RULES, **rules}.items()}, type_safe=False)
    return c


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
    # Fine-tuning policies (docs/lm.md): the routers' learning rate as a multiple of the rest's,
    # and which parameters train: "all" | "routers" | "experts" | "non_experts".
    c.router_lr_scale = 1.0
    c.train_only = "all"
    c.update(overrides)
    return c


def moe_model_fields(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Adds the fields every model section has (widths are the task's) to ``c``, each at its
    typed section's default (``ModelConfig``'s and ``MoEConfig``'s); a task's config sets what
    it chooses otherwise (the paper's: the number of experts, MoE on every other layer)."""
    c.dropout = 0.1
    c.attention_dropout = 0.1
    c.activation_dropout = 0.1
    c.num_experts = 0  # 0 = dense
    c.moe_every = 1  # MoE replaces the FFN of layers 0, k, 2k, ...
    c.dispatch = "auto"  # see sparsemixer_jax.moe.DISPATCHES
    c.grouped_impl = "mosaic"  # dispatch "grouped": Hopper kernels ("mosaic"), "tokamax", "xla"
    c.capacity_factor = 0.0  # 0 = dropless; > 0 = Switch-style capacity with dropping
    # Expert mesh only: 0 = exchange buffers with room for every row (dropless); f > 0 = f times
    # a balanced routing's rows per device, rows past them dropped.
    c.expert_buffer_factor = 0.0
    c.num_shared_experts = 0  # always-on experts beside the routed ones (DeepSeek, Qwen2-MoE)
    c.shared_expert_gate = False  # the shared experts' output times sigmoid(x w) (Qwen2-MoE)
    c.compute_dtype = "float32"  # | "bfloat16" (params stay float32)
    # | "xla" | "cudnn" | "auto" (jax.nn.dot_product_attention) | "splash" (TPU, language models)
    c.attention_impl = "einsum"
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


def as_json(config: ml_collections.ConfigDict | dict) -> str:
    """``config`` as the JSON text a run saves (``{workdir}/config.json``)."""
    return config.to_json(indent=1) if hasattr(config, "to_json") else json.dumps(config, indent=1)


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
#
# Each section checks its own fields when its typed value is built, by the code it configures
# (RouterConfig, MoEConfig, TransformerConfig / EncoderConfig, the data, optimiser, decoding,
# runtime and mesh sections; a task's from_config builds every section of the task). What is
# left here are the rules that join two sections, which no section can check
# alone; so this module imports no model code.


def _check_experts(config: Any, router: Any) -> None:
    """The router (``router``, the section's typed value) and the mesh against the model's
    experts."""
    n, top_k = config.model.num_experts, config.router.top_k
    if n and top_k > n:
        raise ValueError(
            f"config.router.top_k={top_k} is larger than num_experts={n} (a token picks "
            f"distinct experts); top_k must be an int in [1, num_experts={n}], got {top_k}")
    router.check("config.router.", num_experts=n or None)  # groups against experts
    generator = config.get("generator") or {}
    if generator.get("num_experts"):  # ELECTRA's generator routes with the same router
        router.check("config.router.", num_experts=generator["num_experts"])
    expert = config.mesh.expert
    if n and expert >= 1 and n % expert:
        raise ValueError(f"config.model.num_experts={n} is not divisible by "
                         f"config.mesh.expert={expert}")


def _check_pretraining(config: Any) -> None:
    """The model's learned positions against the data's sequence length."""
    positions, seq_len = config.model.absolute_positions, config.data.seq_len
    if positions and positions < seq_len:
        raise ValueError(f"config.model.absolute_positions={positions} is shorter than "
                         f"config.data.seq_len={seq_len}: every position needs an embedding")


def validate(config: ml_collections.ConfigDict, router: Any) -> None:
    """Raises ValueError for the first rule between two sections of ``config`` that fails (the
    sections' own fields are checked by their typed values, module comment above; ``router``
    is the router section's, a :class:`~sparsemixer_jax.routers.RouterConfig`).

    Runs once per run, before anything is read, written or compiled: a bad config costs nothing.
    """
    if task_of(config) == "pretraining":
        _check_pretraining(config)
    _check_experts(config, router)
