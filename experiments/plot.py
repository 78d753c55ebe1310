"""Overlay training and validation loss curves of several runs against updates.

    python -m experiments.plot runs/switch runs/sparsemixer --out curves.png

Reads each run's ``metrics.jsonl``; the label is the directory name and the router.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def read_run(workdir: str) -> dict:
    """``{"label", "train": (steps, losses), "valid": (steps, losses)}`` of one workdir."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: is {workdir} a workdir of experiments.wmt?")
    train, valid = [], []
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
    label = os.path.basename(os.path.normpath(workdir))
    config_path = os.path.join(workdir, "config.json")
    if os.path.exists(config_path):
        with open(config_path) as f:
            config = json.load(f)
        experts = config["model"]["num_experts"]
        label += f" ({config['router']['name']}, N={experts})" if experts else " (dense)"
    return {"label": label, "train": _columns(train), "valid": _columns(valid)}


def _columns(pairs: list[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    if not pairs:
        return np.zeros(0), np.zeros(0)
    steps, values = zip(*sorted(pairs), strict=True)
    return np.asarray(steps), np.asarray(values)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (the first points average what is there)."""
    if window <= 1 or len(values) == 0:
        return values
    cumulative = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (cumulative[1:] - cumulative[np.arange(1, len(values) + 1) - counts]) / counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdirs", nargs="+")
    parser.add_argument("--out", default="curves.png")
    parser.add_argument("--smooth", type=int, default=20, help="moving-average window (steps)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    runs = [read_run(w) for w in args.workdirs]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        steps, losses = run["train"]
        ax_train.plot(steps, smooth(losses, args.smooth), label=run["label"])
        steps, losses = run["valid"]
        ax_valid.plot(steps, losses, marker="o", ms=3, label=run["label"])
    ax_train.set_title(f"training loss (moving average, {args.smooth} updates)")
    ax_valid.set_title("validation loss")
    for ax in (ax_train, ax_valid):
        ax.set_xlabel("updates")
        ax.set_ylabel("label-smoothed cross entropy (nats)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
