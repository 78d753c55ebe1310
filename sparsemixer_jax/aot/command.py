"""``python -m experiments.compile``: compile a config's steps for hardware this machine lacks.

For each ``--target`` it builds the target's compile-only devices, lays ``config.mesh`` over
them, compiles the training step and the decode step, and prints per device the memory
(arguments, temporaries, total against the chip's HBM), the FLOPs and bytes of XLA's cost
analysis, and the collectives of the program. A config that does not shard over the target, or
whose step does not fit, says so in one line.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Sequence
from typing import Any

import ml_collections

from sparsemixer_jax import config as config_schema
from sparsemixer_jax import runtime, sharding
from sparsemixer_jax.aot import analysis, targets
from sparsemixer_jax.tasks import check_config

# The compile function of each task's aot module, ``(config, target, devices, decode_step=)`` ->
# reports: a task joins the command by adding its module here (the task-independent part is
# sparsemixer_jax.aot.steps).
COMPILERS = {"translation": ("sparsemixer_jax.aot.translation", "compile_translation"),
             "lm": ("sparsemixer_jax.aot.lm", "compile_lm")}
SUPPORTED_TASKS = tuple(COMPILERS)


def compile_for_target(config: ml_collections.ConfigDict, spec: str, *,
                       decode_step: bool = True) -> dict[str, Any]:
    """Compile ``config``'s steps for target ``spec``: ``{"target", "hbm_bytes", "programs"}``
    (each program an :func:`~sparsemixer_jax.aot.analysis.as_dict`), or ``{"target",
    "error"}`` with a one-line reason when the target is unavailable or the config does not
    shard over it."""
    task = config_schema.task_of(config)
    if task not in SUPPORTED_TASKS:
        return {"target": spec, "error": f"config task {task!r}: only "
                                          f"{', '.join(SUPPORTED_TASKS)} configs can be compiled"}
    try:
        target = targets.parse_target(spec)
        devices = targets.target_devices(target)
        module, function = COMPILERS[task]
        compile_task = getattr(importlib.import_module(module), function)
        reports = compile_task(config, target, devices, decode_step=decode_step)
    except (ValueError, RuntimeError) as err:
        reason = str(err).splitlines()[0]
        if "cudnn" in reason.lower() and config.model.get("attention_impl") == "cudnn":
            # cuDNN's attention lowers only where the cuDNN library is installed (a GPU host).
            reason += (" (model.attention_impl='cudnn' compiles only on a host with cuDNN; "
                       "model.attention_impl=xla checks the rest of the program)")
        return {"target": spec, "error": reason}
    data, fsdp, expert = sharding.MeshConfig.from_config(config.mesh).sizes(len(devices))
    return {"target": spec, "device_kind": devices[0].device_kind, "devices": len(devices),
            "mesh": f"data={data} x fsdp={fsdp} x expert={expert}",
            "hbm_bytes": target.hbm_bytes,
            "programs": [analysis.as_dict(r) for r in reports],
            "reports": reports}


def run(config: ml_collections.ConfigDict, target_specs: Sequence[str], *,
        decode_step: bool = True, json_path: str | None = None) -> list[dict[str, Any]]:
    """Compile for every target, print each report and a summary line; write JSON if asked.
    Returns the results (without the report objects)."""
    try:
        check_config(config)
        runtime.configure(config)  # the RNG implementation and matmul precision shape the program
    except ValueError as err:
        results = [{"target": spec, "error": str(err).splitlines()[0]} for spec in target_specs]
        for result in results:
            print(summary_line(result))
        return results
    results = []
    for spec in target_specs:
        result = compile_for_target(config, spec, decode_step=decode_step)
        if "reports" in result:
            print(f"== {spec}: {result['devices']} x {result['device_kind']}, mesh "
                  f"{result['mesh']}")
            for report in result.pop("reports"):
                print(analysis.format_report(report, result["hbm_bytes"]))
        print(summary_line(result), flush=True)
        results.append(result)
    if json_path:
        os.makedirs(os.path.dirname(json_path) or ".", exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"config": json.loads(config.to_json()), "results": results}, f, indent=1)
    return results


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
