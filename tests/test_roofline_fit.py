"""The roofline's per-kind calibration (``roofline.Calibration``) and its fit on the committed GPU
runs (``lab.benchmarks.roofline_programs``, ``lab.benchmarks.roofline_fit``): each kind of
kernel at its own rate, the fit's vectorised prediction against the roofline's own, twins
counted once, and the committed fit reproduced from the committed files (no compiling).

The chip is the round one of tests/test_roofline.py (1 TFLOP/s, 1 GB/s); the calibration's
fractions are powers of two, so the expected times are exact hand counts.
"""

import json

import pytest

from lab.benchmarks import roofline_fit, roofline_programs
from sparsemixer_jax.aot import hlo, roofline
from tests.test_roofline import ATTENTION, CHIP, GEMM, GROUPED, LOOP

CALIBRATION = roofline.Calibration(kernel_seconds=1e-3, gemm_peak_fraction=0.5,
                                   gemm_half_flops=1e9, memory_fraction=0.5,
                                   pallas_fraction=0.25, attention=(("forward CAUSAL", 0.125),))
FAST_MEMORY = roofline.Chip("fast memory", peak_flops=1e12, hbm_bandwidth=1e15,
                            link_bandwidth=1e8, source="test")
BACKWARD = ATTENTION.replace("fmhaSoftmax", "fmhaSoftmaxBackward")
COMMITTED = "docs/results/roofline_fit_kinds.json"


def _op(text: str) -> roofline.Op:
    (op,) = roofline.program_ops(hlo.parse_module(text))
    return op


def test_each_kind_of_kernel_runs_at_its_own_fraction_of_peak():
    gemm, grouped, forward, backward = map(_op, (GEMM, GROUPED, ATTENTION, BACKWARD))
    assert [o.cost_class for o in (gemm, grouped, forward, backward)] == [
        "gemm", "pallas", "attention forward CAUSAL", "attention backward CAUSAL"]
    # Compute-bound with HBM this fast: each at its class's fraction, plus the kernel cost.
    f = gemm.flops
    assert gemm.seconds(FAST_MEMORY, CALIBRATION) == pytest.approx(
        f / (1e12 * 0.5 * f / (f + 1e9)) + 1e-3, rel=1e-12)
    assert grouped.seconds(FAST_MEMORY, CALIBRATION) == pytest.approx(
        grouped.flops / 0.25e12 + 1e-3, rel=1e-12)
    assert forward.seconds(FAST_MEMORY, CALIBRATION) == pytest.approx(
        forward.flops / 0.125e12 + 1e-3, rel=1e-12)
    # No backward variant calibrated: the GEMM's rate at its size.
    b = backward.flops
    assert backward.seconds(FAST_MEMORY, CALIBRATION) == pytest.approx(
        b / (1e12 * 0.5 * b / (b + 1e9)) + 1e-3, rel=1e-12)
    # An unmeasured mask type takes the measured variant of its direction.
    packed = _op(ATTENTION.replace('"mask_type":"CAUSAL"', '"mask_type":"PADDING_CAUSAL"'))
    assert packed.cost_class == "attention forward PADDING_CAUSAL"
    assert CALIBRATION.compute_fraction(packed.cost_class, packed.flops) == 0.125
    # A bias operand is its own variant (cuDNN's ScaleBias calls).
    biased = _op(ATTENTION.replace("fmhaSoftmax", "fmhaScaleBiasSoftmax"))
    assert biased.cost_class == "attention forward CAUSAL bias"


def test_the_terms_per_class_add_up_to_the_prediction():
    for text, classes in ((GEMM, {"gemm"}), (GROUPED, {"pallas"}),
                          (ATTENTION, {"attention forward CAUSAL"}), (LOOP, {"memory"})):
        result = roofline.roofline(text, CHIP, None, calibration=CALIBRATION)
        assert set(result["classes"]) == classes
        assert sum(c["seconds"] for c in result["classes"].values()) == pytest.approx(
            result["predicted_seconds"], rel=1e-12)
        assert sum(c["kernels"] for c in result["classes"].values()) == result["kernels"]


def test_the_fit_predicts_an_update_as_the_roofline_does():
    # An update that runs the GEMM 3 times, the grouped kernel once, forward and backward
    # attention twice.
    programs = [(GEMM, 3), (GROUPED, 1), (ATTENTION, 2), (BACKWARD, 2)]
    rows = roofline_programs.op_rows(programs)
    variants = ["backward CAUSAL", "forward CAUSAL"]
    table = roofline_fit.Table(rows, CHIP, variants)
    fractions = {"backward CAUSAL": 0.0625, "forward CAUSAL": 0.125}
    calibration = roofline.Calibration(**{**vars(CALIBRATION),
                                          "attention": tuple(fractions.items())})
    params = [getattr(calibration, name) for name in roofline_fit.PARAMETERS] + \
        [fractions[v] for v in variants]
    expected = {text: runs * _op(text).seconds(CHIP, calibration) for text, runs in programs}
    # Vectorised, the fit's prediction is the roofline's per-op time, runs included.
    assert table.seconds(params).sum() == pytest.approx(sum(expected.values()), rel=1e-12)
    kinds = table.by_kind(params)
    assert kinds == pytest.approx({"gemm": expected[GEMM], "pallas": expected[GROUPED],
                                   "attention forward": expected[ATTENTION],
                                   "attention backward": expected[BACKWARD], "rest": 0.0},
                                  rel=1e-12)
    assert roofline_fit.calibration(params, variants)["attention"] == fractions


def test_arms_that_compile_to_one_program_are_one_program():
    arm = {"file": "f.json", "run": "r", "chip": "h200", "commit": "c", "attention_impl": "cudnn",
           "dispatch": "grouped", "sizes": {"micro_rows": 8}, "lm_config": None}
    rows = roofline_programs.op_rows([(GEMM, 1)])
    other = roofline_programs.op_rows([(GEMM, 2)])
    programs = roofline_programs.distinct_programs([
        ({**arm, "arm": "sparsemixer_v2"}, "h200:1x1", rows),
        ({**arm, "arm": "top2"}, "h200:1x1", other),
        ({**arm, "arm": "sparsemixer_v2star"}, "h200:1x1", rows)])
    assert [[a["arm"] for a in p["arms"]] for p in programs] == [
        ["sparsemixer_v2", "sparsemixer_v2star"], ["top2"]]


@pytest.fixture(scope="module")
def committed():
    with open(COMMITTED) as f:
        out = json.load(f)
    return out, roofline_fit.Data(out["programs"], out["measured"])


def test_the_committed_programs_count_each_program_once(committed):
    out, data = committed
    ids = [p["id"] for p in data.programs]
    assert len(ids) == len(set(ids)) == len(out["rows"])
    named = [(a["file"], a["run"], a["arm"]) for p in data.programs for a in p["arms"]]
    measured = [(a["file"], a["run"], a["arm"]) for path in out["measured"]
                for a in roofline_programs.measured_arms(path)]
    assert sorted(named) == sorted(measured)  # every timed arm in exactly one program
    # SparseMixer v2 and v2* of one file (one commit), attention and dispatch compile to one
    # program, whose time is their mean.
    program_of = {(a["file"], a["run"], a["arm"]): i for i, p in enumerate(data.programs)
                  for a in p["arms"]}
    arms = [a for path in out["measured"] for a in roofline_programs.measured_arms(path)]
    pairs = [(a, b) for a in arms for b in arms if a["arm"] == "sparsemixer_v2star"
             and b["arm"] == "sparsemixer_v2" and all(
                 a[k] == b[k] for k in ("file", "attention_impl", "dispatch"))]
    assert len(pairs) == 3  # H100 padded and grouped, H200 cuDNN
    for a, b in pairs:
        i = program_of[(a["file"], a["run"], a["arm"])]
        assert i == program_of[(b["file"], b["run"], b["arm"])]
        assert data.labels[i] == "sparsemixer_v2=sparsemixer_v2star"
        assert data.measured[i] == (a["seconds"] + b["seconds"]) / 2


def test_the_fit_reproduces_the_committed_json(committed):
    out, data = committed
    again = roofline_fit.fit_all(data, out["out_of_sample_files"])
    # The same least squares on the same numbers: agreement to its convergence tolerance
    # (scipy's default ftol / xtol of 1e-8), far inside 1e-6 relative.
    for name in ("fit", "out_of_sample_fit"):
        for key, value in out[name].items():
            assert again[name][key] == pytest.approx(value, rel=1e-6)
    assert [r["arm"] for r in again["out_of_sample"]] == [r["arm"] for r in out["out_of_sample"]]
    for new, old in zip(again["out_of_sample"] + again["rows"]
                        + again["single_efficiency_out_of_sample"],
                        out["out_of_sample"] + out["rows"]
                        + out["single_efficiency_out_of_sample"], strict=True):
        assert new["measured_s"] == old["measured_s"]
        assert new.get("predicted_s", new.get("calibrated_s")) == pytest.approx(
            old.get("predicted_s", old.get("calibrated_s")), rel=1e-6)


def test_the_out_of_sample_test_predicts_each_held_out_program_once(committed):
    out, data = committed
    assert len(out["out_of_sample"]) >= 4
    held = [i for i, files in enumerate(data.files) if files & set(out["out_of_sample_files"])]
    assert sorted(r["program"] for r in out["out_of_sample"]) == sorted(
        data.programs[i]["id"] for i in held)


def test_the_roofline_uses_the_committed_fit(committed):
    fit = committed[0]["fit"]
    # GPU_FIT writes the fit to 3 significant digits: within 0.5% of each constant.
    for key in roofline_fit.PARAMETERS:
        assert getattr(roofline.GPU_FIT, key) == pytest.approx(fit[key], rel=5e-3, abs=1e-300)
    assert dict(roofline.GPU_FIT.attention) == pytest.approx(fit["attention"], rel=5e-3)


def test_the_fit_reads_the_measured_runs_with_their_chip_model_and_commit():
    arms = roofline_programs.measured_arms("docs/results/benchmark_lm_bench_h200.json")
    assert {a["chip"] for a in arms} == {"h200"} and {a["commit"] for a in arms} == {"566fd23"}
    assert {a["lm_config"] for a in arms} == {"configs/lm_bench.py:moe"}
    assert {a["attention_impl"] for a in arms} == {"einsum", "cudnn"}
    h100 = roofline_programs.measured_arms("docs/results/benchmark_lm_h100.json")
    assert {a["chip"] for a in h100} == {"h100"} and {a["lm_config"] for a in h100} == {None}
    eight = roofline_programs.measured_arms("docs/results/benchmark_lm_bench_h200_8row.json")
    # two runs of three arms (top-2, the router, dense); the profile and the failed run skipped
    assert [(a["run"].removeprefix("lm_throughput_cudnn_"), a["arm"]) for a in eight] == [
        (r, arm) for r in ("sparsemixer_v2", "densemixer") for arm in ("top2", r, "dense")]
    assert {a["sizes"]["micro_rows"] for a in eight} == {8}
