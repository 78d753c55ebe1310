"""The benchmark's JSON as markdown tables (what docs/benchmarks.md shows)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _ms(stat: dict[str, Any]) -> str:
    def one(seconds: float) -> str:
        ms = seconds * 1e3
        return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"

    return f"{one(stat['median'])} [{one(stat['min'])}, {one(stat['max'])}]"


def _load(pair: Sequence[float | None] | None) -> str:
    return "–" if not pair else " → ".join("?" if v is None else f"{v:.1f}" for v in pair)


def _spread(stat: dict[str, Any] | None) -> str:
    return "–" if stat is None else f"{stat['median']:.3f} [{stat['min']:.3f}, {stat['max']:.3f}]"


def _to_switch_table(section: dict[str, Any], unit: str) -> list[str]:
    """Rows ``N, router`` of a section with ``to_switch`` entries (``harness.ratios_to``)."""
    lines = [f"| N | router | {unit} | ratio to Switch (medians) | paired ratios: median "
             "[min, max] | paired CPU-time ratios | FLOP ratio | load avg |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, o in section.items():
        for router, r in o["to_switch"].items():
            ref = router == "switch"
            flop = "–" if r.get("flop_ratio") is None else f"{r['flop_ratio']:.3f}"
            lines.append(f"| {n} | {router} | {_ms(r['time'])} | {r['ratio']:.3f} | "
                         f"{'–' if ref else _spread(r['paired_ratio'])} | "
                         f"{'–' if ref else _spread(r.get('paired_cpu_ratio'))} | {flop} | "
                         f"{_load(o['load_average'])} |")
    return [*lines, ""]


def _lm_table(lm: dict[str, Any]) -> list[str]:
    """The ``lm_throughput`` section: one row per arm, top-2 the reference of the ratios."""
    arms = [k for k, v in lm.items() if isinstance(v, dict) and "to_top2" in v]
    lines = ["| arm | params (active) | model MFLOP/token | ms/step | tokens/s [range] "
             "| step time / top2 (medians) | paired ratios: median [min, max] "
             "| paired CPU-time ratios | MFU | load avg |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in arms:
        a, r = lm[name], lm[name]["to_top2"]
        ref = name == "top2"
        lo, hi = a["tokens_per_s_range"]
        mfu = "–" if a["mfu"] is None else f"{a['mfu']:.1%}"
        lines.append(f"| {name} | {a['num_params']:,} ({a['active_params']:,}) | "
                     f"{a['model_flops_per_token']['total']/1e6:.4g} | {_ms(a['step_s'])} | "
                     f"{a['tokens_per_s']:.0f} [{lo:.0f}, {hi:.0f}] | {r['ratio']:.3f} | "
                     f"{'–' if ref else _spread(r['paired_ratio'])} | "
                     f"{'–' if ref else _spread(r.get('paired_cpu_ratio'))} | {mfu} | "
                     f"{_load(lm['load_average'])} |")
    m = lm["moe_to_dense"]
    cpu = f", CPU time per round {_spread(m['paired_cpu'])}" if "paired_cpu" in m else ""
    lines += ["", f"MoE (top2) tokens/s over dense: {m['tokens_per_s_ratio']:.3f}, per round "
              f"{_spread(m['paired'])}{cpu} ({lm['dtype']}, {lm['device_kind']}).", ""]
    return lines


def markdown_tables(result: dict[str, Any]) -> str:
    """The sections of a benchmark JSON as markdown tables (what docs/benchmarks.md shows):
    medians with [min, max] in milliseconds, and the 1-minute load average before → after."""
    lines: list[str] = []
    overhead = result.get("overhead", {})
    if overhead and all("to_switch" in o for o in overhead.values()):
        lines += _to_switch_table(overhead, "ms/update")
    elif overhead:  # results written before the overhead section took any router
        lines += ["| N | Switch ms/update | SparseMixer ms/update | ratio of medians "
                  "| paired ratios: median [min, max] | load avg |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for n, o in result["overhead"].items():
            pr = o.get("paired_ratio")
            paired = "–" if pr is None else (
                f"{pr['median']:.3f} [{pr['min']:.3f}, {pr['max']:.3f}]")
            lines.append(f"| {n} | {_ms(o['switch'])} | {_ms(o['sparsemixer'])} | "
                         f"{o['ratio']:.3f} | {paired} | {_load(o['load_average'])} |")
        lines.append("")
    if "router" in result:
        lines += ["| N | Switch router µs | SparseMixer router µs | extra, share of a step |",
                  "| --- | --- | --- | --- |"]
        for n, r in result["router"].items():
            share = r["extra_fraction_of_step"]
            lines.append(f"| {n} | {r['switch']['median']*1e6:.0f} | "
                         f"{r['sparsemixer']['median']*1e6:.0f} | "
                         f"{'–' if share is None else f'{share:.3%}'} |")
        lines.append("")
    if "moe_vs_dense" in result:
        impls = [k for k in next(iter(result["moe_vs_dense_s"].values()))
                 if k not in ("dense", "load_average")]
        lines += ["| N | dense ms | " + " | ".join(f"{i} ms" for i in impls) + " | "
                  + " | ".join(f"{i} / dense" for i in impls) + " | load avg |",
                  "| --- " * (3 + 2 * len(impls)) + "|"]
        for n, r in result["moe_vs_dense"].items():
            t = result["moe_vs_dense_s"][n]
            lines.append(f"| {n} | {_ms(t['dense'])} | "
                         + " | ".join(_ms(t[i]) for i in impls) + " | "
                         + " | ".join(f"{r[i]:.2f}" for i in impls)
                         + f" | {_load(t['load_average'])} |")
        lines.append("")
    if "layer_cost" in result:
        lines += _to_switch_table(result["layer_cost"], "ms (layer fwd+bwd)")
    if "fusion" in result:
        lines += ["| model | one call ms/update | three calls ms/update | ratio "
                  "| CPU ms: one call | CPU ms: three calls | CPU ratio | load avg |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, f in result["fusion"].items():
            lines.append(f"| {name} | {_ms(f['fused'])} | {_ms(f['three_calls'])} | "
                         f"{f['ratio']:.3f} | {_ms(f['fused_cpu'])} | "
                         f"{_ms(f['three_calls_cpu'])} | {f['cpu_ratio']:.3f} | "
                         f"{_load(f['load_average'])} |")
        lines.append("")
    if "decode" in result:
        d = result["decode"]
        lines += [f"| model / shape (beam {d['beam_size']}) | sentences x source length "
                  "| ms per batch | sentences/s | compile s |", "| --- | --- | --- | --- | --- |"]
        for name, r in d.items():
            if isinstance(r, dict):
                lines.append(f"| {name} | {r['sentences']} x {r['source_len']} | "
                             f"{_ms(r['search_s'])} | {r['sentences_per_s']:.1f} | "
                             f"{r['compile_s']:.1f} |")
        lines.append("")
    if "throughput" in result:
        t = result["throughput"]
        lines += ["| model | params | ms/update | target tokens/s [range] | model GFLOP/s | MFU "
                  "| load avg |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name in ("dense", "n4"):
            a = t[name]
            lo, hi = a["tokens_per_s_range"]
            mfu = "–" if a["mfu"] is None else f"{a['mfu']:.1%}"
            lines.append(f"| {name} | {a['num_params']:,} | {_ms(a['step_s'])} | "
                         f"{a['tokens_per_s']:.0f} [{lo:.0f}, {hi:.0f}] | "
                         f"{a['achieved_flops_per_s']/1e9:.1f} | {mfu} | "
                         f"{_load(t['load_average'])} |")
        lines.append("")
    if "lm_throughput" in result:
        lines += _lm_table(result["lm_throughput"])
    if "rounds_s" in result:  # experiments.bench_routing_options
        lines += _routing_options_table(result)
    for key in ("profile", "lm_profile"):
        if key in result and "categories" in result[key]:
            p = result[key]
            lines += ["| op category | share of device time |", "| --- | --- |"]
            lines += [f"| {k} | {v['fraction']:.1%} |" for k, v in p["categories"].items()]
            lines += ["", "| op | ms per step | share |", "| --- | --- | --- |"]
            lines += [f"| {op['op'][:80]} | {op['s_per_step'] * 1e3:.2f} | "
                      f"{op['fraction']:.1%} |" for op in p.get("top_ops", [])[:15]]
            lines.append("")
    return "\n".join(lines)


def _routing_options_table(result: dict[str, Any]) -> list[str]:
    """Each routing option's step against the plain router's, from the rounds timed so far
    (a run stopped before its last round still has them)."""
    rounds = result["rounds_s"]
    done = min(len(t) for t in rounds.values())
    plain = rounds["plain"][:done]
    lines = [f"{done} of {result['settings']['repeats']} rounds, {result['device']}", "",
             "| option | median ms | ratio to plain (medians) | per-round ratio [min, max] |",
             "| --- | --- | --- | --- |"]
    if not done:
        return [*lines, ""]
    for name, t in rounds.items():
        t = t[:done]
        per_round = [a / b for a, b in zip(t, plain, strict=True)]
        lines.append(f"| {name} | {_median(t) * 1e3:.2f} | {_median(t) / _median(plain):.3f} | "
                     f"[{min(per_round):.3f}, {max(per_round):.3f}] |")
    return [*lines, ""]


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2


def print_report(result: dict[str, Any]) -> None:
    """Prints the tables of a result, or of each run of a merged file ``{"runs": {name: result}}``
    (what ``experiments/gpu_campaign.sh`` writes), each run under its command or failure."""
    for name, run in result.get("runs", {"": result}).items():
        if name:
            print(f"### {name}: {run.get('command', run.get('failed', '')[-300:])}\n")
        print(markdown_tables(run))
