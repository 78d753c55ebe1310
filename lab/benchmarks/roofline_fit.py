"""Fit the roofline's per-kind calibration on the measured GPU updates, and test it out of sample.

    python -m lab.benchmarks.roofline_fit --json docs/results/roofline_fit_kinds.json

Reads the compiled programs of every timed arm (``--programs``, written by
:mod:`lab.benchmarks.roofline_programs`: each distinct program once, with the arms that ran
it), the measured update times and the profiles' device time per kind of kernel
(``--measured``: the ``lm_throughput`` and ``lm_profile`` runs), and fits the constants of
:class:`~sparsemixer_jax.aot.roofline.Calibration` (:data:`PARAMETERS`, and one fraction of
peak per cuDNN attention variant the programs hold) by least squares on the logs of predicted
over measured:

* every distinct program's update time (the mean of the arms that ran it: v2 and v2* are one
  program, counted once), and
* for a profiled program, each kind's device time: the grouped (Mosaic) kernels, cuDNN's
  forward and backward attention, the GEMMs (the profile's ``matmul`` category), and the rest
  (the update's time less those four) against the memory-bound kernels.

Prints and writes the fit on every run, each program's error and leave-one-out error (fitted
without it and its profile), and the out-of-sample test: fitted without the runs of
``--held-out`` (the eight-row H200 runs), each of their programs predicted. Reads committed
files only, so the fit is reproduced without compiling.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from lab.benchmarks.roofline_programs import MEASURED, measured_arms

# The calibration's scalar constants the fit sets, in its parameter vector's order (the
# attention variants follow), with their bounds: 0-50 us per kernel, 5-100% of the matmul
# peak, a half-peak GEMM of 0-1 TFLOP, 30-100% of the HBM bandwidth; attention 2-100%.
PARAMETERS = ("kernel_seconds", "gemm_peak_fraction", "gemm_half_flops", "pallas_fraction",
              "memory_fraction")
_LOWER = (0.0, 0.05, 0.0, 0.05, 0.3)
_UPPER = (50e-6, 1.0, 1e12, 1.0, 1.0)
_START = (5e-6, 0.8, 1e9, 0.5, 0.8)
_SCALE = (1e-5, 0.1, 1e9, 0.1, 0.1)
HELD_OUT = ("benchmark_lm_bench_h200_8row.json",)
# A profile's kinds of kernel: by the profile's own name for them, the roofline's class.
_PROFILE_KINDS = (("pallas", "Mosaic kernels (body_mosaic_gpu_kernel)"),
                  ("attention forward", "cuDNN fprop kernels"),
                  ("attention backward", "cuDNN bprop kernels"),
                  ("gemm", "category matmul"),
                  ("rest", "the update's time less the four above"))


def profiled_kinds(profile: dict[str, Any]) -> dict[str, float]:
    """Device seconds per update of the pallas, attention and GEMM kernels of an
    ``lm_profile`` section (its top operations and categories)."""
    def named(*parts: str) -> float:
        return sum(op["s_per_step"] for op in profile["top_ops"]
                   if any(p in op["op"] for p in parts))

    return {"pallas": named("mosaic_gpu"), "attention forward": named("fprop"),
            "attention backward": named("bprop"),
            "gemm": profile["categories"].get("matmul", {}).get("s_per_step", 0.0)}


class Table:
    """One program's operations as arrays, on its chip: ``kind`` (0 gemm, 1 pallas,
    2 attention, 3 memory, 4 collective), ``variant`` (the attention's index), ``flops``,
    ``bytes``, ``count`` (runs per update)."""

    KINDS = ("gemm", "pallas", "attention", "memory", "collective")

    def __init__(self, rows: list[list[Any]], chip: Any, variants: list[str]) -> None:
        self.chip = chip
        self.cls = [r[0] for r in rows]
        self.kind = np.array([self.KINDS.index(_kind(c)) for c in self.cls])
        self.variant = np.array([variants.index(c.removeprefix("attention "))
                                 if c.startswith("attention ") else 0 for c in self.cls])
        self.flops = np.array([float(r[1]) for r in rows])
        self.bytes = np.array([float(r[2]) for r in rows])
        self.count = np.array([float(r[3]) for r in rows])

    def seconds(self, params: Sequence[float], single: bool = False) -> np.ndarray:
        """Each row's time per update under ``params`` (:func:`calibration`'s order);
        ``single``: every kernel with FLOPs at the GEMMs' fraction (the one-efficiency model
        this calibration replaced)."""
        kernel, peak, half, pallas, memory, *attention = params
        flops = self.flops
        fraction = np.select(
            [self.kind == 0 if not single else self.kind < 3, self.kind == 1, self.kind == 2],
            [peak * flops / np.maximum(flops + half, 1e-30), np.full_like(flops, pallas),
             np.array([*attention, 1.0])[self.variant]], 1.0)
        compute = np.where(flops > 0,
                           flops / (self.chip.peak_flops * np.maximum(fraction, 1e-12)), 0.0)
        seconds = np.maximum(compute, self.bytes / (self.chip.hbm_bandwidth * memory)) + kernel
        link = self.bytes / (0.8 * self.chip.link_bandwidth) + kernel
        return self.count * np.where(self.kind == 4, link, seconds)

    def by_kind(self, params: Sequence[float], single: bool = False) -> dict[str, float]:
        """Seconds per update of the profile's kinds: pallas, attention forward / backward,
        gemm, and the rest (memory-bound kernels and collectives)."""
        seconds = self.seconds(params, single)
        out = {"pallas": 0.0, "attention forward": 0.0, "attention backward": 0.0,
               "gemm": 0.0, "rest": 0.0}
        for cls, s in zip(self.cls, seconds, strict=True):
            kind = _kind(cls)
            key = " ".join(cls.split(" ")[:2]) if kind == "attention" else \
                kind if kind in out else "rest"
            out[key] += float(s)
        return out


def _kind(cost_class: str) -> str:
    return "attention" if cost_class.startswith("attention") else cost_class


def calibration(params: Sequence[float], variants: list[str]) -> dict[str, Any]:
    """The fitted constants by name (the attention fractions by variant)."""
    out = dict(zip(PARAMETERS, map(float, params[:len(PARAMETERS)]), strict=True))
    out["attention"] = dict(zip(variants, map(float, params[len(PARAMETERS):]), strict=True))
    return out


class Data:
    """The measured programs: ``tables``, ``measured`` (seconds per update), ``files`` (the
    result files of their arms), ``labels``, and the profiles ``(program index, kind,
    seconds)``."""

    def __init__(self, programs_path: str, measured_paths: Sequence[str]) -> None:
        from sparsemixer_jax.aot.roofline import CHIPS

        with open(programs_path) as f:
            self.programs = json.load(f)["programs"]
        arms = {(a["file"], a["run"], a["arm"]): a
                for path in measured_paths for a in measured_arms(path)}
        self.variants = sorted({c.removeprefix("attention ") for p in self.programs
                                for c, *_ in p["ops"] if c.startswith("attention ")})
        self.tables, self.measured, self.files, self.labels = [], [], [], []
        for program in self.programs:
            timed = [arms[(a["file"], a["run"], a["arm"])] for a in program["arms"]
                     if (a["file"], a["run"], a["arm"]) in arms]
            if not timed:
                raise ValueError(f"{programs_path}: program {program['id']} names arms of "
                                 "none of the measured files")
            self.tables.append(Table(program["ops"], CHIPS[program["chip"]], self.variants))
            self.measured.append(float(np.mean([a["seconds"] for a in timed])))
            self.files.append({a["file"] for a in timed})
            self.labels.append("=".join(sorted({a["arm"] for a in timed})))
        self.measured = np.array(self.measured)
        self.profiles = []
        for path in measured_paths:
            self.profiles += self._profiles(path)

    def _profiles(self, path: str) -> list[tuple[int, str, float]]:
        """The profile of a measured file, matched to the program of its top-2 arm."""
        with open(path) as f:
            data = json.load(f)
        name = os.path.basename(path)
        out = []
        for run in data["runs"].values():
            profile = run.get("lm_profile")
            if not isinstance(profile, dict):
                continue
            rows = profile["sizes"].get("micro_rows", 1)
            matches = [i for i, p in enumerate(self.programs)
                       if name in self.files[i] and self.labels[i] == "top2"
                       and p["micro_rows"] == rows and p["attention_impl"] ==
                       profile["attention_impl"] and p["dispatch"] == profile["dispatch"]]
            if len(matches) != 1:
                raise ValueError(f"{path}: the profile matches {len(matches)} top-2 programs")
            (i,) = matches
            kinds = profiled_kinds(profile)
            kinds["rest"] = self.measured[i] - sum(kinds.values())
            out += [(i, kind, seconds) for kind, seconds in kinds.items() if seconds > 0]
        return out

    def residuals(self, params: Sequence[float], keep: Sequence[int],
                  single: bool = False) -> list[float]:
        """log(predicted / measured) of the programs ``keep`` and of their profiles."""
        out = [math.log(self.predict(i, params, single) / self.measured[i]) for i in keep]
        for i, kind, seconds in self.profiles:
            if i in keep:
                out.append(math.log(self.tables[i].by_kind(params, single)[kind] / seconds))
        return out

    def fit(self, keep: Sequence[int], single: bool = False) -> np.ndarray:
        """The parameters fitted on the programs ``keep`` (``single``: the one-efficiency
        model, whose Pallas and attention fractions are unused and returned as 1)."""
        from scipy.optimize import least_squares

        n = len(self.variants)
        fitted = [0, 1, 2, 4] if single else list(range(len(PARAMETERS) + n))

        def full(p: Sequence[float]) -> list[float]:
            out = [1.0] * (len(PARAMETERS) + n)
            for index, value in zip(fitted, p, strict=True):
                out[index] = value
            return out

        def pick(values: list[float]) -> list[float]:
            return [values[i] for i in fitted]

        result = least_squares(lambda p: self.residuals(full(p), keep, single),
                               x0=pick(list(_START) + [0.3] * n),
                               bounds=(pick(list(_LOWER) + [0.02] * n),
                                       pick(list(_UPPER) + [1.0] * n)),
                               x_scale=pick(list(_SCALE) + [0.1] * n))
        return np.array(full(result.x))

    def predict(self, i: int, params: Sequence[float], single: bool = False) -> float:
        return float(np.sum(self.tables[i].seconds(params, single)))


def fit_all(data: Data, held_out: Sequence[str]) -> dict[str, Any]:
    """The fit on every program, each program's leave-one-out prediction, and the fit
    without the programs of the ``held_out`` files, predicting them."""
    everything = list(range(len(data.tables)))
    params = data.fit(everything)
    pure = [0.0, 1.0, 0.0, 1.0, 1.0] + [1.0] * len(data.variants)
    rows = []
    for i, program in enumerate(data.programs):
        others = [j for j in everything if j != i]
        rows.append({"program": program["id"], "chip": program["chip"],
                     "commit": program["commit"], "attention_impl": program["attention_impl"],
                     "dispatch": program["dispatch"], "micro_rows": program["micro_rows"],
                     "arms": program["arms"], "arm": data.labels[i],
                     "measured_s": float(data.measured[i]),
                     "pure_s": data.predict(i, pure),
                     "calibrated_s": data.predict(i, params),
                     "held_out_s": data.predict(i, data.fit(others)),
                     "terms": data.tables[i].by_kind(params)})
    profiles = [{"program": data.programs[i]["id"], "kind": kind, "measured_s": seconds,
                 "calibrated_s": data.tables[i].by_kind(params)[kind]}
                for i, kind, seconds in data.profiles]
    train = [i for i in everything if not data.files[i] & set(held_out)]
    test = [i for i in everything if i not in train]
    outside = data.fit(train) if test else params
    errors = np.array([r["calibrated_s"] / r["measured_s"] - 1 for r in rows])
    held = np.array([r["held_out_s"] / r["measured_s"] - 1 for r in rows])
    out_of_sample = [{"arm": data.labels[i], "program": data.programs[i]["id"],
                      "predicted_s": data.predict(i, outside),
                      "measured_s": float(data.measured[i])} for i in test]
    oos = np.array([r["predicted_s"] / r["measured_s"] - 1 for r in out_of_sample])
    single = data.fit(train, single=True)
    single_oos = [{"arm": data.labels[i], "predicted_s": data.predict(i, single, True),
                   "measured_s": float(data.measured[i])} for i in test]
    return {"fit": calibration(params, data.variants), "rows": rows, "profiles": profiles,
            "rms_error": float(np.sqrt(np.mean(errors**2))),
            "max_error": float(np.max(np.abs(errors))),
            "held_out_rms_error": float(np.sqrt(np.mean(held**2))),
            "out_of_sample_files": list(held_out),
            "out_of_sample_fit": calibration(outside, data.variants),
            "out_of_sample": out_of_sample,
            "out_of_sample_rms_error": float(np.sqrt(np.mean(oos**2))) if test else None,
            "out_of_sample_max_error": float(np.max(np.abs(oos))) if test else None,
            # The same test of the model this calibration replaced: one fraction of peak (the
            # GEMMs', by size) for every kernel with matmul FLOPs, fitted on the same data.
            "single_efficiency_fit": {k: v for k, v in calibration(single, data.variants).items()
                                      if k in ("kernel_seconds", "gemm_peak_fraction",
                                               "gemm_half_flops", "memory_fraction")},
            "single_efficiency_out_of_sample": single_oos}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--programs", default="docs/results/roofline_programs_gpu.json")
    parser.add_argument("--measured", nargs="+", default=list(MEASURED))
    parser.add_argument("--held-out", nargs="*", default=list(HELD_OUT),
                        help="result files (base names) the out-of-sample fit leaves out")
    parser.add_argument("--json", default=None, help="write the fit and the tables here")
    args = parser.parse_args(argv)
    data = Data(args.programs, args.measured)
    out = {"command": "python -m lab.benchmarks.roofline_fit " + " ".join(
               argv if argv is not None else sys.argv[1:]),
           "programs": args.programs, "measured": args.measured}
    out.update(fit_all(data, args.held_out))
    print(format_tables(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return out


def format_tables(out: dict[str, Any]) -> str:
    """Markdown: each program's measured and predicted update, the profiles' kinds, the
    out-of-sample predictions, and the fit."""
    lines = ["| chip | commit | attention | dispatch | rows | arm | measured ms | pure ms | "
             "calibrated ms | error | held out |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        lines.append(f"| {r['chip']} | {r['commit']} | {r['attention_impl']} | {r['dispatch']} "
                     f"| {r['micro_rows']} | {r['arm']} | {1e3 * r['measured_s']:,.1f} | "
                     f"{1e3 * r['pure_s']:,.1f} | {1e3 * r['calibrated_s']:,.1f} | "
                     f"{100 * (r['calibrated_s'] / r['measured_s'] - 1):+.1f}% | "
                     f"{100 * (r['held_out_s'] / r['measured_s'] - 1):+.1f}% |")
    lines += ["", "| program | kind | profiled ms | calibrated ms |", "|---|---|---|---|"]
    lines += [f"| {p['program']} | {p['kind']} | {1e3 * p['measured_s']:,.1f} | "
              f"{1e3 * p['calibrated_s']:,.1f} |" for p in out["profiles"]]
    lines += ["", f"out of sample (fitted without {', '.join(out['out_of_sample_files'])}):",
              "| arm | predicted ms | measured ms | error |", "|---|---|---|---|"]
    lines += [f"| {r['arm']} | {1e3 * r['predicted_s']:,.1f} | {1e3 * r['measured_s']:,.1f} | "
              f"{100 * (r['predicted_s'] / r['measured_s'] - 1):+.1f}% |"
              for r in out["out_of_sample"]]
    lines += ["", "the same, one efficiency for every kernel with FLOPs:"]
    lines += [f"| {r['arm']} | {1e3 * r['predicted_s']:,.1f} | {1e3 * r['measured_s']:,.1f} | "
              f"{100 * (r['predicted_s'] / r['measured_s'] - 1):+.1f}% |"
              for r in out["single_efficiency_out_of_sample"]]
    for name in ("fit", "out_of_sample_fit"):
        fit = out[name]
        text = ", ".join(f"{k} = {v:.4g}" for k, v in fit.items() if k != "attention")
        text += ", attention " + ", ".join(f"{k}: {v:.4g}" for k, v in fit["attention"].items())
        lines.append(f"\n{name}: {text}")
    lines.append(f"RMS error {100 * out['rms_error']:.1f}% (max {100 * out['max_error']:.1f}%), "
                 f"leave-one-out RMS {100 * out['held_out_rms_error']:.1f}%")
    if out["out_of_sample_rms_error"] is not None:
        lines.append(f"out of sample RMS {100 * out['out_of_sample_rms_error']:.1f}% (max "
                     f"{100 * out['out_of_sample_max_error']:.1f}%)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
