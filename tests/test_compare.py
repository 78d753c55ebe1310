"""Tests of the convergence study (lab.studies, driven by experiments/compare.py) that
train nothing: arm names, target arms, the compact result files, packing, resuming and the
process pool."""

import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

from lab.studies import runner
from lab.studies.arms import arm_settings, parse_arm, run_dir, study_arms, target_arm
from lab.studies.curves import diagnostic_series
from lab.studies.figures import plot_convergence, plot_router
from lab.studies.summary import markdown, summarize


def test_arm_names_parse_into_config_fields():
    assert parse_arm("sparsemixer_nomask_n8") == {
        "router.name": "sparsemixer_nomask", "model.num_experts": 8}
    assert parse_arm("sparsemixer_n4_lr2e-3_eps0.5") == {
        "router.name": "sparsemixer", "model.num_experts": 4, "optim.peak_lr": 2e-3,
        "router.jitter_eps": 0.5}
    assert parse_arm("dense")["model.num_experts"] == 0
    for bad in ("switch", "switch_n4_foo3", "switch_n4_lrx", "Switch_n4"):
        with pytest.raises(ValueError, match="arm"):
            parse_arm(bad)


@pytest.mark.parametrize("router", ["densemixer", "densemixer_blog", "default_moe",
                                    "default_moe_st"])
def test_unchosen_expert_router_arms_parse_with_modifiers(router):
    """Router names with underscores: the router is everything before ``_n{N}`` (the regex is
    non-greedy, so ``default_moe_st_n4`` must not stop at ``default``)."""
    assert parse_arm(f"{router}_n4") == {"router.name": router, "model.num_experts": 4}
    assert arm_settings(f"{router}_n16") == (router, 16)
    assert parse_arm(f"{router}_n8_lr2e-3_eps0.5_bal1e-3_z1e-4") == {
        "router.name": router, "model.num_experts": 8, "optim.peak_lr": 2e-3,
        "router.jitter_eps": 0.5, "router.balance_weight": 1e-3, "router.z_loss_weight": 1e-4}
    arms = ["switch_n4_lr2e-3", f"{router}_n4_lr2e-3", "switch_n4", f"{router}_n4_eps0.5"]
    assert target_arm(f"{router}_n4_lr2e-3", arms) == "switch_n4_lr2e-3"
    assert target_arm(f"{router}_n4_eps0.5", arms) == "switch_n4"


def test_unknown_router_in_an_arm_is_refused():
    for bad in ("densmixer_n4", "default_n4", "default_moe_s_n4"):
        with pytest.raises(ValueError, match="unknown router"):
            parse_arm(bad)


def test_successors_study_arms_and_their_switch_target():
    arms = study_arms(["successors"], [4, 8])
    assert arms == ["switch_n4", "sparsemixer_n4", "densemixer_n4", "default_moe_n4",
                    "switch_n8", "sparsemixer_n8", "densemixer_n8", "default_moe_n8"]
    assert [arm_settings(a)[0] for a in arms[:4]] == ["switch", "sparsemixer", "densemixer",
                                                      "default_moe"]
    for arm in arms:
        n = arm_settings(arm)[1]
        assert target_arm(arm, arms) == f"switch_n{n}"
    # With the lr study, a rate arm meets Switch at that rate.
    assert target_arm("default_moe_n4_lr2e-3", [*arms, "switch_n4_lr2e-3"]) == "switch_n4_lr2e-3"


def test_compare_command_line_takes_the_successors_study_and_default_decay(tmp_path):
    """``--study successors`` and ``--override router.default_decay=0.99`` reach the config of a
    Default MoE run, which the config validation accepts (an out-of-range decay it refuses)."""
    from experiments import compare
    from sparsemixer_jax.tasks import check_config

    args = compare.parse_args(["--root", str(tmp_path), "--study", "successors", "--experts",
                               "4", "--override", "router.default_decay=0.99"])
    assert args.arms == ["switch_n4", "sparsemixer_n4", "densemixer_n4", "default_moe_n4"]
    config = runner.make_config("configs/multi30k_compare.py", "default_moe_st_n4_lr2e-3", 0,
                                None, args.override)
    assert (config.router.name, config.model.num_experts) == ("default_moe_st", 4)
    assert config.router.default_decay == 0.99 and config.optim.peak_lr == 2e-3
    check_config(config)
    config = runner.make_config("configs/multi30k_compare.py", "default_moe_n4", 0, None,
                                ["router.default_decay=1.0"])
    with pytest.raises(ValueError, match="default_decay"):
        check_config(config)
    with pytest.raises(SystemExit):
        compare.parse_args(["--root", str(tmp_path), "--arms", "densmixer_n4"])


def test_target_arm_prefers_switch_with_the_same_modifiers():
    arms = study_arms(["main", "lr", "ablations"], [4, 8])
    assert target_arm("sparsemixer_n4_lr2e-3", arms) == "switch_n4_lr2e-3"
    assert target_arm("sparsemixer_n8_eps0.5", arms) == "switch_n8"  # no Switch at 0.5
    assert target_arm("dense", arms) == "switch_n4"
    assert len(arms) == len(set(arms))
    with pytest.raises(ValueError, match="unknown study"):
        study_arms(["nope"], [4])


def test_make_config_applies_arm_modifiers_and_refuses_overriding_them():
    config = runner.make_config("configs/multi30k_compare.py", "sparsemixer_1st_n8_lr5e-4", 1,
                                 None, ["model.emb_dim=64"])
    assert (config.router.name, config.model.num_experts) == ("sparsemixer_1st", 8)
    assert config.optim.peak_lr == 5e-4 and config.model.emb_dim == 64 and config.seed == 1
    with pytest.raises(ValueError, match="set per run by the study"):
        runner.make_config("configs/multi30k_compare.py", "switch_n4_lr5e-4", 0, None,
                            ["optim.peak_lr=1e-3"])


def test_a_run_trains_its_configs_own_task(monkeypatch, tmp_path):
    """A study of pretraining (or any task of the loop) trains that task, not translation."""
    import sparsemixer_jax.tasks as tasks
    from sparsemixer_jax.tasks import pretraining

    trained = []
    monkeypatch.setattr(pretraining, "pretrain",
                        lambda config, workdir: trained.append((config.task, workdir)))
    options = runner.StudyOptions(config="configs/electra_smoke.py", root=str(tmp_path),
                                  arms=["switch_n4"], seeds=[3])
    runner.train_one(options, "switch_n4", 3)
    assert trained == [("pretraining", run_dir(str(tmp_path), "switch_n4", 3))]
    from configs import glue_smoke

    with pytest.raises(ValueError, match="not trained by the loop"):
        tasks.train_task(glue_smoke.get_config(), str(tmp_path / "glue"))


def test_norm_modifier_sets_normalize_top_k_as_a_switch():
    config = runner.make_config("configs/multi30k_compare.py", "switch_n8_eps0_norm1", 0, None)
    assert config.router.normalize_top_k is True and config.router.jitter_eps == 0.0
    with pytest.raises(ValueError, match="normalize_top_k is a switch"):
        runner.make_config("configs/multi30k_compare.py", "switch_n8_norm2", 0, None)


def _run(root, arm, seed, valid, finished=True, moe=True, results=None):
    """A run directory as train.py leaves it: config, metrics (with router metrics), results."""
    workdir = run_dir(str(root), arm, seed)
    os.makedirs(os.path.join(workdir, "checkpoints", "last"))
    router, n = arm_settings(arm)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump({"model": {"num_experts": n}, "router": {"name": router}}, f)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for i, loss in enumerate(valid, 1):
            record = {"step": 10 * i, "loss": loss + 0.1}
            if moe and n:
                record["moe"] = {"encoder/layer_0": {
                    "num_unmasked": 1.0 + i, "eligible_fraction": [0.5 / i, 1 - 0.5 / i],
                    "max_logit": float(i), "z_loss": 2.0, "load_max": 0.6, "load_min": 0.4,
                    "non_argmax_share": 0.1, "ref_mask_eligible": 1.5, "logit_mean": 0.0}}
            f.write(json.dumps(record) + "\n")
            f.write(json.dumps({"step": 10 * i, "valid_loss": loss}) + "\n")
    if finished:
        with open(os.path.join(workdir, "results.json"), "w") as f:
            json.dump(results or {"bleu": 1.0, "tokens_per_second": 10.0}, f)
    return workdir


def test_summary_from_compact_files_equals_summary_from_logs(tmp_path):
    root = tmp_path / "study"
    for seed in (0, 1):
        _run(root, "switch_n2", seed, [5.0, 4.0, 3.0 + 0.2 * seed])
        _run(root, "sparsemixer_n2", seed, [4.8, 3.5, 3.2])
    _run(root, "sparsemixer_n2", 2, [4.8], finished=False)
    arms = ["switch_n2", "sparsemixer_n2"]
    before = summarize(str(root), arms, [0, 1, 2])
    sm = before["arms"]["sparsemixer_n2"]
    assert sm["unfinished_seeds"] == [2] and sm["finished"] == 2
    assert sm["finished_seeds"] == [0, 1]  # the seeds the per-seed values belong to
    assert sm["paired_minus_target_arm"]["final_valid_loss"]["values"] == pytest.approx(
        [0.2, 0.0])
    # Paired at every validation step: 4.8 - 5.0 and 3.5 - 4.0 for both seeds, then the last.
    assert sm["paired_valid_loss_at"]["10"]["values"] == pytest.approx([-0.2, -0.2])
    assert sm["paired_valid_loss_at"]["30"]["values"] == pytest.approx([0.2, 0.0])
    assert "| sparsemixer_n2 − switch_n2 | -0.200 ± 0.000 (2/2) | -0.500 ± 0.000 (2/2) |" in \
        markdown(before)
    # Max load over mean load, mean over the logged steps: 0.6 x N = 1.2 at every step.
    assert sm["load_imbalance"]["mean"] == pytest.approx(1.2)
    assert "| sparsemixer_n2 | 1.20 ± 0.00 (n=2) |" in markdown(before)
    # Diagnostics at the last logged step (step 30: i = 3).
    assert sm["final_router"]["num_unmasked"]["mean"] == pytest.approx(4.0)
    assert sm["final_router"]["one_eligible_share"]["mean"] == pytest.approx(0.5 / 3)
    assert "one_eligible_share" in markdown(before)

    for seed in (0, 1):
        for arm in arms:
            runner.finish_run(run_dir(str(root), arm, seed), compact=True)
    workdir = run_dir(str(root), "switch_n2", 0)
    assert sorted(os.listdir(workdir)) == ["config.json", "curves.json", "results.json"]
    after = summarize(str(root), arms, [0, 1, 2])
    assert json.dumps(after, sort_keys=True) == json.dumps(before, sort_keys=True)
    plot_convergence(str(root), after, str(tmp_path / "curves.png"))
    plot_router(str(root), after, str(tmp_path / "router.png"))
    assert (tmp_path / "router.png").stat().st_size > 0


def test_language_model_study_reports_perplexities_not_bleu(tmp_path):
    arms = ["switch_n8_eps0", "sparsemixer_v2star_n8"]
    for seed, ppl in ((0, 100.0), (1, 120.0)):
        _run(tmp_path, arms[0], seed, [5.0, 4.7], results={"valid_ppl": ppl})
        _run(tmp_path, arms[1], seed, [5.0, 4.6], results={"valid_ppl": ppl - 5 - seed})
    summary = summarize(str(tmp_path), arms, [0, 1], versus=arms[0])
    paired = summary["arms"][arms[1]]["paired_minus_target_arm"]
    assert paired["valid_ppl"]["values"] == pytest.approx([-5.0, -6.0])
    table = markdown(summary)
    assert "valid ppl" in table and "BLEU" not in table
    assert "-5.50 ± 0.50 (2/2)" in table  # lower perplexity is better


def test_router_figure_is_not_written_for_runs_without_router_diagnostics(tmp_path):
    arms = ["switch_n8_eps0", "sparsemixer_v2star_n8"]
    for arm in arms:
        _run(tmp_path, arm, 0, [5.0, 4.7], moe=False, results={"valid_ppl": 100.0})
    plot_router(str(tmp_path), summarize(str(tmp_path), arms, [0]), str(tmp_path / "router.png"))
    assert not (tmp_path / "router.png").exists()


def test_pack_then_unpack_makes_runs_count_as_done(tmp_path):
    root = tmp_path / "first_launch"
    _run(root, "switch_n2", 0, [5.0, 4.0])
    _run(root, "sparsemixer_n2", 0, [5.0], finished=False)  # partial: not packed
    archive = str(tmp_path / "results.tar.gz")
    packed = runner.pack(str(root), ["switch_n2", "sparsemixer_n2"], [0], archive)
    assert packed == ["switch_n2_s0"]
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
        assert names == ["switch_n2_s0/config.json", "switch_n2_s0/curves.json",
                         "switch_n2_s0/results.json"]
        fresh = tmp_path / "second_launch"
        tar.extractall(fresh, filter="data")
    args = runner.StudyOptions(config="configs/multi30k_compare.py", root=str(fresh),
                               arms=["switch_n2", "sparsemixer_n2"], seeds=[0])
    assert runner.pending(args) == [("sparsemixer_n2", 0)]
    summary = summarize(str(fresh), args.arms, [0])
    assert summary["arms"]["switch_n2"]["final_valid_loss"]["mean"] == pytest.approx(4.0)


def test_run_pool_runs_every_job_with_the_memory_fraction(tmp_path):
    script = ("import os, sys; open(sys.argv[1], 'w').write("
              "os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION']); sys.exit(int(sys.argv[2]))")
    jobs = [(str(tmp_path / f"job{i}" / "train.log"),
             [sys.executable, "-c", script, str(tmp_path / f"out{i}"), str(i % 2)])
            for i in range(3)]
    codes = runner.run_pool(jobs, parallel=2, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.450"},
                             poll_s=0.01)
    assert sorted(codes.values()) == [0, 0, 1]
    assert [(tmp_path / f"out{i}").read_text() for i in range(3)] == ["0.450"] * 3
    # Past the launch deadline nothing starts.
    assert runner.run_pool(jobs, parallel=2, env={}, stop_after_s=-1.0, poll_s=0.01) == {}


def test_child_command_carries_the_run_settings(tmp_path):
    arms = study_arms(["lr"], [4])
    assert arms == ["switch_n4_lr5e-4", "sparsemixer_n4_lr5e-4", "switch_n4_lr2e-3",
                    "sparsemixer_n4_lr2e-3"]
    options = runner.StudyOptions(config="configs/multi30k_compare.py", root=str(tmp_path),
                                  arms=arms, seeds=[0, 1, 2], steps=7,
                                  override=["model.emb_dim=64"], parallel=2, compact=True)
    argv = runner.child_argv(options, "switch_n4_lr5e-4", 1)
    assert argv == [sys.executable, "-m", "experiments.compare", "--run-one", "switch_n4_lr5e-4",
                    "1", "--config", "configs/multi30k_compare.py", "--root", str(tmp_path),
                    "--steps", "7", "--override", "model.emb_dim=64", "--compact"]
    # The entry point the child runs takes each of these options.
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    usage = subprocess.run([sys.executable, "-m", "experiments.compare", "--help"], cwd=repo,
                           capture_output=True, text=True, timeout=300)
    assert usage.returncode == 0, usage.stderr[-2000:]
    for flag in (a for a in argv if a.startswith("--")):
        assert flag in usage.stdout, flag


def test_diagnostic_series_skips_steps_without_the_metric():
    moe = {10: {"a": {"max_logit": 1.0}, "b": {"max_logit": 3.0}}, 20: {"a": {}}}
    steps, values = diagnostic_series(moe, lambda m: m["max_logit"])
    assert steps.tolist() == [10] and np.asarray(values).tolist() == [[1.0, 3.0]]
