"""Smoke tests of the benchmarks (lab.benchmarks, run by experiments/benchmark.py) and
of the summarising code of the convergence study (lab.studies).

Tiny sizes, one repeat: they check that the scripts run and write what docs/benchmarks.md reads,
never how fast anything is (timings on shared CPU cores are no test material).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from lab.benchmarks import decoding, flops, report, runner, trace, training_step
from lab.studies.arms import DIVERGED, arm_names, arm_settings, run_dir
from lab.studies.figures import plot_convergence
from lab.studies.runner import StudyOptions, make_config
from lab.studies.summary import markdown, summarize, updates_to_reach
from tests import kit

TINY = {"emb": 16, "mlp": 32, "heads": 2, "layers": 1, "vocab": 64, "tokens": 64, "length": 8,
        "warmup": 1, "repeats": 1}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_layer_and_router_sections(tmp_path):
    out = tmp_path / "bench.json"
    result = runner.run(runner.BenchmarkSettings(
        out=str(out), experts=[2], step_seconds=1.0, sections=["router", "moe_vs_dense"], **TINY),
        command="test")
    saved = json.loads(out.read_text())
    assert set(saved["moe_vs_dense"]["2"]) == {"ragged", "padded", "auto"}
    assert saved["router"]["2"]["extra_fraction_of_step"] is not None
    assert saved["machine"]["backend"] == result["machine"]["backend"]
    assert "| N |" in report.markdown_tables(saved)


def test_overhead_section_json(monkeypatch):
    """The overhead section's bookkeeping, with a stand-in for the compiled training step."""

    class FakeStep:
        def __init__(self, config, vocab, batch):
            self.router = config.router.name

        def __call__(self):
            return np.zeros(())

    monkeypatch.setattr(training_step, "TrainStep", FakeStep)
    sizes = {"emb": 16, "mlp": 32, "heads": 2, "layers": 1, "vocab": 64, "tokens": 64,
             "length": 8}
    out = training_step.bench_overhead(sizes, [2, 4], "float32", warmup=1, repeats=3)
    assert set(out) == {"2", "4"}
    assert out["4"].keys() >= {"switch_s", "sparsemixer_s", "ratio", "paired_ratio"}
    assert out["4"]["paired_ratio"]["n"] == 3


def test_overhead_section_times_any_router_against_switch(monkeypatch):
    """``routers``: Switch first (added if missing), every other router with its paired wall and
    CPU-time ratios and the FLOP ratio of the model FLOP count; SparseMixer's ``ratio`` kept."""
    built = []

    class FakeStep:
        def __init__(self, config, vocab, batch):
            built.append(config.router.name)

        def __call__(self):
            return np.zeros(())

    monkeypatch.setattr(training_step, "TrainStep", FakeStep)
    sizes = {"emb": 16, "mlp": 32, "heads": 2, "layers": 1, "vocab": 64, "tokens": 64,
             "length": 8}
    out = training_step.bench_overhead(sizes, [4], "float32", warmup=1, repeats=2,
                                       routers=["densemixer", "default_moe", "sparsemixer"])
    assert built == ["switch", "densemixer", "default_moe", "sparsemixer"]
    row = out["4"]
    assert list(row["to_switch"]) == built and "ratio" in row and "densemixer_s" in row
    dm = row["to_switch"]["densemixer"]
    assert dm["paired_ratio"]["n"] == 2 and dm["paired_cpu_ratio"]["n"] == 2
    assert dm["flop_ratio"] == pytest.approx(flops.model_flops_per_step(sizes, 4, "densemixer")
                                             / flops.model_flops_per_step(sizes, 4))
    assert row["to_switch"]["sparsemixer"]["flop_ratio"] == 1.0
    table = report.markdown_tables({"overhead": out})
    assert "| 4 | densemixer |" in table and "| 4 | switch |" in table
    # Without SparseMixer there is no SparseMixer ratio, and the table still prints.
    out = training_step.bench_overhead(sizes, [4], "float32", warmup=1, repeats=1,
                                       routers=["default_moe"])
    assert "ratio" not in out["4"] and list(out["4"]["to_switch"]) == ["switch", "default_moe"]
    assert "| 4 | default_moe |" in report.markdown_tables({"overhead": out})


def test_fusion_section_json(monkeypatch):
    """The fusion section's bookkeeping, with a stand-in for the compiled training step."""
    built = []

    class FakeStep:
        def __init__(self, config, vocab, batch, fused=True):
            built.append((config.model.num_experts, fused, config.model.attention_impl,
                          config.model.attention_dropout))

        def __call__(self):
            return np.zeros(())

    monkeypatch.setattr(training_step, "TrainStep", FakeStep)
    sizes = {"emb": 16, "mlp": 32, "heads": 2, "layers": 1, "vocab": 64, "tokens": 64,
             "length": 8}
    out = training_step.bench_fusion(sizes, [4], "float32", warmup=1, repeats=2,
                                     attention_impl="xla")
    assert set(out) == {"dense", "4"} and out["4"]["fused"]["n"] == 2
    assert built == [(0, True, "xla", 0.0), (0, False, "xla", 0.0), (4, True, "xla", 0.0),
                     (4, False, "xla", 0.0)]
    assert "| dense |" in report.markdown_tables({"fusion": out})


def test_decode_section_runs(tmp_path):
    """Beam search of the dense model on one tiny batch (one compilation, a few seconds)."""
    sizes = {"emb": 16, "mlp": 32, "heads": 2, "layers": 1, "vocab": 64, "tokens": 64,
             "length": 8}
    out = decoding.bench_decode(sizes, [], "float32", warmup=1, repeats=1, beam_size=2,
                                max_extra_len=3, shapes={"tiny": (3, 6)})
    r = out["dense/tiny"]
    assert r["sentences"] == 3 and r["sentences_per_s"] > 0 and r["compile_s"] >= 0
    assert "| dense/tiny | 3 x 6 |" in report.markdown_tables({"decode": out})


def test_backend_gpu_means_cuda(tmp_path):
    # jax 0.11: JAX_PLATFORMS=gpu tries ROCm on a CUDA machine; the CUDA plugin is "cuda".
    assert runner.PLATFORMS["gpu"] == runner.PLATFORMS["cuda"] == "cuda"
    # The command line takes --backend gpu (--report prints a result file and starts nothing).
    import subprocess
    import sys

    result = tmp_path / "bench.json"
    result.write_text(json.dumps({"router": {"2": {
        "switch": {"median": 1e-4}, "sparsemixer": {"median": 2e-4},
        "extra_fraction_of_step": None}}}))
    command = [sys.executable, "-m", "experiments.benchmark", "--backend", "gpu", "--report",
               str(result)]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "| N |" in run.stdout, run.stderr[-2000:]


def test_gpu_campaign_script_parses_and_names_real_files():
    """experiments/gpu_campaign.sh is valid bash, its test files exist, and it writes at most the
    8 files a remote GPU run may bring back. (Run on CPU at tiny sizes with PLATFORM=cpu: see
    docs/benchmarks.md, GPU, "On CPU".)"""
    import re
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "experiments", "gpu_campaign.sh")
    subprocess.run(["bash", "-n", script], check=True)
    with open(script) as f:
        text = f.read()
    for test_file in set(re.findall(r"tests/test_\w+\.py", text)):
        assert os.path.exists(os.path.join(root, test_file)), test_file
    outputs = set(re.findall(r'"\$OUT/([\w.$]+)', text))
    parts = {"layer", "step", "variants", "profile", "decode"}  # "$OUT/$part.json"
    assert len((outputs - {"$part.json"}) | {f"{p}.json" for p in parts}) <= 8, outputs


_FAKE_BENCHMARK = """#!{python}
# experiments.benchmark stand-in: writes its arguments where --out names; all else runs python.
import json, os, sys
if sys.argv[1:3] == ["-m", "experiments.benchmark"]:
    with open(sys.argv[sys.argv.index("--out") + 1], "w") as f:
        json.dump({{"argv": sys.argv[3:]}}, f)
else:
    os.execv({python!r}, [{python!r}] + sys.argv[1:])
"""


@pytest.mark.parametrize("lm_routers, runs", [
    ("sparsemixer_v2 densemixer", {"lm_throughput_cudnn_sparsemixer_v2": ["sparsemixer_v2"],
                                   "lm_throughput_cudnn_densemixer": ["densemixer"]}),
    ("", {"lm_throughput_cudnn": []}),
])
def test_gpu_campaign_times_each_lm_router_in_a_run_of_its_own(tmp_path, lm_routers, runs):
    """Four arms of the language model do not fit one H200: part "lm" runs top-2, one router and
    dense per process, one run per router of LM_ROUTERS (none set: top-2 and dense alone)."""
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(_FAKE_BENCHMARK.format(python=sys.executable))
    (bin_dir / "python").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
               LM_ROUTERS=lm_routers, PLATFORM="cpu", BENCH_ARGS="")
    subprocess.run(["bash", "experiments/gpu_campaign.sh", "lm"], cwd=REPO, env=env,
                   check=True, capture_output=True, timeout=120)
    saved = json.loads((tmp_path / "out" / "step.json").read_text())["runs"]
    assert set(saved) == set(runs)
    for name, routers in runs.items():
        argv = saved[name]["argv"]
        got = argv[argv.index("--lm-routers") + 1:] if "--lm-routers" in argv else []
        assert got == routers, argv  # that router alone


@pytest.mark.slow
def test_benchmark_whole_training_step(tmp_path):
    """The real thing at tiny sizes: four compiled training steps, Switch, SparseMixer,
    DenseMixer and Default MoE (about a minute on 2 shared CPU cores, most of it compilation)."""
    out = tmp_path / "bench.json"
    runner.run(runner.BenchmarkSettings(out=str(out), experts=[2], sections=["overhead"],
                                        routers=["sparsemixer", "densemixer", "default_moe"],
                                        **TINY), command="test")
    saved = json.loads(out.read_text())
    assert saved["overhead"]["2"]["ratio"] > 0
    assert saved["overhead"]["2"]["to_switch"]["densemixer"]["flop_ratio"] > 1


def test_model_flops_counts_the_output_projection():
    sizes = {"emb": 8, "mlp": 16, "layers": 1, "vocab": 10, "tokens": 4, "length": 4}
    with_vocab = flops.model_flops_per_step({**sizes, "vocab": 20}, 0)
    # 2 e V forward per target token, times 3 for forward + backward, 4 tokens.
    assert with_vocab - flops.model_flops_per_step(sizes, 0) == 3 * 4 * 2 * 8 * 10
    # Top-1 MoE adds only the router's FLOPs.
    assert flops.model_flops_per_step(sizes, 4) > flops.model_flops_per_step(sizes, 0)


def test_unchosen_expert_flops_by_hand():
    """DenseMixer's dense pass (forward only) and the unchosen-expert term of DenseMixer and
    Default MoE, counted by hand on emb 2, mlp 3, N = 4."""
    e, m, n = 2, 3, 4
    # All 4 experts, two matmuls each (2 e m + 2 m e), forward only: 4 * 24 = 96.
    # sum_j c_j pi_j v_j ([4] x [4, 2]): 2 * 4 * 2 = 16 forward, 16 backward (coefficients only).
    assert flops.unchosen_flops_per_token("densemixer", e, m, n) == {
        "dense_pass": 96.0, "unchosen_term": 32.0, "total": 128.0}
    assert flops.unchosen_flops_per_token("densemixer_blog", e, m, n)["total"] == 128.0
    for router in ("default_moe", "default_moe_st"):
        assert flops.unchosen_flops_per_token(router, e, m, n) == {
            "dense_pass": 0.0, "unchosen_term": 32.0, "total": 32.0}
    for router in ("switch", "sparsemixer", "sparsemixer_v2"):
        assert flops.unchosen_flops_per_token(router, e, m, n)["total"] == 0.0
    with pytest.raises(ValueError, match="unknown router"):
        flops.unchosen_flops_per_token("nope", e, m, n)
    # One layer, fwd + bwd: 3 * (router 2 e N = 16 + expert 4 e m = 24) = 120, plus the above.
    assert flops.moe_layer_flops_per_token(e, m, n) == 120.0
    assert flops.moe_layer_flops_per_token(e, m, n, "densemixer") == 248.0
    assert flops.moe_layer_flops_per_token(e, m, n, "default_moe") == 152.0
    # The whole step: one MoE layer in encoder and decoder (layers = 1), 4 tokens per side.
    sizes = {"emb": 8, "mlp": 16, "layers": 1, "vocab": 10, "tokens": 4, "length": 4}
    switch = flops.model_flops_per_step(sizes, 4)
    assert flops.model_flops_per_step(sizes, 4, "sparsemixer") == switch
    assert flops.model_flops_per_step(sizes, 4, "densemixer") - switch == \
        4 * 2 * (4 * 4 * 8 * 16 + 4 * 4 * 8)
    assert flops.model_flops_per_step(sizes, 4, "default_moe") - switch == 4 * 2 * (4 * 4 * 8)
    assert flops.model_flops_per_step(sizes, 0, "densemixer") == flops.model_flops_per_step(
        sizes, 0)


def test_dense_pass_flops_match_xla_cost_analysis():
    """XLA's own count of ``all_expert_outputs`` is the dense-pass term plus the bias adds and
    the ReLU (``rows * N * (2 m + e)``), which the model-FLOP convention leaves out."""
    import jax
    import jax.numpy as jnp

    from sparsemixer_jax.moe.unchosen import all_expert_outputs

    rows, n, e, m = 5, 4, 2, 3
    params = (jnp.ones((n, e, m)), jnp.ones((n, m)), jnp.ones((n, m, e)), jnp.ones((n, e)))
    cost = jax.jit(all_expert_outputs).lower(jnp.ones((rows, e)), params).compile() \
        .cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    dense_pass = flops.unchosen_flops_per_token("densemixer", e, m, n)["dense_pass"]
    assert cost["flops"] == rows * dense_pass + rows * n * (2 * m + e)


@pytest.mark.slow  # fast counterparts: the FLOP model by hand and the layer/router sections
def test_layer_cost_section_runs(tmp_path):
    """One MoE layer with Switch, DenseMixer and Default MoE at tiny sizes (three compilations);
    the Default MoE step computes the update of its default vectors."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from lab.benchmarks.layers import layer_step

    out = tmp_path / "bench.json"
    runner.run(runner.BenchmarkSettings(
        out=str(out), experts=[2], sections=["layer_cost"],
        routers=["densemixer", "default_moe"], **TINY), command="test")
    saved = json.loads(out.read_text())
    assert saved["routers"] == ["switch", "densemixer", "default_moe"]
    rows = saved["layer_cost"]["2"]["to_switch"]
    assert list(rows) == saved["routers"]
    e, m = TINY["emb"], TINY["mlp"]
    assert rows["densemixer"]["flop_ratio"] == pytest.approx(
        flops.moe_layer_flops_per_token(e, m, 2, "densemixer")
        / flops.moe_layer_flops_per_token(e, m, 2))
    assert rows["densemixer"]["time"]["median"] > 0
    assert "| 2 | default_moe |" in report.markdown_tables(saved)

    layer = kit.moe_layer(e, m, 2, router="default_moe", rngs=nnx.Rngs(0))
    _, state = layer_step(layer, jnp.ones((2, 4, e)))()
    defaults = jax.tree.leaves(state)
    assert len(defaults) == 1 and float(jnp.abs(defaults[0]).sum()) > 0
    assert float(jnp.abs(layer.expert_defaults[...]).sum()) == 0  # the layer is left unchanged
    with pytest.raises(ValueError, match="unknown routers"):
        runner.run(runner.BenchmarkSettings(out=None, sections=["layer_cost"],
                                            routers=["nope"], **TINY), command="test")


def test_summarize_trace_self_times(tmp_path):
    import gzip

    events = [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "XLAEigen"}},
        {"ph": "X", "name": "while.1", "pid": 1, "tid": 2, "ts": 0, "dur": 10},
        {"ph": "X", "name": "dot.3", "pid": 1, "tid": 2, "ts": 1, "dur": 6},
        {"ph": "X", "name": "add_fusion.4", "pid": 1, "tid": 2, "ts": 20, "dur": 4},
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = trace.summarize_trace(str(path), steps=2)
    cats = summary["categories"]
    assert math.isclose(cats["matmul"]["s_per_step"], 3e-6)  # 6 us over 2 steps
    assert math.isclose(cats["while"]["s_per_step"], 2e-6)  # 10 - 6 us nested, over 2 steps
    assert math.isclose(summary["device_s_per_step"], 7e-6)


def test_summarize_gpu_trace_counts_stream_kernels_only():
    """``tests/data/gpu_trace.trace.json.gz``: a synthesized two-step trace in the layout that
    jax.profiler writes on an NVIDIA GPU (a ``/device:GPU:0`` process with ``Stream #..`` threads
    of kernels and summary threads ``XLA Ops``/``XLA Modules``/``Steps``, a ``/host:CPU`` process
    with the ``python`` thread), with made-up durations in microseconds."""
    path = os.path.join(os.path.dirname(__file__), "data", "gpu_trace.trace.json.gz")
    summary = trace.summarize_trace(path, steps=2)
    assert summary["device_kind"] == "accelerator streams"
    assert summary["streams"] == ["/device:GPU:0 Stream #14(Compute)",
                                  "/device:GPU:0 Stream #15(MemcpyH2D)"]
    cats = {k: v["s_per_step"] * 1e6 for k, v in summary["categories"].items()}
    # Per step: kernels 40 + 10 + 6 + 8 + 12 + 4 + 6 + 2 = 88 us, memcpy 4 us; the summary lines
    # (XLA Ops 50, XLA Modules 120, Steps 200) and every host thread are left out.
    assert cats == pytest.approx({"matmul": 40, "other fusion": 10, "reduction fusion": 6,
                                  "scatter": 8, "attention (fused)": 12, "collective": 4,
                                  "rng": 6, "triton fusion": 2, "memcpy/memset": 4})
    assert summary["device_s_per_step"] == pytest.approx(92e-6)
    ops = [op["op"] for op in summary["top_ops"]]
    assert not any(name in ops for name in ("stop_trace", "block_until_ready", "dot.12", "step"))
    # 300 us, of which 50 us are the nested stop_trace: 250 us self time per step.
    assert summary["host_python_s_per_step"]["block_until_ready"] == pytest.approx(250e-6)


def _fake_run(root, arm, seed, valid, final=True, bleu=10.0):
    workdir = run_dir(str(root), arm, seed)
    os.makedirs(workdir)
    router, n = arm_settings(arm)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"model": {"num_experts": n}, "router": {"name": router}}, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for step, loss in enumerate(valid, 1):
            f.write(json.dumps({"step": step * 10, "loss": loss + 0.1, "tokens_per_s": 1.0})
                    + "\n")
            f.write(json.dumps({"step": step * 10, "valid_loss": loss}) + "\n")
    if final:
        with open(os.path.join(workdir, "results.json"), "w") as f:
            json.dump({"bleu": bleu, "bleu_best": bleu + 1, "best_valid_loss": min(valid),
                       "tokens_per_second": 100.0}, f)


def test_compare_summary_tables_and_plot(tmp_path):
    root = tmp_path / "runs"
    for seed in (0, 1, 2):
        _fake_run(root, "switch_n4", seed, [5.0, 4.0, 3.0 + 0.1 * seed])
        _fake_run(root, "sparsemixer_n4", seed, [4.5, 3.0, 2.5], bleu=12.0)
        _fake_run(root, "dense", seed, [5.0, 4.5, 4.0], final=seed < 2)
    _fake_run(root, "switch_n8", 0, [5.0, 9.0], final=False)
    with open(os.path.join(run_dir(str(root), "switch_n8", 0), DIVERGED), "w") as f:
        f.write("{}")
    arms = arm_names([4])
    summary = summarize(str(root), arms, [0, 1, 2])
    assert summary["checkpoints"] == [10, 20, 30]
    sm = summary["arms"]["sparsemixer_n4"]
    assert sm["valid_loss_at"]["20"]["mean"] == pytest.approx(3.0)
    assert sm["target_valid_loss"] == pytest.approx(3.1)  # mean of Switch's final losses
    # 4.5 at 10 and 3.0 at 20: 3.1 is reached at 10 + 10 * 1.4 / 1.5 updates.
    assert sm["updates_to_target"]["mean"] == pytest.approx(10 + 10 * 1.4 / 1.5)
    assert sm["bleu"]["mean"] == pytest.approx(12.0) and sm["bleu"]["std"] == 0.0
    paired = sm["paired_minus_target_arm"]
    assert paired["final_valid_loss"]["mean"] == pytest.approx(2.5 - 3.1)
    assert paired["bleu"]["mean"] == pytest.approx(2.0)
    dense = summary["arms"]["dense"]
    # The unfinished dense run is listed and left out of every figure.
    assert dense["finished"] == 2 and dense["unfinished_seeds"] == [2]
    assert dense["updates_to_target"]["not_reached"] == 2
    assert dense["final_valid_loss"]["n"] == 2
    assert dense["paired_minus_target_arm"]["final_valid_loss"]["n"] == 2
    # Paired by seed: 2.5 - (3.0, 3.1, 3.2) = (-0.5, -0.6, -0.7), SE 0.1 / sqrt(3); all better.
    assert paired["final_valid_loss"]["se"] == pytest.approx(0.1 / np.sqrt(3))
    assert paired["final_valid_loss"]["negative"] == 3
    table = markdown(summary)
    assert "sparsemixer_n4" in table and "never reached" in table
    assert "| sparsemixer_n4 − switch_n4 | -0.600 ± 0.058 (3/3) | +2.00 ± 0.00 (3/3) |" in table
    # versus: every arm against the one named, here Switch minus SparseMixer, seed by seed.
    against = summarize(str(root), arms, [0, 1, 2], versus="sparsemixer_n4")["arms"]
    assert against["switch_n4"]["target_arm"] == "sparsemixer_n4"
    assert against["switch_n4"]["paired_minus_target_arm"]["final_valid_loss"]["values"] == (
        pytest.approx([0.5, 0.6, 0.7]))
    assert "paired_minus_target_arm" not in against["sparsemixer_n4"]
    with pytest.raises(ValueError, match="versus='switch_n8' is not one of the arms"):
        summarize(str(root), arms, [0, 1, 2], versus="switch_n8")
    # A diverged run is counted apart, not as unfinished, and left out of the figures.
    n8 = summarize(str(root), ["switch_n8"], [0])["arms"]["switch_n8"]
    assert n8["diverged_seeds"] == [0] and n8["unfinished_seeds"] == [] and n8["finished"] == 0
    assert "| switch_n8 | 0 (1 diverged) |" in markdown(
        summarize(str(root), ["switch_n8"], [0]))
    plot_convergence(str(root), summary, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_updates_to_reach_interpolates():
    steps, losses = np.array([10, 20, 30]), np.array([5.0, 4.0, 3.0])
    assert updates_to_reach(steps, losses, 3.5) == pytest.approx(25.0)
    assert updates_to_reach(steps, losses, 6.0) == 10.0
    assert updates_to_reach(steps, losses, 2.0) is None


def test_make_config_sets_arm_and_overrides():
    config = make_config("configs/multi30k_compare.py", "switch_n8", 2, 7,
                                 ["model.emb_dim=64", "decode.beam_size=2"])
    assert (config.router.name, config.model.num_experts, config.seed) == ("switch", 8, 2)
    assert config.train_steps == 7 and config.model.emb_dim == 64
    assert config.decode.beam_size == 2
    assert make_config("configs/multi30k_compare.py", "dense", 0, None).model \
        .num_experts == 0
    with pytest.raises(ValueError, match="set per run by the study"):
        make_config("configs/multi30k_compare.py", "dense", 0, None,
                            ["model.num_experts=8"])


def test_compare_writes_its_tables_under_root_by_default(tmp_path):
    args = StudyOptions(config="configs/multi30k_compare.py", root=str(tmp_path),
                                     arms=["switch_n4"], seeds=[0])
    assert args.out_json == str(tmp_path / "compare.json")
    assert args.plot == str(tmp_path / "convergence.png")


def test_routing_options_benchmark_writes_its_table(tmp_path):
    """The campaign's ``routing`` part reads this JSON (one option, the plain router, keeps the
    test to one compile)."""
    from experiments import bench_routing_options

    out = tmp_path / "routing.json"
    results = bench_routing_options.main([
        "--emb", "16", "--mlp", "32", "--layers", "1", "--tokens", "64", "--length", "16",
        "--vocab", "50", "--steps", "1", "--repeats", "2", "--options", "plain",
        "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["options"] == results
    assert set(results) == {"plain"}
    assert results["plain"]["ratio"] == 1.0
    assert all(len(rounds) == 2 for rounds in saved["rounds_s"].values())
    assert saved["settings"]["emb"] == 16 and saved["backend"] == "cpu"


def test_routing_options_report_reads_the_rounds_of_a_stopped_run():
    """A run stopped after its first round (``options`` still ``None``) reports that round."""
    from lab.benchmarks.report import markdown_tables

    stopped = {"backend": "gpu", "device": "H100", "settings": {"repeats": 5}, "options": None,
               "rounds_s": {"plain": [0.100, 0.104], "sigmoid": [0.102]}}
    table = markdown_tables(stopped)
    assert "1 of 5 rounds" in table
    assert "| sigmoid | 102.00 | 1.020 | [1.020, 1.020] |" in table
