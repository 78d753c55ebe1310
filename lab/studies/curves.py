"""Loss curves and router diagnostics of training runs: reading them, keeping them compact,
drawing them against updates.

A run's curves come from its ``metrics.jsonl`` or, for a run of a study whose log was not kept,
its compact ``curves.json`` (:func:`write_curves`); the label is the directory name and the
router. The diagnostics figure shows, per run, the mean over its MoE layers (band: the layers'
min to max) of the router diagnostics logged at ``log_every``
(:mod:`sparsemixer_jax.router_diagnostics`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np

CURVES = "curves.json"  # the compact copy of a run's curves that a study keeps


def _read_metrics_log(path: str) -> tuple[list, list, dict]:
    train, valid, moe = [], [], {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise SystemExit(f"{path}:{number}: not JSON ({err})") from None
            if "valid_loss" in record:
                valid.append((record["step"], record["valid_loss"]))
            elif "loss" in record and "error" not in record:
                train.append((record["step"], record["loss"]))
                if "moe" in record:
                    moe[record["step"]] = record["moe"]
    return train, valid, moe


def read_run(workdir: str) -> dict:
    """``{"label", "train": (steps, losses), "valid": (steps, losses), "moe": {step: {layer:
    {metric: value}}}}`` of one workdir, from ``metrics.jsonl`` or else ``curves.json``."""
    path = os.path.join(workdir, "metrics.jsonl")
    compact = os.path.join(workdir, CURVES)
    if os.path.exists(path):
        train, valid, moe = _read_metrics_log(path)
    elif os.path.exists(compact):
        with open(compact) as f:
            data = json.load(f)
        train, valid = data["train"], data["valid"]
        moe = {int(step): layers for step, layers in data["moe"].items()}
    else:
        raise SystemExit(f"{path} not found: is {workdir} a workdir of experiments.wmt?")
    label = os.path.basename(os.path.normpath(workdir))
    config_path = os.path.join(workdir, "config.json")
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = json.load(f)
        experts = config["model"]["num_experts"]
        label += f" ({config['router']['name']}, N={experts})" if experts else " (dense)"
    return {"label": label, "train": _columns(train), "valid": _columns(valid), "moe": moe}


def write_curves(workdir: str) -> str:
    """Writes ``curves.json``: the training and validation curves and the MoE metrics at the
    logged steps, all a study's summary needs once checkpoints and logs are gone."""
    run = read_run(workdir)
    data = {"train": np.column_stack(run["train"]).tolist() if len(run["train"][0]) else [],
            "valid": np.column_stack(run["valid"]).tolist() if len(run["valid"][0]) else [],
            "moe": {str(step): layers for step, layers in sorted(run["moe"].items())}}
    path = os.path.join(workdir, CURVES)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(path + ".tmp", path)
    return path


def _columns(pairs: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    if not len(pairs):
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*sorted((int(s), v) for s, v in pairs), strict=True)
    return np.asarray(steps), np.asarray(values)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (the first points average what is there)."""
    if window <= 1 or len(values) == 0:
        return values
    cumulative = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (cumulative[1:] - cumulative[np.arange(1, len(values) + 1) - counts]) / counts


# ------------------------------------------------------------------------- router diagnostics

#: (title, function of one layer's logged metrics -> float), one panel each.
DIAGNOSTICS = (
    ("share of tokens with 1 eligible expert", lambda m: m["eligible_fraction"][0]),
    ("mean eligible experts (num_unmasked)", lambda m: m["num_unmasked"]),
    ("eligible under the reference mask", lambda m: m["ref_mask_eligible"]),
    ("mean max router logit", lambda m: m["max_logit"]),
    ("mean router logit (the common shift)", lambda m: m["logit_mean"]),
    ("router z-loss", lambda m: m["z_loss"]),
    ("largest expert share", lambda m: m["load_max"]),
    ("smallest expert share", lambda m: m["load_min"]),
    ("share routed to a non-argmax expert", lambda m: m["non_argmax_share"]),
)


def diagnostic_series(moe: dict, metric) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values [steps, layers])`` of ``metric(layer_metrics)`` over a run's logged
    steps; steps without the metric (older runs) are left out."""
    steps, rows = [], []
    for step in sorted(moe):
        try:
            rows.append([float(metric(m)) for _, m in sorted(moe[step].items())])
        except (KeyError, IndexError, TypeError):
            continue
        steps.append(step)
    if not rows:
        return np.zeros(0), np.zeros((0, 0))
    return np.asarray(steps), np.asarray(rows)


def plot_diagnostics(runs: dict[str, list[dict]], out: str) -> None:
    """One panel per diagnostic; one line per label: the mean over its runs and MoE layers, band
    from the smallest to the largest layer value (of any of its runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = -(-len(DIAGNOSTICS) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.2 * rows))
    for ax, (title, metric) in zip(axes.flat, DIAGNOSTICS, strict=False):
        for i, (label, group) in enumerate(runs.items()):
            series = [diagnostic_series(run["moe"], metric) for run in group]
            series = [s for s in series if len(s[0])]
            if not series:
                continue
            length = min(len(s[0]) for s in series)
            steps = series[0][0][:length]
            values = np.concatenate([s[1][:length] for s in series], axis=1)  # [steps, layers]
            ax.plot(steps, values.mean(1), color=f"C{i}", label=label)
            ax.fill_between(steps, values.min(1), values.max(1), color=f"C{i}", alpha=0.15)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("updates", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(DIAGNOSTICS):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=64)  # nine panels: small enough to keep in docs/
    plt.close(fig)


def plot_losses(runs: Sequence[dict], out: str, window: int = 20) -> None:
    """Training loss (trailing moving average over ``window`` updates) and validation loss of
    each run (:func:`read_run`), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        steps, losses = run["train"]
        ax_train.plot(steps, smooth(losses, window), label=run["label"])
        steps, losses = run["valid"]
        ax_valid.plot(steps, losses, marker="o", ms=3, label=run["label"])
    ax_train.set_title(f"training loss (moving average, {window} updates)")
    ax_valid.set_title("validation loss")
    for ax in (ax_train, ax_valid):
        ax.set_xlabel("updates")
        ax.set_ylabel("label-smoothed cross entropy (nats)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
