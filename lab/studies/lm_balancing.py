"""The language-model half of the balancing study: the small LM of ``configs/lm_study.py``
(Mixtral-style, N = 8, top-2) under each balancing, one study root per balancing.

Every balancing trains with 4 micro-batches of 4 sequences per update (the update's 16
sequences unchanged), so that the global-batch loss counts more tokens than the micro-batch
loss and the balancings differ in the balancing only. The arms are those of
``configs/lm_study.py``; bias balancing leaves out SparseMixer-v2 and v2* (the router's config
refused the pair when the study was run; it takes them now).

    python -c "from lab.studies.lm_balancing import commands; print(*commands(), sep='\\n')"

and, once a root's runs are finished, :func:`summary_command` summarises it into docs/results.

The scores study (:data:`LM_SCORES`) trains every estimator, SparseMixer included, for 5 seeds
under bias balancing with softmax scores and with sigmoid scores, each root from
:func:`scores_command` and summarised by :func:`scores_summary_command`.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import numpy as np

from lab.router_bench.metrics import Paired, mean_se, paired

CONFIG = "configs/lm_study.py"
SEEDS = (0, 1, 2)
VERSUS = "switch_n8_eps0_norm1"
SWITCH_FORWARD_ARMS = ("switch_n8_eps0_norm1", "densemixer_n8_eps0_norm1",
                       "default_moe_n8_eps0_norm1")
SPARSEMIXER_ARMS = ("sparsemixer_v2star_n8", "sparsemixer_v2_n8")
MICRO_BATCHES = ("data.micro_batch_size=4",)

BIAS_UPDATE_RATE = 0.001
"""Megatron-Core's default ``moe_router_bias_update_rate`` (DeepSeek-V3's rate)."""
FAST_BIAS_UPDATE_RATE = 0.01
"""Ten times that: at most 6 in a 600-update run, where 0.001 moves a bias 0.6 at most."""

ALL_ARMS = SPARSEMIXER_ARMS + SWITCH_FORWARD_ARMS

LM_BALANCINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "mb": (MICRO_BATCHES, ALL_ARMS),
    "gb": ((*MICRO_BATCHES, "router.balance_scope=global_batch"), ALL_ARMS),
    "bias": ((*MICRO_BATCHES, "router.balance_weight=0.0",
              f"router.bias_update_rate={BIAS_UPDATE_RATE}"), SWITCH_FORWARD_ARMS),
    "bias0.01": ((*MICRO_BATCHES, "router.balance_weight=0.0",
                  f"router.bias_update_rate={FAST_BIAS_UPDATE_RATE}"), SWITCH_FORWARD_ARMS),
    "none": ((*MICRO_BATCHES, "router.balance_weight=0.0"), ALL_ARMS),
}
"""Balancing -> (the ``--override`` of every run, the arms that compose with it)."""


SCORE_SEEDS = (0, 1, 2, 3, 4)
"""The scores study's seeds: five, so that a difference can separate (docs/science.md)."""
SIGMOID_VERSUS = "switch_n8_eps0"
SIGMOID_ARMS = (*SPARSEMIXER_ARMS, SIGMOID_VERSUS, "densemixer_n8_eps0", "default_moe_n8_eps0")
"""Under sigmoid scores the gates are always renormalised over the chosen experts, so the
Switch-forward arms drop ``_norm1`` (the config refuses it as implied)."""
BIAS_FAST = (*MICRO_BATCHES, "router.balance_weight=0.0",
             f"router.bias_update_rate={FAST_BIAS_UPDATE_RATE}")

LM_SCORES: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "bias0.01": (BIAS_FAST, ALL_ARMS, VERSUS),
    "sigbias0.01": ((*BIAS_FAST, "router.score=sigmoid"), SIGMOID_ARMS, SIGMOID_VERSUS),
}
"""The scores study (5 seeds, every estimator, SparseMixer included): bias balancing at rate
0.01 and no loss, with softmax scores and with sigmoid scores (DeepSeek-V3's routing). Root ->
(the ``--override`` of every run, the arms, the arm each is compared with)."""


def _compare(root: str, overrides: tuple[str, ...], arms: tuple[str, ...], versus: str,
             seeds: tuple[int, ...]) -> str:
    return (f"python -m experiments.compare --config {CONFIG} --root runs/{root} "
            f"--arms {' '.join(arms)} --versus {versus} --seeds {' '.join(map(str, seeds))} "
            + " ".join(f"--override {o}" for o in overrides)
            + " --parallel 2 --compact --no-dense")


def command(balancing: str) -> str:
    """The ``experiments.compare`` command of one balancing's study root."""
    overrides, arms = LM_BALANCINGS[balancing]
    return _compare(f"lm_balancing_{balancing}", overrides, arms, VERSUS, SEEDS)


def scores_command(routing: str) -> str:
    """The ``experiments.compare`` command of one root of the scores study
    (:data:`LM_SCORES`)."""
    overrides, arms, versus = LM_SCORES[routing]
    return _compare(f"lm_scores_{routing}", overrides, arms, versus, SCORE_SEEDS)


def commands() -> list[str]:
    """One command per balancing, in :data:`LM_BALANCINGS`' order."""
    return [command(b) for b in LM_BALANCINGS]


def _summarize(study_command: str, name: str) -> str:
    out = f"docs/results/{name}"
    return (study_command.replace(" --parallel 2 --compact", "")
            + f" --summarize-only --out-json {out}_cpu.json --out-md {out}_cpu.md"
            f" --plot {out}_cpu.png --plot-router {out}_router_cpu.png"
            f" --pack {out}_runs.tar.gz")


def summary_command(balancing: str) -> str:
    """The command that summarises one balancing's finished root into ``docs/results``
    (``lm_balancing_{balancing}_cpu.{json,md,png}``, the router figure, the runs' small files)."""
    return _summarize(command(balancing), f"lm_balancing_{balancing}")


def scores_summary_command(routing: str) -> str:
    """:func:`summary_command` for a root of the scores study (``lm_scores_{routing}_cpu.*``)."""
    return _summarize(scores_command(routing), f"lm_scores_{routing}")


BALANCING_TITLES = {"mb": "micro-batch loss", "gb": "global-batch loss",
                    "bias": "bias (0.001), no loss", "bias0.01": "bias (0.01), no loss",
                    "none": "none"}


def _by_seed(summary: dict, arm: str, key: str) -> dict[int, float]:
    """One arm's per-seed values of ``key`` in a study summary (``experiments.compare
    --out-json``: the values of its finished seeds, in order), by seed; seeds without a finite
    value left out."""
    entry = summary["arms"].get(arm)
    if entry is None or key not in entry:
        return {}
    return {seed: v for seed, v in zip(entry["finished_seeds"], entry[key]["values"], strict=True)
            if v is not None and math.isfinite(v)}


def paired_by_seed(arm: dict[int, float], other: dict[int, float]) -> Paired | None:
    """``arm - other`` over the seeds both have (:func:`lab.router_bench.metrics.paired`);
    ``None`` without two common seeds."""
    seeds = sorted(set(arm) & set(other))
    if len(seeds) < 2:
        return None
    return paired(np.array([arm[s] for s in seeds]), np.array([other[s] for s in seeds]))


def _paired_cell(stat: Paired | None) -> str:
    """``−0.083 ± 0.013 (3/3)``, bold where the mean is beyond 2 standard errors from 0."""
    if stat is None:
        return "–"
    text = stat.fmt().replace("-", "−")
    if abs(stat.mean) > 2 * stat.se:
        text = f"**{text}**"
    return f"{text} ({stat.below}/{stat.n})"


def _mean_se_cell(values: dict[int, float], digits: int, seeds: int = len(SEEDS)) -> str:
    """``mean ± SE`` of the values, their count added where it is not ``seeds``."""
    if not values:
        return "–"
    mean, se = mean_se(np.array(list(values.values())))
    n = f" (n={len(values)})" if len(values) != seeds else ""
    return f"{mean:.{digits}f}" + (f" ± {se:.{digits}f}" if len(values) > 1 else "") + n


def balancing_table(summaries: dict[str, dict]) -> str:
    """The study's answer across balancings, as markdown, from each balancing's summary
    (balancing name of :data:`LM_BALANCINGS` -> the summary JSON of its root).

    Four tables, one row per estimator, one column per balancing: the final validation loss
    (ln validation perplexity) minus top-2's under the same balancing, paired by seed; minus
    the same estimator's under the micro-batch loss; the load imbalance over training; the
    training tokens per second. A pair the router's config refuses reads "refused"."""
    shown = [b for b in LM_BALANCINGS if b in summaries]

    def table(columns: list[str], cell) -> list[str]:
        out = ["| estimator | " + " | ".join(BALANCING_TITLES[b] for b in columns) + " |",
               "| --- |" + " --- |" * len(columns)]
        for arm in ALL_ARMS:
            cells = [cell(b, arm) if arm in LM_BALANCINGS[b][1] else "refused" for b in columns]
            out.append(f"| {arm} | " + " | ".join(cells) + " |")
        return out

    def loss(b: str, arm: str) -> dict[int, float]:
        return _by_seed(summaries[b], arm, "final_valid_loss")

    lines = ["Final validation loss minus top-2's (`" + VERSUS + "`) under the same balancing, "
             "same seed: mean ± standard error (seeds where the estimator is lower / seeds); "
             "bold beyond 2 standard errors.", ""]
    lines += table(shown, lambda b, arm: "" if arm == VERSUS
                   else _paired_cell(paired_by_seed(loss(b, arm), loss(b, VERSUS))))
    others = [b for b in shown if b != "mb"]
    if "mb" in summaries and others:
        lines += ["", "Final validation loss minus the same estimator's under the micro-batch "
                  "loss, same seed.", ""]
        lines += table(others, lambda b, arm: _paired_cell(
            paired_by_seed(loss(b, arm), loss("mb", arm))))
    lines += ["", "Load imbalance over training (max load / mean load): mean ± standard error "
              "over seeds.", ""]
    lines += table(shown, lambda b, arm: _mean_se_cell(
        _by_seed(summaries[b], arm, "load_imbalance"), 2))
    lines += ["", "Training tokens per second, each run's median over its steps (compilation and "
              "evaluations left out): mean ± standard error over seeds.", ""]
    lines += table(shown, lambda b, arm: _mean_se_cell(
        _by_seed(summaries[b], arm, "tokens_per_second_median_step"), 0))
    return "\n".join(lines) + "\n"


SCORES_TITLES = {"bias0.01": "softmax scores", "sigbias0.01": "sigmoid scores"}
ESTIMATORS = ("SparseMixer-v2*", "SparseMixer-v2", "top-2", "DenseMixer", "Default MoE")
"""The estimator of each arm, in the order of :data:`ALL_ARMS` and :data:`SIGMOID_ARMS`."""


def scores_table(summaries: dict[str, dict]) -> str:
    """The scores study's answer as markdown, from each root's summary (routing name of
    :data:`LM_SCORES` -> the summary JSON of its root): one row per estimator, one column per
    routing. Four tables: the final validation loss minus top-2's under the same routing,
    paired by seed; the sigmoid root's loss minus the softmax root's for the same estimator,
    paired by seed; the load imbalance over training; the training tokens per second."""
    shown = [r for r in LM_SCORES if r in summaries]

    def arm(routing: str, estimator: str) -> str:
        return LM_SCORES[routing][1][ESTIMATORS.index(estimator)]

    def loss(routing: str, estimator: str) -> dict[int, float]:
        return _by_seed(summaries[routing], arm(routing, estimator), "final_valid_loss")

    def table(columns: list[str], cell) -> list[str]:
        out = ["| estimator | " + " | ".join(SCORES_TITLES[r] for r in columns) + " |",
               "| --- |" + " --- |" * len(columns)]
        for estimator in ESTIMATORS:
            out.append(f"| {estimator} | " + " | ".join(cell(r, estimator) for r in columns)
                       + " |")
        return out

    lines = ["Final validation loss minus top-2's under the same routing (bias balancing at "
             f"rate {FAST_BIAS_UPDATE_RATE}, no balancing loss), same seed: mean ± standard "
             "error (seeds where the estimator is lower / seeds); bold beyond 2 standard "
             "errors.", ""]
    lines += table(shown, lambda r, e: "" if e == "top-2"
                   else _paired_cell(paired_by_seed(loss(r, e), loss(r, "top-2"))))
    if len(shown) == 2:
        softmax, sigmoid = shown
        lines += ["", "Final validation loss under sigmoid scores minus the same estimator's "
                  "under softmax scores, same seed.", ""]
        lines += table([sigmoid], lambda r, e: _paired_cell(
            paired_by_seed(loss(sigmoid, e), loss(softmax, e))))
    lines += ["", "Load imbalance over training (max load / mean load): mean ± standard error "
              "over seeds.", ""]
    lines += table(shown, lambda r, e: _mean_se_cell(
        _by_seed(summaries[r], arm(r, e), "load_imbalance"), 2, len(SCORE_SEEDS)))
    lines += ["", "Training tokens per second, each run's median over its steps (compilation and "
              "evaluations left out): mean ± standard error over seeds.", ""]
    lines += table(shown, lambda r, e: _mean_se_cell(
        _by_seed(summaries[r], arm(r, e), "tokens_per_second_median_step"), 0,
        len(SCORE_SEEDS)))
    return "\n".join(lines) + "\n"


def _summaries(results: pathlib.Path, prefix: str, roots) -> dict[str, dict]:
    """Root name -> its summary ``{prefix}{root}_cpu.json`` in ``results``, where it exists."""
    paths = {root: results / f"{prefix}{root}_cpu.json" for root in roots}
    return {root: json.loads(path.read_text()) for root, path in paths.items() if path.exists()}


def main(argv: list[str] | None = None) -> None:
    """``python -m lab.studies.lm_balancing``: :func:`balancing_table` of the summaries in
    ``docs/results`` (``lm_balancing_{balancing}_cpu.json``; balancings not summarised yet are
    left out), printed and written to ``docs/results/lm_balancing_cpu.md``; and, where the
    scores study's roots are summarised (``lm_scores_{routing}_cpu.json``), its
    :func:`scores_table` to ``docs/results/lm_scores_cpu.md``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--results", default="docs/results", help="folder of the summaries")
    parser.add_argument("--out-md", default="docs/results/lm_balancing_cpu.md")
    parser.add_argument("--out-scores-md", default="docs/results/lm_scores_cpu.md")
    args = parser.parse_args(argv)
    results = pathlib.Path(args.results)
    balancings = _summaries(results, "lm_balancing_", LM_BALANCINGS)
    if not balancings:
        raise SystemExit(f"error: no lm_balancing_*_cpu.json in {args.results}; summarise a "
                         "root first (summary_command)")
    table = balancing_table(balancings)
    print(table, end="")
    pathlib.Path(args.out_md).write_text(table)
    scores = _summaries(results, "lm_scores_", LM_SCORES)
    if scores:
        table = scores_table(scores)
        print("\n" + table, end="")
        pathlib.Path(args.out_scores_md).write_text(table)


if __name__ == "__main__":
    main()
