"""Fit the roofline's calibration on measured GPU step times, and show predicted against measured.

    python -m lab.benchmarks.roofline_fit --measured docs/results/benchmark_lm_h100.json \
        docs/results/benchmark_lm_bench_h200.json docs/results/benchmark_lm_bench_h200_8row.json

For every arm of every ``lm_throughput`` run in the measured JSON files (the benchmark's
language model: top-2, the routers timed against it, the dense twin; its sizes, or the LM config
the run names, ``configs/lm_bench.py:moe``), the same program is compiled without the hardware
for one GPU of the kind that ran it (``h100:1x1`` or ``h200:1x1``, jax's compile-only GPU
target) and its roofline computed (:mod:`sparsemixer_jax.aot.roofline`); an update of several
micro-batches is ``accumulate`` once per micro-batch plus ``update``. The calibration's
constants (:class:`~sparsemixer_jax.aot.roofline.Calibration`), one set for every chip, are then
fitted to the measured medians by least squares on the log of predicted over measured, and the
table printed with each arm's error and the leave-one-out error (each arm predicted by the fit
on the others). Compiled programs' HLO is kept under ``--cache`` so that a refit compiles
nothing.
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


# The roofline's chip (and compile target) of each GPU a measurement names.
CHIP_OF_DEVICE = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200"}


def measured_arms(path: str) -> list[dict[str, Any]]:
    """One entry per timed arm: ``file``, ``run``, ``arm``, ``router``, ``sizes``, ``dtype``,
    ``dispatch``, ``attention_impl``, ``lm_config`` (None: the benchmark's own model),
    ``chip``, ``seconds`` (median step), ``model_flops`` (per step)."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    out = []
    for run_name, run in runs.items():
        section = run.get("lm_throughput")
        if not isinstance(section, dict) or "sizes" not in section:
            continue
        if section["device_kind"] not in CHIP_OF_DEVICE:
            raise ValueError(f"{path}: run {run_name!r} ran on {section['device_kind']!r}; the "
                             f"fit knows {', '.join(CHIP_OF_DEVICE)}")
        for arm, result in section.items():
            if not isinstance(result, dict) or "step_s" not in result:
                continue
            out.append({"file": os.path.basename(path), "run": run_name, "arm": arm,
                        "router": result["router"],
                        "sizes": section["sizes"], "dtype": section["dtype"],
                        "dispatch": section["dispatch"],
                        "attention_impl": section.get("attention_impl", "einsum"),
                        "lm_config": run.get("lm_config"),
                        "chip": CHIP_OF_DEVICE[section["device_kind"]],
                        "seconds": result["step_s"]["median"],
                        "model_flops": result["model_flops_per_token"]["total"]
                        * section["tokens_per_step"]})
    return out


def compiled_programs(arm: dict[str, Any], cache: str) -> list[tuple[str, int]]:
    """The optimised HLO of each program of ``arm``'s update on one GPU of its chip, with the
    times an update runs it (``accumulate``: once per micro-batch), compiled once and cached."""
    # Runs of one config at different micro-batch sizes are different programs; runs that record
    # none, or one row, keep the keys their cached programs were written under.
    rows = arm["sizes"].get("micro_rows", 1)
    key = f"{arm['chip']}.{arm['attention_impl']}.{arm['dispatch']}.{arm['arm']}" + \
        (f".rows{rows}" if rows != 1 else "") + \
        (f".{arm['lm_config'].replace('/', '_')}" if arm["lm_config"] else "")
    index = os.path.join(cache, f"{key}.json")
    if not os.path.exists(index):
        _compile_into(arm, cache, key)
    with open(index) as f:
        repeats = json.load(f)
    return [(open(os.path.join(cache, f"{key}.{i}.hlo.txt")).read(), n)
            for i, n in enumerate(repeats)]


def _compile_into(arm: dict[str, Any], cache: str, key: str) -> None:
    from lab.benchmarks.lm_step import dense_twin, lm_model_config
    from sparsemixer_jax.aot import lm, targets
    from sparsemixer_jax.tasks import run_config
    from sparsemixer_jax.tasks.language_model import LMTask
    from sparsemixer_jax.training import runtime
    from sparsemixer_jax.training.cli import load_config_file

    target = targets.parse_target(f"{arm['chip']}:1x1")
    base = load_config_file(arm["lm_config"]) if arm["lm_config"] else None
    config = lm_model_config(arm["sizes"], arm["router"] or "switch", arm["dtype"],
                             arm["dispatch"], arm["attention_impl"], base)
    runtime.configure(runtime.RuntimeConfig.from_config(config.runtime))
    task = LMTask.from_config(config).for_platform(target.dispatch_platform)
    task = dense_twin(task) if arm["router"] is None else task
    reports = lm.compile_lm(run_config(config, task), targets.target_devices(target))
    micro_batches = task.data.batch_size // task.data.micro
    repeats = [micro_batches if r.name.startswith("accumulate") else 1 for r in reports]
    os.makedirs(cache, exist_ok=True)
    for i, report in enumerate(reports):
        with open(os.path.join(cache, f"{key}.{i}.hlo.txt"), "w") as f:
            f.write(report.hlo_text)
    with open(os.path.join(cache, f"{key}.json"), "w") as f:
        json.dump(repeats, f)


def op_table(programs: list[tuple[str, int]], chip: Any) -> dict[str, Any]:
    """The update's operations as arrays (``flops``, ``bytes``, ``link``, ``count``: runs per
    update, ``collective``) for fast refits, and the ``chip`` they run on."""
    from sparsemixer_jax.aot import hlo, roofline

    ops = [(o, n) for text, n in programs
           for o in roofline.program_ops(hlo.parse_module(text))]
    return {"flops": np.array([o.flops for o, _ in ops]),
            "bytes": np.array([o.bytes for o, _ in ops]),
            "link": np.array([o.link_bytes for o, _ in ops]),
            "count": np.array([o.count * n for o, n in ops]),
            "collective": np.array([o.kind == "collective" for o, _ in ops]), "chip": chip}


def predict(table: dict[str, Any], params: Sequence[float]) -> float:
    """:class:`~sparsemixer_jax.aot.roofline.Op.seconds` summed on the table's chip, vectorised
    (params: the :data:`CALIBRATED` fields; collectives as the calibration's default link
    fraction)."""
    kernel, peak_fraction, half, memory = params
    chip = table["chip"]
    flops = table["flops"]
    fraction = peak_fraction * flops / np.maximum(flops + half, 1e-30)
    compute = np.where(flops > 0, flops / (chip.peak_flops * np.maximum(fraction, 1e-12)), 0.0)
    seconds = np.maximum(compute, table["bytes"] / (chip.hbm_bandwidth * memory)) + kernel
    seconds = np.where(table["collective"], table["link"] / (0.8 * chip.link_bandwidth) + kernel,
                       seconds)
    return float(np.sum(table["count"] * seconds))


def fit(tables: list[dict[str, Any]], measured: np.ndarray) -> np.ndarray:
    """Least squares of log(predicted / measured) over the :data:`CALIBRATED` constants,
    bounded to physical ranges: 0-50 us per kernel, 5-100% of the matmul peak, a half-peak size
    of 0-100 GFLOP, 30-100% of the HBM bandwidth."""
    from scipy.optimize import least_squares

    def residuals(p):
        return [math.log(predict(t, p) / m) for t, m in zip(tables, measured, strict=True)]

    result = least_squares(residuals, x0=[5e-6, 0.7, 1e9, 0.8],
                           bounds=([0, 0.05, 0, 0.3], [50e-6, 1.0, 1e11, 1.0]),
                           x_scale=[1e-5, 0.1, 1e9, 0.1])
    return result.x


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", nargs="+",
                        default=["docs/results/benchmark_lm_h100.json",
                                 "docs/results/benchmark_lm_bench_h200.json",
                                 "docs/results/benchmark_lm_bench_h200_8row.json"])
    parser.add_argument("--cache", default="runs/roofline_fit")
    parser.add_argument("--json", default=None, help="write the table and the fit here")
    args = parser.parse_args(argv)
    from sparsemixer_jax.aot.roofline import CHIPS

    arms = [arm for path in args.measured for arm in measured_arms(path)]
    tables = []
    for arm in arms:
        tables.append(op_table(compiled_programs(arm, args.cache), CHIPS[arm["chip"]]))
        print(f"compiled {arm['file']} {arm['run']} {arm['arm']}", flush=True)
    measured = np.array([arm["seconds"] for arm in arms])
    params = fit(tables, measured)
    rows = []
    for i, (arm, table) in enumerate(zip(arms, tables, strict=True)):
        others = [j for j in range(len(arms)) if j != i]
        held_out = fit([tables[j] for j in others], measured[others])
        rows.append({"chip": arm["chip"], "lm_config": arm["lm_config"],
                     "attention_impl": arm["attention_impl"],
                     "dispatch": arm["dispatch"], "arm": arm["arm"],
                     "measured_s": arm["seconds"],
                     "pure_s": predict(table, (0.0, 1.0, 0.0, 1.0)),
                     "calibrated_s": predict(table, params),
                     "held_out_s": predict(table, held_out),
                     "model_flops": arm["model_flops"], "peak_flops": table["chip"].peak_flops})
    errors = np.array([r["calibrated_s"] / r["measured_s"] - 1 for r in rows])
    held = np.array([r["held_out_s"] / r["measured_s"] - 1 for r in rows])
    import platform
    import sys

    import jax

    out = {"command": "python -m lab.benchmarks.roofline_fit " + " ".join(sys.argv[1:]),
           "compiled_on": f"{platform.processor() or platform.machine()}, {os.cpu_count()} "
                          f"CPUs, jax {jax.__version__}, targets <chip>:1x1 (no GPU)",
           "measured": args.measured,
           "fit": dict(zip(CALIBRATED, map(float, params), strict=True)),
           "rms_error": float(np.sqrt(np.mean(errors**2))),
           "max_error": float(np.max(np.abs(errors))),
           "held_out_rms_error": float(np.sqrt(np.mean(held**2))), "rows": rows}
    print(format_table(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def format_table(out: dict[str, Any]) -> str:
    """A markdown table: measured, pure and calibrated step times and MFU per arm."""
    lines = ["| chip | model | attention | dispatch | arm | measured ms (MFU) | pure roofline ms "
             "(MFU bound) | calibrated ms (MFU bound) | error | held out |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    for r in out["rows"]:
        def cell(seconds: float, r=r) -> str:
            mfu = r["model_flops"] / seconds / r["peak_flops"]
            return f"{1e3 * seconds:,.1f} ({100 * mfu:.1f}%)"

        model = r["lm_config"] or "benchmark default"
        lines.append(f"| {r['chip']} | {model} | {r['attention_impl']} | {r['dispatch']} | "
                     f"{r['arm']} | {cell(r['measured_s'])} | "
                     f"{cell(r['pure_s'])} | {cell(r['calibrated_s'])} | "
                     f"{100 * (r['calibrated_s'] / r['measured_s'] - 1):+.1f}% | "
                     f"{100 * (r['held_out_s'] / r['measured_s'] - 1):+.1f}% |")
    fit_text = ", ".join(f"{k} = {v:.3g}" for k, v in out["fit"].items())
    lines.append(f"\nfit: {fit_text}; RMS error {100 * out['rms_error']:.1f}% (max "
                 f"{100 * out['max_error']:.1f}%), leave-one-out RMS "
                 f"{100 * out['held_out_rms_error']:.1f}%")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
