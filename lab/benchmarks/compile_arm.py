"""Compile one timed arm of a GPU language-model run, in the source tree of the commit that ran it.

    PYTHONPATH=TREE python lab/benchmarks/compile_arm.py --arm ARM.json --out DIR   (cwd: TREE)

``TREE`` is a checkout of the commit a run of ``docs/results`` names (``git clone . TREE &&
git -C TREE checkout COMMIT``); :mod:`lab.benchmarks.roofline_programs` runs this file there, so
that the program compiled is the one that was timed, not what the current code makes of the
same arm. This file therefore imports nothing of the current tree: it is run by path and uses
the tree's own modules, through the interfaces those commits have: a tree whose
``lab.benchmarks.roofline_fit`` compiles an arm itself (``_compile_into``, from ``c06cbc4``
until the per-kind fit), one whose ``aot.lm`` compiles a run (``compile_lm(run, devices)``: the
per-kind fit's and later), and older ones that build the model from the config
(``config_for_target``: ``566fd23`` compiles a task built by hand, ``2fc088b`` only a config,
whose reports do not keep the HLO). The ``arm`` (``measured_arms`` in
:mod:`lab.benchmarks.roofline_programs`) names the router (null: the dense twin), sizes, dtype,
dispatch, attention, LM config and chip. It writes ``DIR/<i>.hlo.txt`` (the optimised HLO of
each program of the update, in order) and ``DIR/programs.json``: how often an update runs each
(``runs``) and the target it was compiled for (a commit without an ``h200`` target compiles for
``h100``: the same processor and compiler, another memory size and bandwidth).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
from typing import Any


def _load_config(spec: str) -> Any:
    for module in ("sparsemixer_jax.training.cli", "sparsemixer_jax.cli"):
        try:
            return importlib.import_module(module).load_config_file(spec)
        except (ImportError, AttributeError):
            continue
    raise RuntimeError(f"no load_config_file in this tree for {spec!r}")


def compile_arm(arm: dict[str, Any], out: str) -> None:
    """Compile ``arm``'s update with this tree's code; write its programs under ``out``."""
    from lab.benchmarks import lm_step
    from sparsemixer_jax.aot import lm, targets

    try:
        target = targets.parse_target(f"{arm['chip']}:1x1")
    except ValueError:
        target = targets.parse_target("h100:1x1")
    os.makedirs(out, exist_ok=True)
    try:
        fit = importlib.import_module("lab.benchmarks.roofline_fit")
    except ImportError:
        fit = None
    if fit is not None and hasattr(fit, "_compile_into"):  # the tree compiles arms itself
        fit._compile_into(dict(arm, chip=target.chip), out, "arm")
        with open(os.path.join(out, "arm.json")) as f:
            runs = json.load(f)
        for i in range(len(runs)):
            os.replace(os.path.join(out, f"arm.{i}.hlo.txt"), os.path.join(out, f"{i}.hlo.txt"))
        _write_index(out, target, runs)
        return
    if not hasattr(lm, "config_for_target"):
        reports, task = _compile_run(arm, target)
        _write_programs(out, target, reports, task, [])
        return
    wanted = {"sizes": arm["sizes"], "router": arm["router"] or "switch", "dtype": arm["dtype"],
              "dispatch": arm["dispatch"], "attention_impl": arm["attention_impl"],
              "base": _load_config(arm["lm_config"]) if arm["lm_config"] else None}
    accepted = inspect.signature(lm_step.lm_model_config).parameters
    if wanted["base"] is not None and "base" not in accepted:
        raise RuntimeError("this tree's benchmark takes no LM config")
    config = lm_step.lm_model_config(**{k: v for k, v in wanted.items() if k in accepted})
    devices = targets.target_devices(target)
    texts = _capture_hlo()
    importlib.import_module("sparsemixer_jax.runtime").configure(config)
    config = lm.config_for_target(config, target)
    task = lm.LMTask.from_config(config)
    task = lm_step.dense_twin(task) if arm["router"] is None else task
    if hasattr(lm, "compile_lm_task"):
        reports = lm.compile_lm_task(task, config, devices)
    else:  # compile_lm builds the task from the config: hand it the one built here
        lm.LMTask = type("Task", (), {"from_config": staticmethod(lambda c: task)})
        reports = lm.compile_lm(config, target, devices)
    _write_programs(out, target, reports, task, texts)


def _compile_run(arm: dict[str, Any], target: Any) -> tuple[list[Any], Any]:
    """``(reports, task)`` of a tree whose ``aot.lm.compile_lm`` compiles a run."""
    from lab.benchmarks import lm_step
    from sparsemixer_jax.aot import lm, targets
    from sparsemixer_jax.tasks import run_config
    from sparsemixer_jax.tasks.language_model import LMTask
    from sparsemixer_jax.training import runtime

    config = lm_step.lm_model_config(
        arm["sizes"], arm["router"] or "switch", arm["dtype"], arm["dispatch"],
        arm["attention_impl"], _load_config(arm["lm_config"]) if arm["lm_config"] else None)
    runtime.configure(runtime.RuntimeConfig.from_config(config.runtime))
    task = LMTask.from_config(config).for_platform(target.dispatch_platform)
    task = lm_step.dense_twin(task) if arm["router"] is None else task
    return lm.compile_lm(run_config(config, task), targets.target_devices(target)), task


def _write_programs(out: str, target: Any, reports: list[Any], task: Any,
                    texts: list[str]) -> None:
    micro_batches = task.data.batch_size // task.data.micro
    for i, report in enumerate(reports):
        with open(os.path.join(out, f"{i}.hlo.txt"), "w") as f:
            f.write(getattr(report, "hlo_text", None) or texts[i])
    _write_index(out, target, [micro_batches if r.name.startswith("accumulate") else 1
                               for r in reports])


def _capture_hlo() -> list[str]:
    """The optimised HLO of every program the tree's ``aot.steps`` analyses, in order (the
    oldest trees' reports do not keep it)."""
    steps = importlib.import_module("sparsemixer_jax.aot.steps")
    texts: list[str] = []
    analyse = steps.analyse

    def keeping(name: str, compiled: Any, *rest: Any) -> Any:
        texts.append(compiled.as_text())
        return analyse(name, compiled, *rest)

    steps.analyse = keeping
    return texts


def _write_index(out: str, target: Any, runs: list[int]) -> None:
    with open(os.path.join(out, "programs.json"), "w") as f:
        json.dump({"target": f"{target.chip}:1x1", "runs": runs}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arm", required=True, help="a JSON file holding one arm")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with open(args.arm) as f:
        compile_arm(json.load(f), args.out)


if __name__ == "__main__":
    main()
