"""``python -m experiments.compile``: compile a config's steps for hardware this machine lacks.

For each ``--target`` it builds the target's compile-only devices, lays ``config.mesh`` over
them, compiles the training step and the decode step, and prints per device the memory
(arguments, temporaries, total against the chip's HBM), the FLOPs and bytes of XLA's cost
analysis, and the collectives of the program. A config that does not shard over the target, or
whose step does not fit, says so in one line. With ``roofline=True`` each program also gets its
predicted time and MFU bound on the target's chip and its costliest operations
(:mod:`~sparsemixer_jax.aot.roofline`), and the training step (``accumulate`` times the
micro-batches, plus ``update``) its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from sparsemixer_jax.aot import analysis, lm, roofline, targets, translation
from sparsemixer_jax.tasks import build_task, check_config, run_config
from sparsemixer_jax.training import config as config_schema
from sparsemixer_jax.training import runtime
from sparsemixer_jax.training.run_config import RunConfig

_BATCH = re.compile(r"batch \[(\d+), (\d+)\]")
_MICRO_BATCHES = re.compile(r"one of (\d+) micro-batches")


@dataclasses.dataclass(frozen=True)
class TaskCompiler:
    """How the command compiles one task: ``compile`` ``(run, devices, *, decode_step) ->
    reports`` (the task's :mod:`sparsemixer_jax.aot` module; the task-independent part is
    :mod:`sparsemixer_jax.aot.steps`) and ``batch_flops`` ``(task, rows, length) ->`` the model
    FLOPs of one training pass over ``[rows, length]`` tokens on all devices."""

    compile: Callable[..., list[analysis.ProgramReport]]
    batch_flops: Callable[[Any, int, int], float]

    def program_model_flops(self, run: RunConfig, program: str, devices: int) -> float | None:
        """Model FLOPs (:mod:`sparsemixer_jax.aot.model_flops`) one device computes in one run of
        the training program named ``program`` (its batch ``[rows, length]`` over all devices
        is in its name); None for programs that compute no model FLOPs of their own
        (``update``, decoding)."""
        batch = _BATCH.search(program)
        if batch is None or not program.startswith(("train step", "accumulate")):
            return None
        rows, length = map(int, batch.groups())
        return self.batch_flops(run.task, rows, length) / devices


#: The tasks the command compiles, by ``config.task``.
COMPILERS = {
    "translation": TaskCompiler(translation.compile_translation, translation.batch_model_flops),
    "lm": TaskCompiler(lm.compile_lm, lm.batch_model_flops),
}
SUPPORTED_TASKS = tuple(COMPILERS)


def compile_for_target(config: ml_collections.ConfigDict, spec: str, *,
                       decode_step: bool = True, with_roofline: bool = False) -> dict[str, Any]:
    """Compile ``config``'s steps for target ``spec``: ``{"target", "hbm_bytes", "programs"}``
    (each program an :func:`~sparsemixer_jax.aot.analysis.as_dict`, with ``with_roofline`` also
    its :func:`~sparsemixer_jax.aot.roofline.roofline`; then ``"step"``: the training step's
    prediction), or ``{"target", "error"}`` with a one-line reason when the target is
    unavailable or the config does not shard over it."""
    task = config_schema.task_of(config)
    if task not in COMPILERS:
        return {"target": spec, "error": f"config task {task!r}: only "
                                          f"{', '.join(SUPPORTED_TASKS)} configs can be compiled"}
    compiler = COMPILERS[task]
    try:
        target = targets.parse_target(spec)
        devices = targets.target_devices(target)
        run = run_for_target(config, target)
        reports = compiler.compile(run, devices, decode_step=decode_step)
    except (ValueError, RuntimeError) as err:
        reason = str(err).splitlines()[0]
        if "cudnn" in reason.lower() and config.model.get("attention_impl") == "cudnn":
            # cuDNN's attention lowers only where the cuDNN library is installed (a GPU host).
            reason += (" (model.attention_impl='cudnn' compiles where cuDNN is installed: "
                       "pip install nvidia-cudnn-cu13==9.12.0.46, as requirements-compile.txt)")
        return {"target": spec, "error": reason}
    data, fsdp, expert = run.mesh.sizes(len(devices))
    result = {"target": spec, "device_kind": devices[0].device_kind, "devices": len(devices),
              "mesh": f"data={data} x fsdp={fsdp} x expert={expert}",
              "hbm_bytes": target.hbm_bytes,
              "programs": [analysis.as_dict(r) for r in reports],
              "reports": reports}
    if with_roofline:
        chip = roofline.CHIPS[target.chip]
        for program, report in zip(result["programs"], reports, strict=True):
            program.update(roofline.roofline(
                report.hlo_text, chip,
                compiler.program_model_flops(run, report.name, len(devices)),
                devices=len(devices)))
        result["step"] = step_prediction(result["programs"], chip)
    return result


def run_for_target(config: ml_collections.ConfigDict, target: targets.Target) -> RunConfig:
    """The run of ``config`` as compiled for ``target``: its task with ``dispatch="auto"``
    resolved for the target's platform (the task's ``for_platform``), not for this machine's,
    which ``"auto"`` would pick at trace time. ``config`` is only read."""
    return run_config(config, build_task(config).for_platform(target.dispatch_platform))


def step_prediction(programs: list[dict[str, Any]], chip: roofline.Chip) -> dict[str, Any]:
    """The training step's predicted seconds and MFU bounds (calibrated and pure): the fused
    step, or ``accumulate`` once per micro-batch plus ``cast`` and ``update``."""
    training = [p for p in programs if p["name"].startswith(("train step", "cast", "accumulate",
                                                             "update"))]
    out: dict[str, Any] = {}
    for suffix in ("", "_pure"):
        seconds, flops = 0.0, 0.0
        for program in training:
            micro = _MICRO_BATCHES.search(program["name"])
            runs = int(micro.group(1)) if micro else 1
            seconds += runs * program[f"predicted_seconds{suffix}"]
            flops += runs * (program["model_flops"] or 0.0)
        out[f"predicted_seconds{suffix}"] = seconds
        out[f"mfu_bound{suffix}"] = flops / seconds / chip.peak_flops if seconds else None
    return out


def run(config: ml_collections.ConfigDict, target_specs: Sequence[str], *,
        decode_step: bool = True, json_path: str | None = None,
        with_roofline: bool = False) -> list[dict[str, Any]]:
    """Compile for every target, print each report and a summary line; write JSON if asked.
    Returns the results (without the report objects)."""
    try:
        checked = check_config(config)
        if config_schema.task_of(config) in COMPILERS:  # trained by the loop: a RunConfig,
            runtime.configure(checked.runtime)  # whose RNG and matmul precision shape programs
    except ValueError as err:
        results = [{"target": spec, "error": str(err).splitlines()[0]} for spec in target_specs]
        for result in results:
            print(summary_line(result))
        return results
    results = []
    for spec in target_specs:
        result = compile_for_target(config, spec, decode_step=decode_step,
                                    with_roofline=with_roofline)
        if "reports" in result:
            print(f"== {spec}: {result['devices']} x {result['device_kind']}, mesh "
                  f"{result['mesh']}")
            for report, program in zip(result.pop("reports"), result["programs"], strict=True):
                print(analysis.format_report(report, result["hbm_bytes"]))
                if with_roofline:
                    print(roofline.format_roofline(program))
            if with_roofline:
                print(format_step(result["step"]))
        print(summary_line(result), flush=True)
        results.append(result)
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"config": json.loads(config.to_json()), "results": results}, f, indent=1)
    return results


def format_step(step: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    return (f"training step: predicted {1e3 * step['predicted_seconds']:.2f} ms (MFU bound "
            f"{pct(step['mfu_bound'])}); pure roofline {1e3 * step['predicted_seconds_pure']:.2f}"
            f" ms (MFU bound {pct(step['mfu_bound_pure'])})")


def summary_line(result: dict[str, Any]) -> str:
    """One line: whether the largest program fits the chip's HBM, or why nothing compiled."""
    if "error" in result:
        return f"{result['target']}: cannot compile: {result['error']}"
    worst = max(result["programs"], key=lambda p: p["total"])
    need, have = worst["total"], result["hbm_bytes"]
    line = (f"{result['target']}: {'fits' if need <= have else 'DOES NOT FIT'}: the largest "
            f"program ({worst['name']}) needs {need / 2**30:.2f} GiB of {have / 2**30:.2f} GiB "
            "per device")
    if need <= have:
        return line
    largest = worst.get("largest_buffer")
    buffer = "" if not largest else (f"; its largest buffer is {largest[0]} "
                                     f"({largest[1] / 2**30:.2f} GiB)")
    return f"{line}, over by {(need - have) / 2**30:.2f} GiB{buffer}"


def exit_code(results: Sequence[dict[str, Any]]) -> int:
    """0 when every target compiled and fits, 1 otherwise."""
    ok = all("error" not in r and all(p["total"] <= r["hbm_bytes"] for p in r["programs"])
             for r in results)
    return 0 if ok else 1
