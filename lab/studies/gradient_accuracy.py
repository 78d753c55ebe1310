"""The exact-gradient accuracy experiment's printed tables and figure
(:func:`lab.exact_experiment.accuracy_experiment` computes the results)."""

from __future__ import annotations


def _print_estimators(estimators: dict, scales: list) -> None:
    shown = [0, len(scales) // 2, len(scales) - 1]
    head = "".join(f"  relerr0@{scales[i]:.0e}" for i in shown)
    print(f"{'estimator':24s}{head}  slope(nabla0)  slope(full)  cos0@s=1  cosF@s=1")
    for name, e in estimators.items():
        errs = "".join(f"  {e['relerr_nabla0'][i]:>14.2e}" for i in shown)
        print(
            f"{name:24s}{errs}  {e['slope_nabla0']:5.2f} ± {e['slope_nabla0_std']:.2f}"
            f"  {e['slope_full']:5.2f} ± {e['slope_full_std']:.2f}"
            f"  {e['cos_nabla0'][0]:8.5f}  {e['cos_full'][0]:8.5f}   {e['note']}"
        )


def _tables(results: dict) -> list[tuple[str, dict]]:
    """The tables of nabla_0 and full-gradient errors: top-1, and under sigmoid scores each
    top-k too."""
    return [("top-1", results["estimators"])] + [
        (f"top-{k}", table) for k, table in results.get("sigmoid_topk", {}).items()]


def print_table(results: dict) -> None:
    scales = results["scales"]
    for title, estimators in _tables(results):
        if len(_tables(results)) > 1:
            print(f"\n{title} under sigmoid scores, against the exact {title} gradient")
        _print_estimators(estimators, scales)
    print(
        f"(relative errors: geometric mean over {results['settings']['num_problems']} problems;"
        f" slopes: mean ± std over problems, fitted on scales {results['fit_scales'][0]:.0e}"
        f"..{results['fit_scales'][-1]:.0e}; Default MoE's noisy defaults: noise"
        f" {results['settings'].get('default_noise', 0.0)})"
    )
    lo = scales[-1]
    for k, table in results.get("topk", {}).items():
        print(f"\ntop-{k}: against the exact top-{k} gradient (norm ratio, cosine: mean"
              f" [± std] over problems; bias = relative error, geometric mean)")
        print(f"{'estimator':22s}  norm@s=1  norm@s={lo:.0e}        cos@s=1  cos@s={lo:.0e}"
              f"  bias@s=1  bias@s={lo:.0e}  slope(bias)")
        for name, e in table.items():
            print(
                f"{name:22s}  {e['norm_ratio'][0]:8.3f}  {e['norm_ratio'][-1]:6.3f} ± "
                f"{e['norm_ratio_std'][-1]:.3f}  {e['cos'][0]:8.4f}  {e['cos'][-1]:10.4f}"
                f"  {e['relerr'][0]:8.2e}  {e['relerr'][-1]:10.2e}  {e['slope']:5.2f} ± "
                f"{e['slope_std']:.2f}"
            )


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = _tables(results)
    fig, grid = plt.subplots(len(tables), 2, figsize=(11, 4.2 * len(tables)), sharex=True,
                             squeeze=False)
    panels = [
        (row[0], "nabla0", rf"{label}: $\nabla_0$ part vs exact $\nabla_0$", estimators)
        for row, (label, estimators) in zip(grid, tables, strict=True)
    ] + [
        (row[1], "full", rf"{label}: full estimate vs exact $\nabla_0 + \nabla_1$", estimators)
        for row, (label, estimators) in zip(grid, tables, strict=True)
    ]
    for ax, term, title, estimators in panels:
        if len(tables) == 1:
            title = title.split(": ", 1)[1]
        for name, e in estimators.items():
            if name == "switch" and term == "nabla0":
                continue  # relative error 1 at every scale: nabla_0 is dropped
            ax.loglog(
                results["scales"],
                e[f"relerr_{term}"],
                marker="o",
                ms=3,
                ls=":" if name.startswith(("densemixer", "default_moe")) else "-",
                label=f"{name} (slope {e[f'slope_{term}']:.2f})",
            )
        ax.set_title(title)
        ax.set_xlabel("expert output scale s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for row in grid:
        row[0].set_ylabel("relative error (geometric mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
