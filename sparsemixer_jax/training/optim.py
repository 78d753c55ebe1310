"""The optimizer of every task: AdamW on a schedule named by ``config.optim.schedule``.

Both schedules depend on the update count only (not on ``train_steps``), so a run can be extended
without changing its past, and a resumed run recomputes the same learning rates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from sparsemixer_jax.section import check_fraction, check_positive, read_fields

SCHEDULES = ("inverse_sqrt", "linear")
WEIGHT_DECAY_MASKS = ("all", "matrices")

__all__ = ["SCHEDULES", "WEIGHT_DECAY_MASKS", "OptimSettings", "learning_rate_schedule",
           "make_optimizer", "weight_decay_mask"]


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """``config.optim`` as a hashable value (a static argument of the compiled update).

    ``schedule``: ``"inverse_sqrt"`` (fairseq: linear warm-up from ``init_lr`` to ``peak_lr``
    over ``warmup_steps``, then ``peak_lr * sqrt(warmup_steps / step)``; translation) or
    ``"linear"`` (BERT / ELECTRA: warm-up to ``peak_lr``, then linear decay to 0 at
    ``decay_steps``). ``weight_decay_mask``: ``"all"`` parameters decay (fairseq's Adam) or only
    ``"matrices"`` (:func:`weight_decay_mask`, BERT / ELECTRA).
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

    @classmethod
    def from_config(cls, optim: Any, where: str = "config.optim.") -> OptimSettings:
        """The fields of ``optim`` this class has (a section may hold task fields too; the
        task's own settings read those), checked (:meth:`check`)."""
        return cls(**read_fields(cls, optim, where)).check(where)

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


def make_optimizer(optim: OptimSettings) -> optax.GradientTransformation:
    """Optional global-norm clipping, then AdamW on the schedule."""
    parts = []
    if optim.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(optim.clip_norm))
    mask = weight_decay_mask if optim.weight_decay_mask == "matrices" else None
    parts.append(optax.adamw(learning_rate=learning_rate_schedule(optim), b1=optim.b1,
                             b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay,
                             mask=mask))
    return optax.chain(*parts)
