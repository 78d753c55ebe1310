"""The committed study summaries rebuild from their committed runs.

Each ``docs/results/NAME_cpu.{json,md}`` that ships beside ``NAME_runs.tar.gz`` (the small files
of every finished run, ``experiments.compare --pack``) is rebuilt with the summariser that wrote
it (:func:`lab.studies.summary.summarize` and :func:`~lab.studies.summary.markdown`, as
``experiments.compare --summarize-only`` calls them) from the unpacked runs, with the arms,
seeds and target arm of the study's command, and must equal the committed files byte for byte.
The cross-balancing table ``lm_balancing_cpu.md`` and the scores study's ``lm_scores_cpu.md`` are
rebuilt from the rebuilt summaries. Every figure the docs quote from these files therefore
follows from the runs by the project's code.

The last tests rebuild figures that sentences of the docs state beyond the tables (which cells
separate at 2 standard errors, paired differences the tables do not print) from the committed
results, and find them in the pages' text.
"""

import json
import pathlib
import tarfile

import numpy as np
import pytest

from lab.router_bench import metrics
from lab.studies import chat_sft
from lab.studies.lm_balancing import (
    LM_BALANCINGS,
    LM_SCORES,
    SCORE_SEEDS,
    SEEDS,
    VERSUS,
    balancing_table,
    scores_table,
)
from lab.studies.summary import markdown, summarize

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"

# The arms and seeds of experiments/init_study.sh's phases.
_INIT_MAIN_ARMS = ("switch_n4", "sparsemixer_n4", "densemixer_n4", "default_moe_n4")
_INIT_PAIR = ("switch_n4", "sparsemixer_n4")
# The command of docs/lm.md's router study.
_LM_STUDY_ARMS = ("sparsemixer_v2star_n8", "sparsemixer_v2_n8", "switch_n8_eps0_norm1",
                  "densemixer_n8_eps0_norm1", "default_moe_n8_eps0_norm1")

#: Summary name (``NAME`` of ``NAME_cpu.json`` and ``NAME_runs.tar.gz``) -> the study's root
#: (as the summary records it), arms, seeds and ``--versus`` arm.
STUDIES: dict[str, tuple[str, tuple[str, ...], tuple[int, ...], str | None]] = {
    "init_study_main": ("runs/init_study/main", _INIT_MAIN_ARMS, (0, 1, 2, 3, 4), None),
    "init_study_long": ("runs/init_study/long", _INIT_PAIR, (0, 1, 2), None),
    **{f"init_study_split_{component}": (f"runs/init_study/split_{component}", _INIT_PAIR,
                                         (0, 1, 2), None)
       for component in ("router", "experts", "ffn")},
    **{f"lm_balancing_{balancing}": (f"runs/lm_balancing_{balancing}", arms, SEEDS, VERSUS)
       for balancing, (_, arms) in LM_BALANCINGS.items()},
    # The scores study's roots whose runs are finished and summarised.
    **{f"lm_scores_{routing}": (f"runs/lm_scores_{routing}", LM_SCORES[routing][1], SCORE_SEEDS,
                                LM_SCORES[routing][2])
       for routing in ("bias0.01", "sigbias0.01")},
    "lm_study": ("runs/lm_study", _LM_STUDY_ARMS, (0, 1, 2, 3, 4), VERSUS),
    "chat_sft_compare": (chat_sft.FT_ROOT, chat_sft.ARMS, chat_sft.SEEDS, chat_sft.VERSUS),
}


def _rebuild(name: str, workdir: pathlib.Path, monkeypatch) -> tuple[str, str]:
    """(JSON text, markdown) of the study ``name`` summarised from its unpacked runs, written as
    ``lab.studies.runner.summarize_and_write`` writes them."""
    root, arms, seeds, versus = STUDIES[name]
    (workdir / root).mkdir(parents=True)
    with tarfile.open(RESULTS / f"{name}_runs.tar.gz") as archive:
        archive.extractall(workdir / root, filter="data")
    monkeypatch.chdir(workdir)  # the summary records its root as given on the command line
    summary = summarize(root, list(arms), list(seeds), versus=versus)
    return json.dumps(summary, indent=1), markdown(summary)


#: Study summaries committed before runs were packed beside them: they cannot be rebuilt, and
#: the docs that quote them name the seeds behind each per-seed list. No new summary joins them.
SUMMARIES_WITHOUT_RUNS = {"convergence_multi30k_cpu", "router_study_cpu",
                          "successors_multi30k_cpu", "successors_multi30k_cpu_vs_eps0"}


def test_every_study_summary_ships_with_its_runs():
    """A study summary (a JSON with ``arms`` and ``seeds``, as ``experiments.compare`` writes
    it) in docs/results has its runs beside it, except the older ones named above."""
    summaries = {p.stem for p in RESULTS.glob("*.json")
                 if {"arms", "seeds"} <= set(json.loads(p.read_text()))}
    with_runs = {f"{name}_cpu" for name in STUDIES}
    assert summaries - with_runs == SUMMARIES_WITHOUT_RUNS


#: Studies whose finished runs are committed so that they resume on another machine, but whose
#: remaining runs have not finished: no summary may be written from them yet.
STUDIES_UNDER_WAY = {f"lm_scores_{routing}" for routing in LM_SCORES} - set(STUDIES)


def test_every_committed_run_archive_has_a_study():
    archives = {p.name.removesuffix("_runs.tar.gz") for p in RESULTS.glob("*_runs.tar.gz")}
    assert archives - STUDIES_UNDER_WAY == set(STUDIES)
    for name in archives:
        summaries = [(RESULTS / f"{name}_cpu.{ext}").exists() for ext in ("json", "md")]
        assert summaries == [name in STUDIES] * 2, name


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_summary_rebuilds_from_its_runs(name, tmp_path, monkeypatch):
    rebuilt_json, rebuilt_md = _rebuild(name, tmp_path, monkeypatch)
    assert rebuilt_json == (RESULTS / f"{name}_cpu.json").read_text(), (
        f"{name}_cpu.json differs from the summary of {name}_runs.tar.gz")
    assert rebuilt_md == (RESULTS / f"{name}_cpu.md").read_text(), (
        f"{name}_cpu.md differs from the summary of {name}_runs.tar.gz")


def test_the_balancing_table_rebuilds_from_the_runs(tmp_path, monkeypatch):
    summaries = {}
    for balancing in LM_BALANCINGS:
        rebuilt_json, _ = _rebuild(f"lm_balancing_{balancing}", tmp_path / balancing, monkeypatch)
        summaries[balancing] = json.loads(rebuilt_json)
    assert balancing_table(summaries) == (RESULTS / "lm_balancing_cpu.md").read_text()


def test_the_scores_table_rebuilds_from_the_runs(tmp_path, monkeypatch):
    summaries = {}
    for routing in LM_SCORES:
        if f"lm_scores_{routing}" in STUDIES:
            rebuilt_json, _ = _rebuild(f"lm_scores_{routing}", tmp_path / routing, monkeypatch)
            summaries[routing] = json.loads(rebuilt_json)
    assert scores_table(summaries) == (RESULTS / "lm_scores_cpu.md").read_text()


def test_the_chat_study_tables_rebuild_from_the_runs(tmp_path, monkeypatch):
    """docs/lm.md's chat fine-tuning tables: ``chat_sft summarize`` of the archived runs (their
    results and label accuracies) equals the committed ``chat_sft_cpu.json``, and ``chat_sft
    table`` of it the committed ``chat_sft_cpu.md``."""
    _rebuild("chat_sft_compare", tmp_path, monkeypatch)
    summary = chat_sft.summarize_root(chat_sft.FT_ROOT)
    assert json.dumps(summary, indent=2) + "\n" == (RESULTS / "chat_sft_cpu.json").read_text()
    assert chat_sft.study_table(summary) == (RESULTS / "chat_sft_cpu.md").read_text()


def test_a_changed_run_changes_the_summary(tmp_path, monkeypatch):
    """The comparison can fail: one run's final validation loss moved by 0.001 changes the
    rebuilt summary."""
    name = "init_study_long"
    root = STUDIES[name][0]
    _rebuild(name, tmp_path, monkeypatch)
    curves_path = tmp_path / root / "sparsemixer_n4_s1" / "curves.json"
    curves = json.loads(curves_path.read_text())
    curves["valid"][-1][1] += 1e-3  # [[step, loss], ...]: the last evaluation
    curves_path.write_text(json.dumps(curves))
    _, arms, seeds, versus = STUDIES[name]
    changed = summarize(root, list(arms), list(seeds), versus=versus)
    assert json.dumps(changed, indent=1) != (RESULTS / f"{name}_cpu.json").read_text()




# ------------------------------------------------------------------ the prose's own figures


def _prose(page: str) -> str:
    """A docs page as one line of text, with the typographic minus as ``-``, so that a figure
    the page breaks across lines or writes with ``−`` is found as :meth:`Paired.fmt` writes it."""
    return " ".join((REPO / "docs" / page).read_text().replace("−", "-").split())


def _paired(values: list[float], baseline: list[float]) -> tuple[str, float, int, int]:
    """``(mean ± SE as the docs write it, mean / SE, seeds below zero, seeds above)``."""
    d = metrics.paired(np.asarray(values, np.float64), np.asarray(baseline, np.float64))
    above = int(np.sum(np.asarray(values) > np.asarray(baseline)))
    return d.fmt(), d.mean / d.se, d.below, above


def test_the_router_benchmarks_balancing_prose_follows_its_data():
    """docs/router_bench.md's sentences about the balancing tables, rebuilt from the committed
    per-seed results (ln final eval MSE and load imbalance, paired by seed): which cells
    separate at 2 standard errors and the figures quoted for them."""
    arms = {**json.loads((RESULTS / "router_bench_balancing.json").read_text())["arms"],
            **json.loads((RESULTS / "router_bench_balancing_settings.json").read_text())["arms"]}
    ln_mse = {name: np.log(r["per_seed"]["final_eval_mse"]).tolist() for name, r in arms.items()}
    load = {name: r["per_seed"]["mean_load_imbalance"] for name, r in arms.items()}
    estimators = {1: ("switch", "sparsemixer", "densemixer", "default_moe"),
                  2: ("switch", "sparsemixer_v2", "sparsemixer_v2star", "densemixer",
                      "default_moe")}
    cells = [(k, n, e) for k in (2, 1) for n in (8, 16) for e in estimators[k]]
    text = _prose("router_bench.md")
    # Bias balancing against the micro-batch loss, same estimator: the cells it costs.
    costs = [c for c in cells if _paired(ln_mse["{2}_k{0}_n{1}_bias".format(*c)],
                                         ln_mse["{2}_k{0}_n{1}_mb".format(*c)])[1] >= 2]
    assert set(cells) - set(costs) == {(2, 8, "sparsemixer_v2"), (2, 8, "sparsemixer_v2star"),
                                       (2, 16, "sparsemixer_v2star")}
    assert f"beyond 2 SE in {len(costs)} of the {len(cells)} cells" in text
    # 8 micro-batches of 16 tokens against 2 of 64, same estimator (N = 8): who is hurt.
    hurt = {}
    for k, _, e in (c for c in cells if c[1] == 8):
        fmt, t, _, _ = _paired(ln_mse[f"{e}_k{k}_n8_mb8"], ln_mse[f"{e}_k{k}_n8_mb"])
        if abs(t) >= 2:
            hurt[(k, e)] = fmt
    assert set(hurt) == {(1, "sparsemixer"), (1, "densemixer"), (2, "densemixer"),
                         (1, "default_moe")}
    assert all(f"{fmt} " in text or f"{fmt})" in text for fmt in hurt.values()), hurt
    # ... and how far each estimator's gap to top-k moves (SparseMixer-v1 aside: 0.17).
    moved = {(k, e, b): abs(np.mean(ln_mse[f"{e}_k{k}_n8_{b}8"]) - np.mean(
        ln_mse[f"switch_k{k}_n8_{b}8"]) - np.mean(ln_mse[f"{e}_k{k}_n8_{b}"]) + np.mean(
        ln_mse[f"switch_k{k}_n8_{b}"])) for k, _, e in cells if e != "switch" for b in ("mb", "gb")}
    assert max(v for (_, e, _), v in moved.items() if e != "sparsemixer") < 0.04
    assert f"moves by {moved[(1, 'sparsemixer', 'mb')]:.2f}" in text
    # The global-batch loss's load with 8 micro-batches: within 0.01 but SparseMixer's at k = 1.
    far = {(k, e): _paired(load[f"{e}_k{k}_n8_gb8"], load[f"{e}_k{k}_n8_mb8"])[0]
           for k, _, e in cells if abs(np.mean(load[f"{e}_k{k}_n8_gb8"])
                                       - np.mean(load[f"{e}_k{k}_n8_mb8"])) >= 0.01}
    assert list(far) == [(1, "sparsemixer")] and f"{far[(1, 'sparsemixer')]}, beyond 2 SE" in text
    # SparseMixer-v2 and v2*'s gap to top-2 at bias rate 0.001 against the micro-batch loss's.
    for e in ("sparsemixer_v2", "sparsemixer_v2star"):
        gap = {b: np.subtract(ln_mse[f"{e}_k2_n8_{b}"], ln_mse[f"switch_k2_n8_{b}"]).tolist()
               for b in ("bias0.001", "mb")}
        assert f"{_paired(gap['bias0.001'], gap['mb'])[0]})" in text, e


def test_the_language_model_scores_prose_follows_its_data():
    """docs/router_bench.md on the LM scores study (softmax, bias 0.01): SparseMixer-v2* stays
    within 1.5 standard errors of top-2 at every validation, and both SparseMixers' load is more
    uneven than top-2's beyond 2 standard errors."""
    arms = json.loads((RESULTS / "lm_scores_bias0.01_cpu.json").read_text())["arms"]
    v2star = arms["sparsemixer_v2star_n8"]["paired_valid_loss_at"]
    assert max(abs(s["mean"]) / s["se"] for s in v2star.values()) < 1.5
    text = _prose("router_bench.md")
    assert f"grows to {v2star['600']['mean']:+.3f} at 600 updates, within 1.5 SE" in text
    top2 = arms[VERSUS]["load_imbalance"]["values"]
    for arm, seeds in (("sparsemixer_v2star_n8", 5), ("sparsemixer_v2_n8", 4)):
        fmt, t, _, higher = _paired(arms[arm]["load_imbalance"]["values"], top2)
        assert t >= 2 and higher == seeds and f"{fmt}" in text, (arm, fmt)


def test_the_chat_studys_routing_prose_follows_its_data():
    """docs/lm.md's routing sentence of the chat fine-tuning study, paired by seed from
    ``chat_sft_cpu.json``: v2 and v2* change more pairs than top-2, v2* alone leaves the busiest
    expert a larger share beyond 2 standard errors, frozen routers change fewer pairs."""
    summary = json.loads((RESULTS / "chat_sft_cpu.json").read_text())
    runs = summary["arms"]

    def paired(arm, key):
        seeds = sorted(runs[arm])
        return _paired([runs[arm][s][key] for s in seeds],
                       [runs[summary["versus"]][s][key] for s in seeds])

    text = _prose("lm.md")
    expected = {("sparsemixer_v2_n8", "churn"): (True, 5), ("sparsemixer_v2star_n8", "churn"):
                (True, 5), ("sparsemixer_v2star_n8", "max_share"): (True, 5),
                ("sparsemixer_v2_n8", "max_share"): (False, 4)}
    for (arm, key), (separates, higher) in expected.items():
        fmt, t, _, above = paired(arm, key)
        assert (t >= 2, above) == (separates, higher) and fmt.lstrip("+") in text, (arm, key)
    fmt, t, below, _ = paired("switch_n8_eps0_norm1_trainable0", "churn")
    assert t <= -2 and below == 5 and f"{fmt.lstrip('-')} fewer" in text
