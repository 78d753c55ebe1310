"""The committed study summaries rebuild from their committed runs.

Each ``docs/results/NAME_cpu.{json,md}`` that ships beside ``NAME_runs.tar.gz`` (the small files
of every finished run, ``experiments.compare --pack``) is rebuilt with the summariser that wrote
it (:func:`lab.studies.summary.summarize` and :func:`~lab.studies.summary.markdown`, as
``experiments.compare --summarize-only`` calls them) from the unpacked runs, with the arms,
seeds and target arm of the study's command, and must equal the committed files byte for byte.
The cross-balancing table ``lm_balancing_cpu.md`` and the scores study's ``lm_scores_cpu.md`` are
rebuilt from the rebuilt summaries. Every figure the docs quote from these files therefore
follows from the runs by the project's code.
"""

import json
import pathlib
import tarfile

import pytest

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


