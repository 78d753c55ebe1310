"""The balancing table of the router benchmark and the commands of its language-model half.

One tiny two-step run (bias balancing beside a global-batch balance loss, two micro-batches)
is shared by the training tests.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
from flax import nnx

from experiments import router_bench
from lab.router_bench import report
from lab.router_bench.arms import (
    BALANCING_SETTINGS,
    BALANCINGS,
    SCORES,
    TABLES,
    Arm,
    balancing_estimators,
)
from lab.router_bench.balancing_report import markdown_balancing_table
from lab.router_bench.train import TrainConfig, train_arm
from lab.studies import lm_balancing
from lab.studies.runner import make_config
from sparsemixer_jax.tasks import check_config

TINY = TrainConfig(dim=8, hidden=16, teacher_hidden=4, batch=32, steps=2, eval_every=1,
                   train_size=256, eval_size=64, grad_tokens=32, measure_gradient=False)
RATE = 0.01
BIAS_ARM = Arm("switch_bias_gb", router="switch", top_k=2, num_experts=4, measure_gradient=False,
               bias_update_rate=RATE, balance_scope="global_batch", micro_batches=2)
def test_balancing_table_has_every_cell_and_refuses_none():
    arms = TABLES["balancing"]()
    names = {a.name for a in arms}
    assert len(names) == len(arms)
    for k in (1, 2):
        for n in (8, 16):
            for balancing in BALANCINGS:
                for router in balancing_estimators(k):
                    assert f"{router}_k{k}_n{n}_{balancing}" in names
    for arm in arms:  # SparseMixer takes bias balancing (its two-path estimator)
        assert arm.refusal() is None, (arm.name, arm.refusal())
    # Every balancing splits the step alike, so that the arms differ in the balancing only.
    assert {a.micro_batches for a in arms} == {2}


def test_balancing_settings_table_varies_micro_batches_and_bias_rate_only():
    arms = {a.name: a for a in TABLES["balancing_settings"]()}
    for k in (1, 2):
        for router in balancing_estimators(k):
            for suffix in BALANCING_SETTINGS:
                arm = arms[f"{router}_k{k}_n8_{suffix}"]
                assert arm.refusal() is None, arm.name
            mb8, gb8 = arms[f"{router}_k{k}_n8_mb8"], arms[f"{router}_k{k}_n8_gb8"]
            assert (mb8.micro_batches, gb8.micro_batches) == (8, 8)
            assert (mb8.balance_scope, gb8.balance_scope) == ("micro_batch", "global_batch")
    assert {a.bias_update_rate for a in arms.values()} == {0.0, 0.001, 0.1}
    assert {a.micro_batches for a in arms.values() if a.bias_update_rate} == {2}


def test_scores_table_takes_sigmoid_scores_with_and_without_bias():
    arms = {a.name: a for a in TABLES["scores"]()}
    for k in (1, 2):
        for n in (8, 16):
            for router in balancing_estimators(k):
                sig, sigbias = (arms[f"{router}_k{k}_n{n}_{s}"] for s in SCORES)
                assert (sig.score, sigbias.score) == ("sigmoid", "sigmoid")
                assert (sig.bias_update_rate, sigbias.bias_update_rate) == (0.0, 0.01)
                assert sigbias.balance_weight == 0.0 and sig.balance_weight is None
    # At k = 1 only SparseMixer composes: the others' one renormalised gate is always 1.
    assert arms["sparsemixer_k1_n8_sig"].refusal() is None
    assert "top_k >= 2" in arms["switch_k1_n8_sigbias"].refusal()
    assert arms["densemixer_k2_n16_sigbias"].refusal() is None
    # The routing reaches the layer's router config.
    assert arms["sparsemixer_v2_k2_n8_sig"].router_options()["score"] == "sigmoid"


def _fake_result(ln_mse: list[float]) -> dict:
    return {"per_seed": {"final_eval_mse": list(np.exp(ln_mse)),
                         "mean_load_imbalance": [1.5] * len(ln_mse),
                         "final_load_imbalance": [1.4] * len(ln_mse)},
            "steps": [0, 10], "timings_s": {"run_s": 1.0, "load_1m": 2.0}}


def test_settings_report_compares_each_arm_with_its_reference_balancing():
    ln = [0.0, 0.5, 1.0, 1.5]
    results = {"switch_k2_n8_mb8": _fake_result(ln),
               "switch_k2_n8_gb8": _fake_result([x - 0.25 for x in ln]),
               "densemixer_k2_n8_gb8": _fake_result([x - 0.5 for x in ln]),
               "switch_k2_n8_bias": _fake_result(ln),
               "switch_k2_n8_bias0.1": _fake_result([x + 1.0 for x in ln])}
    table = markdown_balancing_table(results, {}, TABLES["balancing_settings"]())
    rows = {line.split(" | ")[2] + " | " + line.split(" | ")[3]: line
            for line in table.splitlines()[2:]}
    gb8 = rows["switch | global-batch loss, 8 micro-batches"]
    assert "-0.250 ± 0.000 (4/4) * vs micro-batch loss, 8 micro-batches" in gb8
    assert "+1.000 ± 0.000 (0/4) * vs bias, no loss" in rows["switch | bias at rate 0.1, no loss"]
    # DenseMixer against top-k under the same balancing: 0.25 lower in every seed.
    assert "| -0.250 ± 0.000 (4/4) * |" in rows["densemixer | global-batch loss, 8 micro-batches"]


@pytest.fixture(scope="module")
def bias_run():
    return train_arm(BIAS_ARM, TINY, [0, 1])


def test_bias_balancing_moves_the_bias_after_each_step_and_resets_the_loads(bias_run):
    history, _ = bias_run
    layer = nnx.to_pure_dict(history.final_state[1])["layers"][0]
    bias, load = np.asarray(layer["expert_bias"]), np.asarray(layer["expert_load"])
    assert bias.shape == (2, 4) and load.shape == (2, 4)  # [seeds, N]
    np.testing.assert_array_equal(load, 0.0)  # reset after the update
    steps = bias / RATE  # two sign steps of the rate: each entry -2, -1, 0, 1 or 2 rates
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
    assert np.all(np.abs(steps) <= TINY.steps + 1e-4)
    assert np.all(np.any(bias != 0, axis=1))  # every seed's bias moved


def test_balancing_arm_trains_and_logs_the_update_imbalance(bias_run):
    history, _ = bias_run
    assert np.all(np.isfinite(history.eval_mse))
    imbalance = history.load_imbalance[:, 1:]  # step 0 has no training step
    assert np.all(np.isnan(history.load_imbalance[:, 0]))
    assert np.all((imbalance >= 1.0) & (imbalance <= BIAS_ARM.num_experts))
    summary = report.summarise(BIAS_ARM, history, {"run_s": 1.0})
    np.testing.assert_allclose(summary["per_seed"]["mean_load_imbalance"],
                               np.mean(imbalance, axis=1), rtol=1e-4)


def test_refused_pair_is_reported_and_not_trained(tmp_path, capsys, monkeypatch):
    # No arm of the table is refused by the router's config any more; one is made to be, to
    # check how the driver reports a refusal.
    refusal = Arm.refusal
    monkeypatch.setattr(Arm, "refusal", lambda arm: "does not compose (for the test)"
                        if arm.name == "sparsemixer_v2_k2_n8_bias" else refusal(arm))
    out = tmp_path / "balancing.json"
    router_bench.main(["--table", "balancing", "--arms", "sparsemixer_v2_k2_n8_bias", "--seeds",
                       "2", "--steps", "2", "--eval-every", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["arms"] == {}
    assert "does not compose" in saved["refused"]["sparsemixer_v2_k2_n8_bias"]
    printed = capsys.readouterr().out
    assert "sparsemixer_v2_k2_n8_bias: refused" in printed
    row = [line for line in printed.splitlines() if "| sparsemixer_v2 | bias, no loss |" in line]
    assert len(row) == 1 and "| refused |" in row[0]
    assert "refused" in markdown_balancing_table({}, saved["refused"])


@pytest.mark.parametrize("balancing", sorted(lm_balancing.LM_BALANCINGS))
def test_lm_study_commands_build_configs_that_check(balancing):
    overrides, arms = lm_balancing.LM_BALANCINGS[balancing]
    for arm in arms:
        config = make_config(lm_balancing.CONFIG, arm, 0, None, overrides)
        check_config(config)  # raises on anything the run would refuse
        assert config.data.micro_batch_size == 4
    left_out = set(lm_balancing.ALL_ARMS) - set(arms)
    for arm in left_out:  # left out when the config refused them; it takes them now
        check_config(make_config(lm_balancing.CONFIG, arm, 0, None, overrides))
    assert left_out == (set(lm_balancing.SPARSEMIXER_ARMS) if balancing.startswith("bias")
                        else set())


@pytest.mark.parametrize("routing", sorted(lm_balancing.LM_SCORES))
def test_lm_scores_study_builds_configs_that_check(routing):
    overrides, arms, versus = lm_balancing.LM_SCORES[routing]
    assert versus in arms and set(lm_balancing.SPARSEMIXER_ARMS) <= set(arms)
    score = "sigmoid" if routing.startswith("sig") else "softmax"
    for arm in arms:
        config = make_config(lm_balancing.CONFIG, arm, 0, None, overrides)
        check_config(config)
        assert (config.router.score, config.router.bias_update_rate) == (score, 0.01)
        assert config.router.balance_weight == 0.0
    args = compare_args(lm_balancing.scores_command(routing))
    assert args.seeds == list(lm_balancing.SCORE_SEEDS) and len(args.seeds) >= 5


def compare_args(command: str):
    from experiments import compare

    return compare.parse_args(command.split()[3:])


def test_lm_study_commands_are_the_documented_ones():
    docs = (pathlib.Path(__file__).parents[1] / "docs" / "router_bench.md").read_text()
    for command in lm_balancing.commands():
        assert command in docs


def test_lm_study_summary_commands_read_the_roots_the_commands_write():
    from experiments import compare

    for balancing in lm_balancing.LM_BALANCINGS:
        args = compare.parse_args(lm_balancing.summary_command(balancing).split()[3:])
        assert args.root == f"runs/lm_balancing_{balancing}" and args.summarize_only
        assert args.out_json == f"docs/results/lm_balancing_{balancing}_cpu.json"
        assert args.override == list(lm_balancing.LM_BALANCINGS[balancing][0])


def _lm_summary(losses: dict[str, dict[int, float]]) -> dict:
    """A study summary as ``experiments.compare --out-json`` writes it, for the given final
    validation losses by arm and seed (load imbalance and rate derived from them)."""
    arms = {}
    for arm, by_seed in losses.items():
        seeds = list(by_seed)
        arms[arm] = {"finished_seeds": seeds,
                     "final_valid_loss": {"values": [by_seed[s] for s in seeds]},
                     "load_imbalance": {"values": [by_seed[s] / 2 for s in seeds]},
                     "tokens_per_second_median_step": {"values": [1000 * by_seed[s]
                                                                  for s in seeds]}}
    return {"seeds": [0, 1, 2], "arms": arms}


def test_lm_balancing_table_pairs_by_seed_across_roots():
    switch, dense = lm_balancing.VERSUS, "densemixer_n8_eps0_norm1"
    mb = _lm_summary({switch: {0: 4.5, 1: 4.6, 2: 4.4}, dense: {0: 4.4, 1: 4.5, 2: 4.35}})
    # seed 0 of the Switch arm unfinished: the other seeds still pair with their own seed
    bias = _lm_summary({switch: {1: 4.7, 2: 4.3}, dense: {0: 9.9, 1: 4.8, 2: 4.2}})
    table = lm_balancing.balancing_table({"mb": mb, "bias": bias})
    lines = [line for line in table.splitlines() if line.startswith(f"| {dense} |")]
    assert len(lines) == 4  # versus top-2; versus itself under mb; load; rate
    # versus top-2 under mb: -0.1, -0.1, -0.05 -> mean -0.0833, SE 0.0167: beyond 2 SE
    assert "**−0.083 ± 0.017** (3/3)" in lines[0]
    # under bias, seeds 1 and 2 pair (+0.1, -0.1): the unfinished seed 0 pairs with nothing
    assert "+0.000 ± 0.100 (1/2)" in lines[0]
    # bias minus mb for DenseMixer, all three seeds: +5.5, +0.3, -0.15
    assert "+1.883 ± 1.813 (1/3)" in lines[1]
    assert "2.21 ± 0.02" in lines[2] and "4417 ± 44" in lines[3]
    # SparseMixer does not compose with bias balancing; the table says so in every table
    v2 = [line for line in table.splitlines() if line.startswith("| sparsemixer_v2_n8 |")]
    assert len(v2) == 4 and all(line.rstrip(" |").endswith("refused") for line in v2)
