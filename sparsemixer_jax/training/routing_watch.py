"""Routing diagnostics at each evaluation: what training did to the routers.

A task that can report its routing (``routing_choices``, :class:`sparsemixer_jax.training.Task`)
gets, at each evaluation and for each MoE layer, on the validation tokens:

* ``churn``: the share of tokens whose chosen set of experts differs from the starting
  model's (the checkpoint a fine-tuning run starts from; a run from scratch, its
  initialisation), each model routing its own activations of the same tokens;
* ``max_share``: the largest share of tokens that choose one expert (``k / N`` at a uniform
  load, 1 when every token chooses it);
* ``load_entropy``: the entropy of the experts' shares divided by ``log N`` (1 uniform, 0 when
  one expert takes every token).

A layer whose ``max_share`` is at least :attr:`CollapseRule.share` at :attr:`CollapseRule.
evaluations` evaluations in a row is named on one warning line (router collapse), by process 0.
A resumed run counts on from the evaluations its ``metrics.jsonl`` holds
(:meth:`RoutingWatch.continue_from`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from sparsemixer_jax.moe.diagnostics import load_entropy, routing_sums
from sparsemixer_jax.section import cast, check_positive
from sparsemixer_jax.training.hosts import is_main_process

if TYPE_CHECKING:
    from sparsemixer_jax.training.state import TrainState
    from sparsemixer_jax.training.steps import Steps

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CollapseRule:
    """When a layer's routing counts as collapsed: its busiest expert takes at least ``share``
    of the tokens at ``evaluations`` evaluations in a row (config fields ``collapse_share`` and
    ``collapse_evals``)."""

    share: float = 0.9
    evaluations: int = 3

    @classmethod
    def from_config(cls, config: Any, where: str = "config.") -> CollapseRule:
        """The config's ``collapse_share`` and ``collapse_evals`` (absent: the defaults)."""
        rule = cls(cast(float, config.get("collapse_share", cls.share), f"{where}collapse_share"),
                   cast(int, config.get("collapse_evals", cls.evaluations),
                        f"{where}collapse_evals"))
        check_positive(where, collapse_evals=rule.evaluations)
        if not 0.0 < rule.share <= 1.0:
            raise ValueError(f"{where}collapse_share must lie in (0, 1], got {rule.share}")
        return rule


_sums = jax.jit(routing_sums, static_argnums=(3,))


class RoutingWatch:
    """The starting model's routing of the validation batches, and the diagnostics of the
    module docstring against it at each :meth:`evaluate`.

    ``steps``: the run's :class:`~sparsemixer_jax.training.steps.Steps`; ``state``: the
    starting train state (read before the first update donates it); ``batches``: the
    validation batches, placed by ``place``; ``rule``: when to warn.
    """

    def __init__(self, steps: Steps, state: TrainState, batches: list[dict[str, Any]],
                 place: Callable[[dict[str, Any]], dict[str, jax.Array]], rule: CollapseRule):
        self.batches, self.place, self.rule = batches, place, rule
        self.num_experts = steps.num_routed_experts(state)
        self.start = [steps.routing(state, place(batch))[0] for batch in batches]
        self.collapsed_evals: dict[str, int] = {}  # evaluations in a row at or above the share

    def evaluate(self, step: int, steps: Steps, state: TrainState
                 ) -> dict[str, dict[str, float]]:
        """``{layer: {"churn", "max_share", "load_entropy"}}`` of ``state`` against the start;
        warns (one line per layer) when a layer reaches the collapse rule."""
        totals: dict[str, dict[str, np.ndarray]] = {}
        for start, batch in zip(self.start, self.batches, strict=True):
            now, mask = steps.routing(state, self.place(batch))
            for layer, choices in now.items():
                sums = jax.device_get(_sums(start[layer], choices, mask, self.num_experts))
                total = totals.setdefault(layer, {})
                for name, value in sums.items():
                    total[name] = total.get(name, 0.0) + np.asarray(value, np.float64)
        out = {}
        for layer, total in totals.items():
            tokens = max(float(total["tokens"]), 1.0)
            shares = total["counts"] / tokens
            out[layer] = {"churn": float(total["changed"]) / tokens,
                          "max_share": float(np.max(shares)),
                          "load_entropy": float(load_entropy(shares))}
            self._check_collapse(step, layer, out[layer]["max_share"])
        return out

    def continue_from(self, records: list[dict]) -> None:
        """Counts the evaluations of the run's earlier records (``metrics.jsonl``, up to the
        step resumed from), so that a streak goes on across a resumption; warns of none."""
        for record in records:
            for layer, values in (record.get("routing") or {}).items():
                self._count(layer, values["max_share"])

    def _count(self, layer: str, max_share: float) -> int:
        count = self.collapsed_evals.get(layer, 0) + 1 if max_share >= self.rule.share else 0
        self.collapsed_evals[layer] = count
        return count

    def _check_collapse(self, step: int, layer: str, max_share: float) -> None:
        count = self._count(layer, max_share)
        if count == self.rule.evaluations and is_main_process():
            logger.warning(
                "router collapse at step %d: %s sends %.1f%% of the validation tokens to one "
                "expert, at least config.collapse_share=%.2f at %d evaluations in a row",
                step, layer, 100 * max_share, self.rule.share, count)
