"""Figures of a convergence study: loss curves per arm over seeds, and the routers' diagnostics."""

from __future__ import annotations

from typing import Any

import numpy as np

from lab.studies.arms import run_dir, run_state
from lab.studies.curves import plot_diagnostics, read_run, smooth


def plot_convergence(root: str, summary: dict[str, Any], out: str, window: int = 20) -> None:
    """Training (moving average) and validation loss against updates: mean over seeds, band
    from min to max; and the validation loss minus the target arm's, same seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_valid, ax_diff) = plt.subplots(1, 3, figsize=(16, 4.2))
    for i, arm in enumerate(summary["arms"]):
        color = f"C{i % 10}"
        style = "-" if i < 10 else "--"
        curves = [read_run(run_dir(root, arm, s)) for s in summary["seeds"]
                  if run_state(run_dir(root, arm, s)) == "finished"]
        for ax, kind in ((ax_train, "train"), (ax_valid, "valid")):
            pairs = [c[kind] for c in curves if len(c[kind][0])]
            if not pairs:
                continue
            length = min(len(p[0]) for p in pairs)  # the common prefix
            steps = pairs[0][0][:length]
            values = np.stack([p[1][:length] for p in pairs])
            if kind == "train":
                values = np.stack([smooth(v, window) for v in values])
            ax.plot(steps, values.mean(0), color=color, ls=style,
                    label=f"{arm} (n={len(pairs)})", marker="o" if kind == "valid" else None,
                    ms=3)
            ax.fill_between(steps, values.min(0), values.max(0), color=color, alpha=0.2)
        reference = summary["arms"][arm].get("target_arm")
        diffs = []
        for seed in summary["seeds"]:
            mine, other = run_dir(root, arm, seed), run_dir(root, reference or "", seed)
            if arm == reference or run_state(mine) != "finished" or \
                    run_state(other) != "finished":
                continue
            (s_a, v_a), (s_b, v_b) = read_run(mine)["valid"], read_run(other)["valid"]
            common = np.intersect1d(s_a, s_b)
            diffs.append((common, v_a[np.isin(s_a, common)] - v_b[np.isin(s_b, common)]))
        if diffs:
            length = min(len(d[0]) for d in diffs)
            values = np.stack([d[1][:length] for d in diffs])
            ax_diff.plot(diffs[0][0][:length], values.mean(0), color=color, ls=style,
                         marker="o", ms=3, label=f"{arm} − {reference} (n={len(diffs)})")
            ax_diff.fill_between(diffs[0][0][:length], values.min(0), values.max(0),
                                 color=color, alpha=0.2)
    ax_diff.axhline(0.0, color="k", lw=0.8)
    ax_diff.set_title("validation loss minus the target arm's, same seed")
    # A language model's runs report perplexities and train on plain cross entropy; the
    # translation model's on label-smoothed cross entropy.
    language_model = any(e.get("valid_ppl", {}).get("mean") is not None
                         for e in summary["arms"].values())
    ylabel = "cross entropy (nats)" if language_model else "label-smoothed cross entropy (nats)"
    ax_train.set_title(f"training loss (moving average, {window} updates)")
    ax_valid.set_title("validation loss (mean over seeds, band = min..max)")
    for ax in (ax_train, ax_valid, ax_diff):
        ax.set_xlabel("updates")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax_valid.set_ylim(top=min(ax_valid.get_ylim()[1], 7.0))
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def plot_router(root: str, summary: dict[str, Any], out: str) -> None:
    """The router diagnostics of every MoE arm (mean over seeds and layers)."""
    groups = {}
    for arm, entry in summary["arms"].items():
        if not entry["num_experts"]:
            continue
        runs = [read_run(run_dir(root, arm, s)) for s in summary["seeds"]
                if run_state(run_dir(root, arm, s)) == "finished"]
        if runs:
            groups[arm] = runs
    # Runs that log no router diagnostics (the language model's) would give empty panels.
    if any(summary["arms"][arm]["final_router"] for arm in groups):
        plot_diagnostics(groups, out)
    else:
        print(f"{out} not written: the runs log no router diagnostics")
