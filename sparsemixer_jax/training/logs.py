"""What a run reports as it goes: ``metrics.jsonl`` and TensorBoard, and the progress line."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sparsemixer_jax.training.hosts import is_main_process, write_atomically

logger = logging.getLogger(__name__)


class MetricLog:
    """``metrics.jsonl`` and TensorBoard, written by process 0 only.

    On a resumed run the records a killed run wrote after ``resume_step`` (its last checkpoint)
    are dropped: they will be written again.
    """

    def __init__(self, workdir: str, resume_step: int):
        self.active = is_main_process()
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.writer = None
        if not self.active:
            return
        if os.path.exists(self.path):
            kept = []
            with open(self.path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by the kill
                        continue
                    if record["step"] <= resume_step:  # (a kill can also cut just the "\n")
                        kept.append(line if line.endswith("\n") else line + "\n")
            write_atomically(self.path, "".join(kept))
        try:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
        except ImportError:  # TensorBoard is optional; metrics.jsonl is always written
            logger.warning("tensorboardX not installed: no TensorBoard logs")

    def records(self) -> list[dict[str, Any]]:
        """The records written so far (process 0; the others write none and get ``[]``)."""
        if not self.active or not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in flatten(record).items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        """TensorBoard's queued events to disk (``metrics.jsonl`` is written line by line): its
        writer's ``flush`` leaves up to a queue's worth of events in memory, ``close`` does not."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def flatten(tree: dict, prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + sep, sep))
        else:
            flat[name] = value
    return flat


def to_python(tree: Any) -> Any:
    """Device arrays as nested Python lists and floats (for JSON)."""
    return jax.tree.map(lambda x: np.asarray(x).tolist(), jax.device_get(tree))


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes = f"{rest // 60:02d}:{rest % 60:02d}"
    return f"{hours}:{minutes}" if hours else minutes


class Progress:
    """The progress line of the training steps, on process 0 (a no-op elsewhere).

    Elapsed time is wall time since this process started training (it never runs backwards).
    The rate and the remaining time count only the steps of this process that compiled nothing:
    a step that compiles (the first of each batch shape, tens of seconds on a CPU) would
    otherwise make the first estimate an hour for a run of a minute; a resumed run's earlier
    steps took no time here and are not counted either.
    """

    def __init__(self, total: int, initial: int, *, clock: Callable[[], float] = time.perf_counter,
                 enabled: bool | None = None):
        self.total, self.done = total, initial
        self.clock = clock
        self.start = self.last = clock()
        self.timed_steps, self.timed_seconds = 0, 0.0
        self.postfix = ""
        self.notes: dict[str, str] = {}
        self.bar = None
        if enabled if enabled is not None else is_main_process():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            mininterval=2.0,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{postfix}")

    @property
    def rate(self) -> float | None:
        """Steps per second of the timed steps, None before the first."""
        return self.timed_steps / self.timed_seconds if self.timed_seconds > 0 else None

    def note(self, **values: str) -> None:
        """Values shown after the timings from the next step on (e.g. the latest loss)."""
        self.notes.update(values)

    def advance(self, compiled: bool) -> None:
        """One step done; ``compiled``: it compiled a new shape, so it is not timed."""
        now = self.clock()
        if not compiled:
            self.timed_steps += 1
            self.timed_seconds += now - self.last
        self.last = now
        self.done += 1
        rate = self.rate
        parts = [_duration(now - self.start)]
        if rate:
            parts.append(f"{rate:.2f} step/s" if rate >= 1 else f"{1 / rate:.2f} s/step")
            parts.append(f"{_duration((self.total - self.done) / rate)} left")
        parts += [f"{k}={v}" for k, v in self.notes.items()]
        self.postfix = ", ".join(parts)
        if self.bar is not None:
            self.bar.set_postfix_str(self.postfix, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StepMetrics:
    """Each training step's metrics, read from the device one step late.

    :meth:`add` takes the step's metrics as device arrays and reads the previous step's, so the
    host queues step ``n + 1`` before it waits for step ``n``; :meth:`flush` reads the one still
    pending (before a validation, a checkpoint, or the end). A read writes the step's record to
    ``log`` (``moe`` metrics only on steps added with ``with_moe``), shows ``progress_keys`` and
    the learning rate on ``progress``, and counts tokens and time for ``results.json``. A step
    whose loss or gradient is not finite gets an error record, then ``on_non_finite(step, loss,
    grad_norm)`` is called, which is expected to raise. ``tokens`` and ``seconds`` start from
    the totals of the run's earlier parts, so a resumed run's throughput covers the whole run.
    """

    def __init__(self, log: MetricLog, progress: Progress, learning_rate: Callable[[int], Any],
                 progress_keys: tuple[str, ...],
                 on_non_finite: Callable[[int, float, float], None], *, tokens: float = 0.0,
                 seconds: float = 0.0):
        self.log, self.progress = log, progress
        self.learning_rate = learning_rate
        self.progress_keys = progress_keys
        self.on_non_finite = on_non_finite
        self.pending: tuple | None = None
        self.tokens, self.seconds = tokens, seconds
        self.rates: list[float] = []  # tokens/s of each step: the median leaves out compilations

    def add(self, step: int, metrics: dict[str, Any], started: float, *, with_moe: bool) -> None:
        """Step ``step`` (begun at ``perf_counter()`` time ``started``) has been queued."""
        self.flush()
        self.pending = (step, metrics, started, with_moe)
        self.seconds += time.perf_counter() - started

    def flush(self) -> None:
        """Reads the pending step's metrics, if any."""
        if self.pending is None:
            return
        step, metrics, started, with_moe = self.pending
        self.pending = None
        metrics = jax.device_get(metrics)
        elapsed = time.perf_counter() - started
        if not bool(metrics["finite"]):
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            self.log.write({"step": step, "error": "non-finite loss or gradient", "loss": loss,
                            "grad_norm": grad_norm})
            self.on_non_finite(step, loss, grad_norm)
        self.tokens += float(metrics["tokens"])
        entry = {"step": step, "lr": float(self.learning_rate(step - 1)),
                 **{k: float(v) for k, v in metrics.items() if k not in ("moe", "finite")},
                 "tokens_per_s": float(metrics["tokens"]) / max(elapsed, 1e-9)}
        self.rates.append(entry["tokens_per_s"])
        if with_moe and metrics.get("moe"):
            entry["moe"] = to_python(metrics["moe"])
        self.log.write(entry)
        self.progress.note(**{k: f"{entry[k]:.3f}" for k in self.progress_keys},
                           lr=f"{entry['lr']:.2e}")

    def results(self) -> dict[str, Any]:
        """The throughput figures of ``results.json``."""
        return {
            "tokens_per_second": self.tokens / self.seconds if self.seconds > 0 else None,
            "tokens_per_second_median_step": float(np.median(self.rates)) if self.rates else None,
            "train_time_s": self.seconds,
        }
