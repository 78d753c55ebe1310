"""The optimizer of every task: AdamW on a schedule named by ``config.optim.schedule``.

Both schedules depend on the update count only (not on ``train_steps``), so a run can be extended
without changing its past, and a resumed run recomputes the same learning rates.

Fine-tuning policies (``config.router.trainable``, ``config.optim.train_only``,
``config.optim.router_lr_scale``) give each parameter a label by its role in the model
(:class:`ParamRoles`: a router's weights, an expert's, or neither) and the optimizer one
transformation per label (``optax.multi_transform``): frozen parameters get a zero update and
no optimizer state, the routers AdamW at their own learning rate, the rest AdamW. Without a
policy the optimizer is the plain chain it always was, so earlier checkpoints resume unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from sparsemixer_jax.section import (
    cast,
    check_choice,
    check_fraction,
    check_positive,
    get_field,
    has_field,
    read_fields,
)

SCHEDULES = ("inverse_sqrt", "linear")
WEIGHT_DECAY_MASKS = ("all", "matrices")
#: What ``config.optim.train_only`` may name: every parameter, the routers' weights, the
#: experts' (:class:`ParamRoles`), or every parameter but the experts'.
TRAIN_ONLY = ("all", "routers", "experts", "non_experts")
# The optimizer's labels of parameters under a fine-tuning policy.
ROUTER, REST, FROZEN = "router", "rest", "frozen"

__all__ = ["FROZEN", "SCHEDULES", "TRAIN_ONLY", "WEIGHT_DECAY_MASKS", "OptimSettings",
           "ParamRoles", "learning_rate_schedule", "make_optimizer", "param_labels",
           "weight_decay_mask"]


Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ParamRoles:
    """Which parameters are routers' and which experts', as path prefixes into the parameter
    tree (keys as strings; hashable, so that it travels in the static :class:`OptimSettings`).

    ``routers``: each MoE layer's router (its linear map to expert logits). ``experts``: each
    MoE layer's routed experts (stacked ``[N, ...]`` weights and biases) and SparseMixer's
    ``omega``, which scales their output and folds into them
    (:func:`sparsemixer_jax.moe.fold_omega`). Every other parameter, shared experts included
    (always on: a dense feed-forward in effect), is neither.
    """

    routers: tuple[Path, ...] = ()
    experts: tuple[Path, ...] = ()

    def role(self, path: Path) -> str:
        """``"router"``, ``"expert"`` or ``"other"`` for the parameter at ``path``."""
        def under(prefixes):
            return any(path[:len(p)] == p for p in prefixes)

        return "router" if under(self.routers) else "expert" if under(self.experts) else "other"


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """``config.optim`` as a hashable value (a static argument of the compiled update).

    ``schedule``: ``"inverse_sqrt"`` (fairseq: linear warm-up from ``init_lr`` to ``peak_lr``
    over ``warmup_steps``, then ``peak_lr * sqrt(warmup_steps / step)``; translation) or
    ``"linear"`` (BERT / ELECTRA: warm-up to ``peak_lr``, then linear decay to 0 at
    ``decay_steps``). ``weight_decay_mask``: ``"all"`` parameters decay (fairseq's Adam) or only
    ``"matrices"`` (:func:`weight_decay_mask`, BERT / ELECTRA).

    The fine-tuning policy (module docstring): ``train_only`` (:data:`TRAIN_ONLY`) names the
    parameters that train, ``train_routers`` (``config.router.trainable``) False freezes the
    routers whatever ``train_only`` says, ``router_lr_scale`` multiplies the routers' learning
    rate. ``roles`` says which parameters are routers and experts; :class:`Steps
    <sparsemixer_jax.training.steps.Steps>` fills it from the model when a policy is set.
    """

    schedule: str = "inverse_sqrt"
    peak_lr: float = 7e-4
    init_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int = 0
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mask: str = "all"
    clip_norm: float = 0.0
    router_lr_scale: float = 1.0
    train_only: str = "all"
    train_routers: bool = True
    roles: ParamRoles | None = None

    @classmethod
    def from_config(cls, optim: Any, where: str = "config.optim.", *,
                    router: Any = None) -> OptimSettings:
        """The fields of ``optim`` this class has (a section may hold task fields too; the
        task's own settings read those), checked (:meth:`check`). ``router``: the run's router
        section, whose ``trainable`` is :attr:`train_routers` (absent: True)."""
        trainable = True
        if router is not None and has_field(router, "trainable"):
            trainable = cast(bool, get_field(router, "trainable"), "config.router.trainable")
        return cls(**read_fields(cls, optim, where, skip=("train_routers", "roles")),
                   train_routers=trainable).check(where)

    @property
    def has_policy(self) -> bool:
        """Whether some parameters are frozen or the routers have their own learning rate."""
        return self.train_only != "all" or not self.train_routers or self.router_lr_scale != 1.0

    def trains(self, role: str) -> bool:
        """Whether the parameters of ``role`` (:meth:`ParamRoles.role`) train."""
        if role == "router" and not self.train_routers:
            return False
        return {"all": True, "routers": role == "router", "experts": role == "expert",
                "non_experts": role != "expert"}[self.train_only]

    def check(self, where: str = "") -> OptimSettings:
        """``self`` if every field is usable, else a one-line ValueError naming the first one
        that is not with the prefix ``where``."""
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{where}schedule={self.schedule!r}; choose one of {SCHEDULES}")
        check_positive(where, peak_lr=self.peak_lr)
        if self.warmup_steps < 0 or self.init_lr < 0:
            raise ValueError(f"{where}warmup_steps and init_lr must be >= 0")
        if self.schedule == "linear" and not 0 <= self.warmup_steps < self.decay_steps:
            raise ValueError(f"{where}warmup_steps={self.warmup_steps} must lie in [0, "
                             f"decay_steps={self.decay_steps}) for the linear schedule")
        if self.weight_decay < 0 or self.clip_norm < 0:
            raise ValueError(f"{where}weight_decay and clip_norm must be >= 0")
        if self.weight_decay_mask not in WEIGHT_DECAY_MASKS:
            raise ValueError(f"{where}weight_decay_mask={self.weight_decay_mask!r}; choose one "
                             f"of {WEIGHT_DECAY_MASKS}")
        check_fraction(where, b1=self.b1, b2=self.b2)
        check_positive(where, router_lr_scale=self.router_lr_scale)
        check_choice(where, "train_only", self.train_only, TRAIN_ONLY)
        if self.train_only == "routers" and not self.train_routers:
            raise ValueError(f"{where}train_only='routers' with config.router.trainable=False "
                             "trains no parameter")
        if self.router_lr_scale != 1.0 and not self.trains("router"):
            raise ValueError(f"{where}router_lr_scale={self.router_lr_scale} has no effect: the "
                             "routers do not train (config.router.trainable, "
                             f"{where}train_only={self.train_only!r})")
        return self


def inverse_sqrt_schedule(peak_lr: float, init_lr: float,
                          warmup_steps: int) -> Callable[[jax.Array], jax.Array]:
    """fairseq's ``inverse_sqrt``: the rate of update ``count`` (optax counts from 0)."""
    peak, init, warmup = float(peak_lr), float(init_lr), int(warmup_steps)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        if warmup == 0:
            return jnp.full_like(step, peak) / jnp.sqrt(jnp.maximum(step, 1.0))
        warm = init + (peak - init) * step / warmup
        decay = peak * jnp.sqrt(warmup / jnp.maximum(step, 1.0))
        return jnp.where(step < warmup, warm, decay)

    return schedule


def linear_schedule(peak_lr: float, warmup_steps: int,
                    decay_steps: int) -> Callable[[jax.Array], jax.Array]:
    """Linear warm-up to ``peak_lr`` over ``warmup_steps`` updates, then linear decay to 0 at
    ``decay_steps``. Written by hand rather than with optax's linear schedules because optax
    counts from 0, which would make the first update's learning rate 0."""
    peak, warmup, decay = float(peak_lr), int(warmup_steps), int(decay_steps)

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + 1.0  # the update being computed, from 1
        warm = peak * step / max(warmup, 1)
        decayed = peak * jnp.maximum(decay - step, 0.0) / max(decay - warmup, 1)
        return jnp.where(step <= warmup, warm, decayed)

    return schedule


def learning_rate_schedule(optim: OptimSettings) -> Callable[[jax.Array], jax.Array]:
    """The schedule ``optim.schedule`` names."""
    if optim.schedule == "inverse_sqrt":
        return inverse_sqrt_schedule(optim.peak_lr, optim.init_lr, optim.warmup_steps)
    if optim.schedule == "linear":
        return linear_schedule(optim.peak_lr, optim.warmup_steps, optim.decay_steps)
    raise ValueError(f"optim.schedule={optim.schedule!r}; choose one of {SCHEDULES}")


def weight_decay_mask(params: Any) -> Any:
    """True for the weights that decay: matrices and embedding tables (kernels, stacked experts),
    not biases, LayerNorm scales, SparseMixer's omega, Admin's residual scales, nor MoE expert
    biases ``bi``/``bo`` (``[E, F]``: matrices by shape, biases by role), as BERT / ELECTRA."""

    def decays(path, leaf) -> bool:
        name = str(getattr(path[-1], "key", path[-1])) if path else ""
        return leaf.ndim >= 2 and "bias" not in name and name not in ("bi", "bo")

    return jax.tree_util.tree_map_with_path(decays, params)


def param_labels(optim: OptimSettings, params: Any) -> Any:
    """The optimizer's label of every parameter under ``optim``'s policy: ``"frozen"``,
    ``"router"`` (a trained router's weights) or ``"rest"`` (every other trained one)."""
    roles = optim.roles or ParamRoles()

    def label(path, _) -> str:
        role = roles.role(tuple(str(getattr(k, "key", k)) for k in path))
        return FROZEN if not optim.trains(role) else ROUTER if role == "router" else REST

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(optim: OptimSettings) -> optax.GradientTransformation:
    """Optional global-norm clipping, then AdamW on the schedule; under a fine-tuning policy
    (:attr:`OptimSettings.has_policy`) frozen parameters' gradients are zeroed before the
    clipping (which then measures the trained ones alone) and each label gets its own
    transformation (``optax.multi_transform``)."""
    schedule = learning_rate_schedule(optim)
    mask = weight_decay_mask if optim.weight_decay_mask == "matrices" else None

    def adamw(learning_rate):
        return optax.adamw(learning_rate=learning_rate, b1=optim.b1, b2=optim.b2,
                           eps=optim.eps, weight_decay=optim.weight_decay, mask=mask)

    clip = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm > 0 else []
    if not optim.has_policy:
        return optax.chain(*clip, adamw(schedule))

    def labels(params):
        return param_labels(optim, params)

    def frozen(params):
        return jax.tree.map(lambda label: label == FROZEN, labels(params))

    scale = optim.router_lr_scale
    return optax.chain(
        optax.masked(optax.set_to_zero(), frozen), *clip,
        optax.multi_transform({FROZEN: optax.set_to_zero(), REST: adamw(schedule),
                               ROUTER: adamw(lambda count: scale * schedule(count))}, labels))
