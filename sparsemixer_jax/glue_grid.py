"""The GLUE fine-tuning search space (``config.grid``) and the checks of a fine-tuning config.

A leaf module (it imports nothing of the package), so that the config validator
(:func:`sparsemixer_jax.config.validate`) checks a fine-tuning config without importing the
fine-tuning code (:mod:`sparsemixer_jax.tasks.finetuning`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One fine-tuning setting of the search space."""

    learning_rate: float
    epochs: int
    batch_size: int
    weight_decay: float
    warmup: float  # share of the training steps spent warming up

    @property
    def name(self) -> str:
        return (f"lr{self.learning_rate:g}_ep{self.epochs}_bs{self.batch_size}"
                f"_wd{self.weight_decay:g}_wu{self.warmup:g}")


def grid_points(grid: Any) -> list[GridPoint]:
    """Every combination of ``grid``'s lists, in a fixed order (learning rate outermost)."""
    fields = [f.name for f in dataclasses.fields(GridPoint)]
    values = []
    for name in fields:
        options = list(grid[name])
        if not options:
            raise ValueError(f"config.grid.{name} is empty")
        values.append(options)
    points = [GridPoint(float(lr), int(ep), int(bs), float(wd), float(wu))
              for lr, ep, bs, wd, wu in itertools.product(*values)]
    for p in points:
        if not (p.learning_rate > 0 and p.epochs > 0 and p.batch_size > 0
                and p.weight_decay >= 0 and 0 <= p.warmup < 1):
            raise ValueError(f"config.grid gives an invalid point {p}")
    return points


def check_config(config: Any) -> None:
    """Raises ``ValueError`` naming the first field that makes no sense, before anything loads."""
    for name in ("max_len", "eval_batch_size", "length_step"):
        if not int(config[name]) > 0:
            raise ValueError(f"config.{name} must be > 0, got {config[name]}")
    for name in ("train_limit", "dev_limit"):
        if int(config[name]) < 0:
            raise ValueError(f"config.{name} must be >= 0 (0 = all), got {config[name]}")
    if not 0 <= float(config.head_dropout) < 1:
        raise ValueError(f"config.head_dropout must be in [0, 1), got {config.head_dropout}")
    grid_points(config.grid)
