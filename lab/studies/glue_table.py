"""GLUE result tables: one run's summary over tasks, and runs side by side like the paper's Table 2.

Scores are percentages of the dev metric the paper reports (Table 2); AVG is the mean over the
tasks every row has (MNLI counts once, as the mean of -m and -mm, which reproduces the paper's
averages), so rows with different task sets are still compared on equal terms.
"""

from __future__ import annotations

from typing import Any

from sparsemixer_jax.data import glue
from sparsemixer_jax.tasks.finetuning import collect_results

# The paper's Table 2 column order.
COLUMNS = ("MNLI", "QQP", "QNLI", "SST-2", "CoLA", "RTE", "MRPC", "STS-B")
HEADINGS = {"MNLI": "MNLI-(m/mm) Acc.", "QQP": "QQP Acc.", "QNLI": "QNLI Acc.",
            "SST-2": "SST-2 Acc.", "CoLA": "CoLA Mat. Corr.", "RTE": "RTE Acc.",
            "MRPC": "MRPC Acc.", "STS-B": "STS-B Spear. Corr."}

# Liu, Gao & Chen (ICLR 2024), Table 2: GLUE dev results of ELECTRA-base-sized models, keyed by
# number of experts and model ("dense" for N = 1); MNLI is (matched, mismatched). "AVG" is as
# printed; tables recompute averages from the task scores (for N=4 Switch+SparseMixer they give
# 87.68, not the printed 87.63; the other rows agree to rounding).
PAPER_TABLE2: dict[tuple[int, str], dict[str, Any]] = {
    (1, "dense"): {"MNLI": (88.72, 88.40), "QQP": 91.90, "QNLI": 93.36, "SST-2": 93.35,
                   "CoLA": 68.71, "RTE": 82.31, "MRPC": 89.95, "STS-B": 90.83, "AVG": 87.37},
    (2, "switch"): {"MNLI": (88.55, 88.34), "QQP": 91.86, "QNLI": 93.52, "SST-2": 94.27,
                    "CoLA": 67.90, "RTE": 83.76, "MRPC": 90.69, "STS-B": 90.52, "AVG": 87.62},
    (2, "sparsemixer"): {"MNLI": (89.06, 88.78), "QQP": 91.98, "QNLI": 93.54, "SST-2": 94.38,
                         "CoLA": 69.96, "RTE": 85.20, "MRPC": 91.67, "STS-B": 90.81,
                         "AVG": 88.31},
    (4, "switch"): {"MNLI": (88.12, 88.40), "QQP": 91.73, "QNLI": 93.21, "SST-2": 93.92,
                    "CoLA": 70.89, "RTE": 77.26, "MRPC": 90.44, "STS-B": 90.49, "AVG": 87.02},
    (4, "sparsemixer"): {"MNLI": (88.97, 88.41), "QQP": 91.92, "QNLI": 93.54, "SST-2": 94.04,
                         "CoLA": 71.00, "RTE": 80.87, "MRPC": 90.69, "STS-B": 90.72,
                         "AVG": 87.63},
    (8, "switch"): {"MNLI": (88.43, 88.22), "QQP": 91.78, "QNLI": 93.23, "SST-2": 94.84,
                    "CoLA": 68.06, "RTE": 80.87, "MRPC": 90.44, "STS-B": 90.62, "AVG": 87.27},
    (8, "sparsemixer"): {"MNLI": (88.69, 88.47), "QQP": 92.03, "QNLI": 93.41, "SST-2": 94.15,
                         "CoLA": 69.00, "RTE": 83.76, "MRPC": 89.95, "STS-B": 90.81,
                         "AVG": 87.71},
}


def row_from_results(summary: dict[str, Any]) -> dict[str, Any]:
    """``{task: percentage}`` (MNLI: ``(m, mm)``) from a fine-tuning ``results.json`` summary."""
    row: dict[str, Any] = {}
    for name, result in summary["tasks"].items():
        spec = glue.TASKS[name]
        values = [100 * result["dev"][split][spec.score_metric] for split in spec.dev_splits]
        row[name] = tuple(values) if len(values) > 1 else values[0]
    return row


def paper_row(num_experts: int, model: str) -> dict[str, Any]:
    return {k: v for k, v in PAPER_TABLE2[(num_experts, model)].items() if k != "AVG"}


def task_value(value: Any) -> float:
    """The number a task adds to the average (MNLI: the mean of m and mm)."""
    return sum(value) / len(value) if isinstance(value, tuple) else float(value)


def average(row: dict[str, Any], tasks: list[str]) -> float:
    return sum(task_value(row[t]) for t in tasks) / len(tasks)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, tuple):
        return "/".join(f"{v:.2f}" for v in value)
    return f"{value:.2f}"


def comparison_table(rows: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Markdown and JSON of ``{label: row}`` side by side in Table 2's layout.

    Only tasks some row has are shown; AVG is over the tasks every row has.
    """
    shown = [t for t in COLUMNS if any(t in r for r in rows.values())]
    common = [t for t in COLUMNS if all(t in r for r in rows.values())]
    avg_heading = f"AVG ({len(common)} tasks)" if len(common) != len(COLUMNS) else "AVG"
    lines = [
        "| Model | " + " | ".join([avg_heading] + [HEADINGS[t] for t in shown]) + " |",
        "| --- " * (len(shown) + 2) + "|",
    ]
    table = {"columns": shown, "average_over": common, "rows": {}}
    for label, row in rows.items():
        avg = average(row, common) if common else None
        cells = [_cell(avg)] + [_cell(row.get(t)) for t in shown]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        table["rows"][label] = {"AVG": avg, **{t: row[t] for t in shown if t in row}}
    return "\n".join(lines) + "\n", table


def summary_table(summary: dict[str, Any]) -> str:
    """Markdown: per task, every standard dev metric (percent) and the winning grid point."""
    lines = ["| Task | Dev metrics | Best point | Epoch | Grid points |",
             "| --- | --- | --- | --- | --- |"]
    for name in glue.TASKS:
        if name not in summary["tasks"]:
            continue
        result = summary["tasks"][name]
        metrics = "; ".join(
            (f"{split}: " if len(result["dev"]) > 1 else "")
            + ", ".join(f"{m} {100 * v:.2f}" for m, v in values.items())
            for split, values in result["dev"].items()
        )
        p = result["best"]["point"]
        point = (f"lr {p['learning_rate']:g}, {p['epochs']} ep, bs {p['batch_size']}, "
                 f"wd {p['weight_decay']:g}, warm-up {p['warmup']:g}")
        lines.append(f"| {name} | {metrics} | {point} | {result['best']['epoch']} | "
                     f"{len(result['points'])}/{result['grid_size']} |")
    return "\n".join(lines) + "\n"


def load_summary(directory: str) -> dict[str, Any]:
    summary = collect_results(directory)
    if not summary["tasks"]:
        raise FileNotFoundError(f"no GLUE results (*/results.json) in {directory}")
    return summary


def paper_rows(num_experts: int) -> dict[str, dict[str, Any]]:
    """The paper's Table 2 rows for ``num_experts``, labelled: dense only for 1; dense, Switch
    and Switch+SparseMixer for 2, 4 or 8."""
    rows = {"paper: dense": paper_row(1, "dense")}
    for model in ("switch", "sparsemixer") if num_experts != 1 else ():
        rows[f"paper N={num_experts}: {model}"] = paper_row(num_experts, model)
    return rows


def report(runs: dict[str, dict[str, Any]],
           rows: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Markdown of each run's summary table and of ``rows`` side by side, and the JSON of the
    comparison (:func:`comparison_table`)."""
    markdown = ""
    for label, summary in runs.items():
        markdown += f"### {label}\n\n{summary_table(summary)}\n"
    comparison, table = comparison_table(rows)
    markdown += "### Comparison (dev, %)\n\n" + comparison
    return markdown, table
