"""GLUE result tables: one run's summary over tasks, and runs side by side like the paper's Table 2.

    python -m experiments.glue_table --run runs/electra_n4/glue
    python -m experiments.glue_table --run dense=runs/electra_dense/glue \
        --run switch=runs/electra_switch_n4/glue --run sparsemixer=runs/electra_n4/glue \
        --paper 4 --out docs/glue_n4

Each ``--run`` is ``[LABEL=]DIR`` with ``DIR`` a fine-tuning workdir (its ``results.json``, or the
``{task}/results.json`` files in it). ``--out PREFIX`` writes ``PREFIX.md`` and ``PREFIX.json``.
Scores are percentages of the dev metric the paper reports (Table 2); AVG is the mean over the
tasks every row has (MNLI counts once, as the mean of -m and -mm, which reproduces the paper's
averages), so rows with different task sets are still compared on equal terms.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from lab.studies.glue_table import load_summary, paper_rows, report, row_from_results

flags.DEFINE_multi_string("run", None, "[LABEL=]DIR of a fine-tuning workdir; repeatable.")
flags.DEFINE_integer("paper", None, "Add the paper's Table 2 rows for this many experts "
                     "(1 = dense only; 2, 4, 8 add dense, Switch and Switch+SparseMixer).")
flags.DEFINE_string("out", None, "Write the tables to OUT.md and OUT.json.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    fl = flags.FLAGS
    runs = {}
    for spec in fl.run or []:
        label, _, directory = spec.rpartition("=")
        runs[label or os.path.basename(os.path.normpath(directory))] = load_summary(directory)
    rows = {label: row_from_results(s) for label, s in runs.items()}
    if fl.paper is not None:
        rows.update(paper_rows(fl.paper))
    if not rows:
        raise app.UsageError("give --run and/or --paper")
    markdown, table = report(runs, rows)
    print(markdown)
    if fl.out:
        os.makedirs(os.path.dirname(os.path.abspath(fl.out)), exist_ok=True)
        with open(fl.out + ".md", "w") as f:
            f.write(markdown)
        with open(fl.out + ".json", "w") as f:
            json.dump({"comparison": table, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
