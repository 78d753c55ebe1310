"""Fit the roofline's calibration on measured H100 step times, and show predicted against measured.

    python -m lab.benchmarks.roofline_fit --measured docs/results/benchmark_lm_h100.json

For every arm of every ``lm_throughput`` run in the measured JSON (the benchmark's language
model: top-2, the routers timed against it, the dense twin; padded and grouped dispatch), the
same program is compiled without the hardware for one H100 (``h100:1x1``, jax's compile-only
GPU target) and its roofline computed (:mod:`sparsemixer_jax.aot.roofline`). The calibration's
constants (:class:`~sparsemixer_jax.aot.roofline.Calibration`) are then fitted to the measured
medians by least squares on the log of predicted over measured, and the table printed with each
arm's error and the leave-one-out error (each arm predicted by the fit on the others).
Compiled programs' HLO is kept under ``--cache`` so that a refit compiles nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

CALIBRATED = ("kernel_seconds", "gemm_peak_fraction", "gemm_half_flops", "memory_fraction")


def measured_arms(path: str) -> list[dict[str, Any]]:
    """One entry per timed arm: ``run``, ``arm``, ``router``, ``sizes``, ``dtype``,
    ``dispatch``, ``attention_impl``, ``seconds`` (median step), ``model_flops`` (per step)."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    out = []
    for run_name, run in runs.items():
        section = run.get("lm_throughput")
        if not isinstance(section, dict) or "sizes" not in section:
            continue
        for arm, result in section.items():
            if not isinstance(result, dict) or "step_s" not in result:
                continue
            out.append({"run": run_name, "arm": arm, "router": result["router"],
                        "sizes": section["sizes"], "dtype": section["dtype"],
                        "dispatch": section["dispatch"],
                        "attention_impl": section.get("attention_impl", "einsum"),
                        "seconds": result["step_s"]["median"],
                        "model_flops": result["model_flops_per_token"]["total"]
                        * section["tokens_per_step"]})
    return out


def compiled_hlo(arm: dict[str, Any], cache: str) -> str:
    """The optimised HLO of ``arm``'s training step for one H100, compiled once and cached."""
    path = os.path.join(cache, f"{arm['dispatch']}.{arm['arm']}.hlo.txt")
    if os.path.exists(path):
        return open(path).read()
    from lab.benchmarks.lm_step import dense_twin, lm_model_config
    from sparsemixer_jax import runtime
    from sparsemixer_jax.aot import lm, targets
    from sparsemixer_jax.tasks.language_model import LMTask

    target = targets.parse_target("h100:1x1")
    config = lm_model_config(arm["sizes"], arm["router"] or "switch", arm["dtype"],
                             arm["dispatch"], arm["attention_impl"])
    runtime.configure(config)
    config = lm.config_for_target(config, target)
    task = LMTask.from_config(config)
    task = dense_twin(task) if arm["router"] is None else task
    (report,) = lm.compile_lm_task(task, config, targets.target_devices(target))
    os.makedirs(cache, exist_ok=True)
    with open(path, "w") as f:
        f.write(report.hlo_text)
    return report.hlo_text


def op_table(hlo_text: str) -> dict[str, np.ndarray]:
    """The program's operations as arrays (``flops``, ``bytes``, ``link``, ``count``,
    ``collective``) for fast refits."""
    from sparsemixer_jax.aot import hlo, roofline

    ops = roofline.program_ops(hlo.parse_module(hlo_text))
    return {"flops": np.array([o.flops for o in ops]),
            "bytes": np.array([o.bytes for o in ops]),
            "link": np.array([o.link_bytes for o in ops]),
            "count": np.array([o.count for o in ops]),
            "collective": np.array([o.kind == "collective" for o in ops])}


def predict(table: dict[str, np.ndarray], chip: Any, params: Sequence[float]) -> float:
    """:class:`~sparsemixer_jax.aot.roofline.Op.seconds` summed, vectorised (params: the
    :data:`CALIBRATED` fields; collectives as the calibration's default link fraction)."""
    kernel, peak_fraction, half, memory = params
    flops = table["flops"]
    fraction = peak_fraction * flops / np.maximum(flops + half, 1e-30)
    compute = np.where(flops > 0, flops / (chip.peak_flops * np.maximum(fraction, 1e-12)), 0.0)
    seconds = np.maximum(compute, table["bytes"] / (chip.hbm_bandwidth * memory)) + kernel
    seconds = np.where(table["collective"], table["link"] / (0.8 * chip.link_bandwidth) + kernel,
                       seconds)
    return float(np.sum(table["count"] * seconds))


def fit(tables: list[dict[str, np.ndarray]], measured: np.ndarray, chip: Any) -> np.ndarray:
    """Least squares of log(predicted / measured) over the :data:`CALIBRATED` constants,
    bounded to physical ranges: 0-50 us per kernel, 5-100% of the matmul peak, a half-peak size
    of 0-100 GFLOP, 30-100% of the HBM bandwidth."""
    from scipy.optimize import least_squares

    def residuals(p):
        return [math.log(predict(t, chip, p) / m) for t, m in zip(tables, measured, strict=True)]

    result = least_squares(residuals, x0=[5e-6, 0.7, 1e9, 0.8],
                           bounds=([0, 0.05, 0, 0.3], [50e-6, 1.0, 1e11, 1.0]),
                           x_scale=[1e-5, 0.1, 1e9, 0.1])
    return result.x


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", default="docs/results/benchmark_lm_h100.json")
    parser.add_argument("--cache", default="runs/roofline_fit")
    parser.add_argument("--json", default=None, help="write the table and the fit here")
    args = parser.parse_args(argv)
    from sparsemixer_jax.aot.roofline import CHIPS

    chip = CHIPS["h100"]
    arms = measured_arms(args.measured)
    tables = [op_table(compiled_hlo(arm, args.cache)) for arm in arms]
    measured = np.array([arm["seconds"] for arm in arms])
    params = fit(tables, measured, chip)
    rows = []
    for i, (arm, table) in enumerate(zip(arms, tables, strict=True)):
        others = [j for j in range(len(arms)) if j != i]
        held_out = fit([tables[j] for j in others], measured[others], chip)
        rows.append({"dispatch": arm["dispatch"], "arm": arm["arm"],
                     "measured_s": arm["seconds"],
                     "pure_s": predict(table, chip, (0.0, 1.0, 0.0, 1.0)),
                     "calibrated_s": predict(table, chip, params),
                     "held_out_s": predict(table, chip, held_out),
                     "model_flops": arm["model_flops"]})
    errors = np.array([r["calibrated_s"] / r["measured_s"] - 1 for r in rows])
    held = np.array([r["held_out_s"] / r["measured_s"] - 1 for r in rows])
    import platform
    import sys

    import jax

    out = {"command": "python -m lab.benchmarks.roofline_fit " + " ".join(sys.argv[1:]),
           "compiled_on": f"{platform.processor() or platform.machine()}, {os.cpu_count()} "
                          f"CPUs, jax {jax.__version__}, target h100:1x1 (no GPU)",
           "measured": args.measured,
           "chip": chip.name, "fit": dict(zip(CALIBRATED, map(float, params), strict=True)),
           "rms_error": float(np.sqrt(np.mean(errors**2))),
           "max_error": float(np.max(np.abs(errors))),
           "held_out_rms_error": float(np.sqrt(np.mean(held**2))), "rows": rows}
    print(format_table(out, chip.peak_flops))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def format_table(out: dict[str, Any], peak: float) -> str:
    """A markdown table: measured, pure and calibrated step times and MFU per arm."""
    lines = ["| dispatch | arm | measured ms (MFU) | pure roofline ms (MFU bound) | calibrated ms "
             "(MFU bound) | error | held out |", "|---|---|---|---|---|---|---|"]
    def cell(seconds: float, flops: float) -> str:
        return f"{1e3 * seconds:.1f} ({100 * flops / seconds / peak:.1f}%)"

    for r in out["rows"]:
        flops = r["model_flops"]
        lines.append(f"| {r['dispatch']} | {r['arm']} | {cell(r['measured_s'], flops)} | "
                     f"{cell(r['pure_s'], flops)} | {cell(r['calibrated_s'], flops)} | "
                     f"{100 * (r['calibrated_s'] / r['measured_s'] - 1):+.1f}% | "
                     f"{100 * (r['held_out_s'] / r['measured_s'] - 1):+.1f}% |")
    fit_text = ", ".join(f"{k} = {v:.3g}" for k, v in out["fit"].items())
    lines.append(f"\nfit: {fit_text}; RMS error {100 * out['rms_error']:.1f}% (max "
                 f"{100 * out['max_error']:.1f}%), leave-one-out RMS "
                 f"{100 * out['held_out_rms_error']:.1f}%")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
