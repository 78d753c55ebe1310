"""The compiled programs of every timed GPU language-model arm, as the roofline fit reads them.

    python -m lab.benchmarks.roofline_programs --tree 2fc088b=TREE_A --tree 566fd23=TREE_B \
        --tree c06cbc4=TREE_C --out docs/results/roofline_programs_gpu.json

For every arm of every ``lm_throughput`` run in the measured JSON files (``--measured``), the
update that was timed is compiled without the GPU, in a checkout of the commit the file names
(``--tree COMMIT=DIR``, e.g. made by ``git clone . DIR && git -C DIR checkout COMMIT``;
``lab/benchmarks/compile_arm.py`` runs there), for one GPU of the kind that ran it, and read
by the current roofline (:func:`sparsemixer_jax.aot.roofline.program_ops`). Each program's
operations are written as rows ``[class, FLOPs, bytes, runs per update]``, identical rows
merged. Arms whose rows are identical are one program (SparseMixer v2 and v2* compile to the
same one; so do the dense twins of two dispatches): it is written once, with every arm that ran
it. The HLO is kept under ``--cache``, so that a rerun compiles nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

# The roofline's chip (and compile target) of each GPU a measurement names.
CHIP_OF_DEVICE = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA H200": "h200"}
MEASURED = ("docs/results/benchmark_lm_h100.json", "docs/results/benchmark_lm_bench_h200.json",
            "docs/results/benchmark_lm_bench_h200_8row.json")


def measured_arms(path: str) -> list[dict[str, Any]]:
    """One entry per timed arm: ``file``, ``commit`` (the code that ran), ``run``, ``arm``,
    ``router``, ``sizes``, ``dtype``, ``dispatch``, ``attention_impl``, ``lm_config`` (None:
    the benchmark's own model), ``chip``, ``seconds`` (median update), ``model_flops`` (per
    update)."""
    with open(path) as f:
        data = json.load(f)
    out = []
    for run_name, run in data["runs"].items():
        section = run.get("lm_throughput")
        if not isinstance(section, dict) or "sizes" not in section:
            continue
        if section["device_kind"] not in CHIP_OF_DEVICE:
            raise ValueError(f"{path}: run {run_name!r} ran on {section['device_kind']!r}; the "
                             f"fit knows {', '.join(CHIP_OF_DEVICE)}")
        for arm, result in section.items():
            if not isinstance(result, dict) or "step_s" not in result:
                continue
            out.append({"file": os.path.basename(path), "commit": data["code"].split()[-1],
                        "run": run_name, "arm": arm, "router": result["router"],
                        "sizes": section["sizes"], "dtype": section["dtype"],
                        "dispatch": section["dispatch"],
                        "attention_impl": section.get("attention_impl", "einsum"),
                        "lm_config": run.get("lm_config"),
                        "chip": CHIP_OF_DEVICE[section["device_kind"]],
                        "seconds": result["step_s"]["median"],
                        "model_flops": result["model_flops_per_token"]["total"]
                        * section["tokens_per_step"]})
    return out


def arm_key(arm: dict[str, Any]) -> str:
    """The arm's program as compiled: commit, chip, attention, dispatch, arm, micro-batch rows."""
    return "_".join(str(x) for x in (arm["commit"], arm["chip"], arm["attention_impl"],
                                    arm["dispatch"], arm["arm"],
                                    f"rows{arm['sizes'].get('micro_rows', 1)}"))


def compile_in_tree(arm: dict[str, Any], tree: str, out: str) -> None:
    """Compile ``arm`` with the code of ``tree`` (compile_arm.py run there, in a process of
    its own) into ``out``."""
    os.makedirs(out, exist_ok=True)
    spec = os.path.join(out, "arm.json")
    with open(spec, "w") as f:
        json.dump(arm, f)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_arm.py")
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    done = subprocess.run([sys.executable, script, "--arm", spec, "--out", os.path.abspath(out)],
                          cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"compiling {arm_key(arm)} in {tree} failed: "
                           f"{done.stderr.strip().splitlines()[-1:]}")


def op_rows(programs: Sequence[tuple[str, float]]) -> list[list[Any]]:
    """The operations of an update that runs each ``(optimised HLO, runs per update)`` of
    ``programs``: rows ``[class, flops, bytes, runs per update]``, identical operations
    merged, sorted (bytes: link bytes for a collective)."""
    from sparsemixer_jax.aot import hlo, roofline

    merged: dict[tuple[str, float, float], float] = {}
    for text, runs in programs:
        for op in roofline.program_ops(hlo.parse_module(text)):
            key = (op.cost_class, op.flops,
                   op.link_bytes if op.kind == "collective" else op.bytes)
            merged[key] = merged.get(key, 0.0) + op.count * runs
    return [[c, f, b, n] for (c, f, b), n in sorted(merged.items())]


def compiled_rows(directory: str) -> tuple[str, list[list[Any]]]:
    """``(target compiled for, op_rows)`` of the programs compile_arm.py wrote in
    ``directory``."""
    with open(os.path.join(directory, "programs.json")) as f:
        index = json.load(f)
    programs = []
    for i, runs in enumerate(index["runs"]):
        with open(os.path.join(directory, f"{i}.hlo.txt")) as f:
            programs.append((f.read(), runs))
    return index["target"], op_rows(programs)


def distinct_programs(compiled: Sequence[tuple[dict[str, Any], str, list[list[Any]]]]
                      ) -> list[dict[str, Any]]:
    """One entry per distinct program among ``(arm, target, rows)``: arms whose rows are
    identical share it (``arms``: each arm's file, run and name); ``id`` is a digest of the
    rows."""
    programs: dict[str, dict[str, Any]] = {}
    for arm, target, rows in compiled:
        digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:12]
        program = programs.setdefault(digest, {
            "id": digest, "chip": arm["chip"], "commit": arm["commit"], "compiled_for": target,
            "attention_impl": arm["attention_impl"], "dispatch": arm["dispatch"],
            "micro_rows": arm["sizes"].get("micro_rows", 1), "lm_config": arm["lm_config"],
            "arms": [], "ops": rows})
        program["arms"].append({"file": arm["file"], "run": arm["run"], "arm": arm["arm"]})
    return list(programs.values())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", nargs="+", default=list(MEASURED))
    parser.add_argument("--tree", action="append", default=[],
                        help="COMMIT=DIR: a checkout of the commit a measured file names")
    parser.add_argument("--cache", default="runs/roofline_programs")
    parser.add_argument("--out", default="docs/results/roofline_programs_gpu.json")
    args = parser.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree)
    arms = [arm for path in args.measured for arm in measured_arms(path)]
    compiled = []
    for arm in arms:
        directory = os.path.join(args.cache, arm_key(arm))
        if not os.path.exists(os.path.join(directory, "programs.json")):
            if arm["commit"] not in trees:
                raise SystemExit(f"{arm['file']}: arm {arm['arm']} of run {arm['run']} ran at "
                                 f"commit {arm['commit']}: give --tree {arm['commit']}=DIR")
            compile_in_tree(arm, trees[arm["commit"]], directory)
        compiled.append((arm, *compiled_rows(directory)))
        print(f"compiled {arm['file']} {arm['run']} {arm['arm']}", flush=True)
    programs = distinct_programs(compiled)
    import jax

    shown = [f"{a.split('=')[0]}=DIR" if a in args.tree else a
             for a in (argv if argv is not None else sys.argv[1:])]
    out = {"command": "python -m lab.benchmarks.roofline_programs " + " ".join(shown),
           "compiled_on": f"{platform.processor() or platform.machine()}, {os.cpu_count()} "
                          f"CPUs, jax {jax.__version__}, targets <chip>:1x1 (no GPU)",
           "measured": args.measured,
           "rows": "[class, FLOPs, bytes (link bytes for a collective), runs per update]",
           "programs": programs}
    with open(args.out, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
