"""The language model's training step on the CPU, side by side with transformers' Mixtral in
PyTorch: tokens per second of each, in interleaved rounds, and their ratio.

Each arm is a worker process that builds its model once and then runs training steps when told:
ours (:func:`serve_ours`, the project's environment: ``LMTask.loss`` in the compiled training
step, as :mod:`lab.benchmarks.lm_step` times it) and the peer (``scripts/peer_mixtral_step.py``,
under a Python with torch and transformers: ``MixtralForCausalLM`` with AdamW). Both speak one
JSON object a line: ``{"ready": {...}}`` once built, then for each ``{"steps": n}`` the wall and
process CPU seconds of ``n`` steps. Only one arm runs at a time, the others wait on their input.

A round runs ``steps`` steps of every arm, in ABBA order (A B C, C B A, ...), so that a change
of the machine's load hits every arm alike; each arm's round time is the mean over its steps.
The figures: each arm's median step over rounds and its tokens/s, and each arm against the
reference (the first peer arm): the ratio of tokens/s of medians and the stats of the per-round
ratios (``paired``), whose spread is the noise floor on shared cores.

The sizes (``CPU_PEER_SIZES``) are ``configs/lm_quickstart.py``'s: hidden 128, 4 layers, 4
query / 2 key-value heads, 8 SwiGLU experts of width 128, top-2, vocabulary 1,024, 16 rows of
128 tokens a step, float32.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from lab.benchmarks.harness import load_average, stats

CPU_PEER_SIZES = {"emb": 128, "mlp": 128, "heads": 4, "kv_heads": 2, "layers": 4,
                  "vocab": 1024, "tokens": 2048, "length": 128, "experts": 8, "top_k": 2}
PEER_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts",
                           "peer_mixtral_step.py")


@dataclasses.dataclass(frozen=True)
class Arm:
    """One worker: ``name`` in the table, its command line and extra environment."""

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    peer: bool = False


def pinned(cpus: str) -> tuple[str, ...]:
    """The command prefix that runs a worker on the CPU cores ``cpus`` (``taskset`` list, e.g.
    ``"0"``; "" = any core). XLA sizes its thread pool to the cores a process may use."""
    return ("taskset", "-c", cpus) if cpus else ()


def ours_arm(name: str, sizes: dict[str, int], dispatch: str = "auto",
             xla_flags: str = "", cpus: str = "") -> Arm:
    """The project's step in this Python (``xla_flags`` appended to ``XLA_FLAGS``)."""
    argv = (*pinned(cpus), sys.executable, "-m", "lab.benchmarks.cpu_peer", json.dumps(sizes),
            dispatch)
    flags = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags}".strip()
    return Arm(name, argv, (("XLA_FLAGS", flags),) if flags else ())


def peer_arm(name: str, python: str, sizes: dict[str, int], threads: int,
             experts_implementation: str = "", cpus: str = "") -> Arm:
    """transformers' Mixtral under ``python`` (``experts_implementation`` "": its default)."""
    argv = (*pinned(cpus), python, PEER_SCRIPT, "--sizes", json.dumps(sizes), "--threads",
            str(threads))
    if experts_implementation:
        argv += ("--experts-implementation", experts_implementation)
    return Arm(name, argv, peer=True)


class Worker:
    """A running arm: ``ready`` holds what it said once built."""

    def __init__(self, arm: Arm):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(arm.env)}
        self.arm = arm
        self.proc = subprocess.Popen(arm.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.ready = self._read()["ready"]

    def run(self, steps: int) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"steps": steps}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"cpu_peer: arm {self.arm.name!r} exited with "
                               f"{self.proc.wait()} ({' '.join(self.arm.argv)})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def bench_cpu_peer(arms: list[Arm], sizes: dict[str, int], rounds: int, steps: int,
                   warmup: int) -> dict[str, Any]:
    """Every arm, ``warmup`` untimed steps each (the first compiles), then ``rounds`` rounds of
    ``steps`` steps in ABBA order (module docstring). JSON: ``sizes``, ``rounds``, ``steps``,
    ``load_average`` before and after, ``reference`` (the first peer arm, else the first), and
    per arm ``ready``, ``step_s`` and ``cpu_s`` (stats of the rounds' mean step),
    ``tokens_per_s``, the last reply's other keys (``loss``: the last step's), ``to_reference``
    (``ratio``: its tokens/s over the reference's, from the medians; ``paired``: stats of the
    same per round)."""
    load_before = load_average()
    workers: list[Worker] = []
    try:
        for arm in arms:  # started one at a time: each builds its model alone
            workers.append(Worker(arm))
        for w in workers:
            w.run(warmup)
        times: dict[str, list[float]] = {w.arm.name: [] for w in workers}
        cpu: dict[str, list[float]] = {w.arm.name: [] for w in workers}
        last: dict[str, dict[str, Any]] = {}
        for r in range(rounds):
            for w in workers if r % 2 == 0 else workers[::-1]:
                out = last[w.arm.name] = w.run(steps)
                times[w.arm.name].append(sum(out["times"]) / steps)
                cpu[w.arm.name].append(sum(out["cpu_times"]) / steps)
    finally:
        for w in workers:
            w.close()
    reference = next((a.name for a in arms if a.peer), arms[0].name)
    ref = times[reference]
    result: dict[str, Any] = {"sizes": dict(sizes), "rounds": rounds, "steps": steps,
                              "warmup": warmup, "reference": reference, "arms": {}}
    for w in workers:
        t = times[w.arm.name]
        s = stats(t)
        result["arms"][w.arm.name] = {
            "ready": w.ready, "env": dict(w.arm.env), "cpus": _cpus_of(w.arm), "step_s": s,
            "cpu_s": stats(cpu[w.arm.name]),
            "tokens_per_s": sizes["tokens"] / s["median"],
            # What else the last reply said (the training step's loss, generated tokens).
            **{k: v for k, v in last[w.arm.name].items() if k not in ("times", "cpu_times")},
            "to_reference": {"ratio": stats(ref)["median"] / s["median"],
                             "paired": stats([a / b for a, b in zip(ref, t, strict=True)])}}
    result["load_average"] = [load_before, load_average()]
    return result


def _cpus_of(arm: Arm) -> str:
    """The cores ``arm`` is pinned to ("" = any)."""
    return arm.argv[2] if arm.argv[:1] == ("taskset",) else ""


def table(result: dict[str, Any], step: str = "step") -> str:
    """The markdown table of :func:`bench_cpu_peer`'s result (``step``: what a step is)."""
    ref = result["reference"]
    lines = [f"| arm | {step} ms (median, min-max) | tokens/s | CPU s/{step} | tokens/s / {ref} "
             "(medians) | paired per round (median, min-max) |", "|---|---|---|---|---|---|"]
    for name, a in result["arms"].items():
        s, p = a["step_s"], a["to_reference"]["paired"]
        lines.append(f"| {name} | {s['median']*1e3:.0f} ({s['min']*1e3:.0f}-{s['max']*1e3:.0f})"
                     f" | {a['tokens_per_s']:,.0f} | {a['cpu_s']['median']:.3f} | "
                     f"{a['to_reference']['ratio']:.3f} | {p['median']:.3f} "
                     f"({p['min']:.3f}-{p['max']:.3f}) |")
    return "\n".join(lines)


def report(result: dict[str, Any], module: str, argv: Sequence[str], peer_python: str,
           out: str, step: str = "step", notes: Sequence[str] = ()) -> dict[str, Any]:
    """``result`` with the command (``python -m module argv``, the peer's Python named by its
    role, not by its path on this machine) and the machine first; prints its :func:`table`,
    the ``notes`` and the load, and writes it as JSON to ``out``."""
    from lab.benchmarks.harness import machine

    shown = ["PEER_PYTHON" if peer_python and a == peer_python else a for a in argv]
    result = {"command": " ".join([f"python -m {module}", *shown]), "machine": machine(),
              **result}
    print(table(result, step))
    for note in notes:
        print(note)
    print(f"load average {result['load_average']}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


def serve_ours(sizes: dict[str, int], dispatch: str) -> None:
    """The worker of our arm: the ``top2`` arm of :mod:`lab.benchmarks.lm_step` (Mixtral's
    routing) at ``sizes``, float32, on the CPU (module docstring's protocol)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    from lab.benchmarks.lm_step import LMTrainStep, lm_model_config, synthetic_lm_batch
    from sparsemixer_jax.moe.dispatch import resolve_dispatch
    from sparsemixer_jax.tasks.language_model import LMTask

    config = lm_model_config(sizes, "switch", "float32", dispatch)
    step = LMTrainStep(LMTask.from_config(config), config, synthetic_lm_batch(sizes))
    _reply({"ready": {"jax": jax.__version__, "backend": jax.default_backend(),
                      "num_params": step.num_params, "dispatch": resolve_dispatch(dispatch),
                      "xla_flags": os.environ.get("XLA_FLAGS", "")}})
    for line in sys.stdin:
        times, cpu_times, metrics = [], [], {}
        for _ in range(json.loads(line)["steps"]):
            start, cpu_start = time.perf_counter(), time.process_time()
            _, metrics = jax.block_until_ready(step())
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        _reply({"times": times, "cpu_times": cpu_times,
                "loss": float(metrics["loss"]) if metrics else float("nan")})


def _reply(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    serve_ours(json.loads(sys.argv[1]), sys.argv[2])
