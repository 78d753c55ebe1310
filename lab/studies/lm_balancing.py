"""The language-model half of the balancing study: the small LM of ``configs/lm_study.py``
(Mixtral-style, N = 8, top-2) under each balancing, one study root per balancing.

Every balancing trains with 4 micro-batches of 4 sequences per update (the update's 16
sequences unchanged), so that the global-batch loss counts more tokens than the micro-batch
loss and the balancings differ in the balancing only. The arms are those of
``configs/lm_study.py``; bias balancing leaves out SparseMixer-v2 and v2* (the router's config
refuses the pair: a selection bias changes the distribution SparseMixer samples from).

    python -c "from lab.studies.lm_balancing import commands; print(*commands(), sep='\\n')"

and, once a root's runs are finished, :func:`summary_command` summarises it into docs/results.
"""

from __future__ import annotations

CONFIG = "configs/lm_study.py"
SEEDS = (0, 1, 2)
VERSUS = "switch_n8_eps0_norm1"
SWITCH_FORWARD_ARMS = ("switch_n8_eps0_norm1", "densemixer_n8_eps0_norm1",
                       "default_moe_n8_eps0_norm1")
SPARSEMIXER_ARMS = ("sparsemixer_v2star_n8", "sparsemixer_v2_n8")
MICRO_BATCHES = ("data.micro_batch_size=4",)

BIAS_UPDATE_RATE = 0.001
"""Megatron-Core's default ``moe_router_bias_update_rate`` (DeepSeek-V3's rate)."""

ALL_ARMS = SPARSEMIXER_ARMS + SWITCH_FORWARD_ARMS

LM_BALANCINGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "mb": (MICRO_BATCHES, ALL_ARMS),
    "gb": ((*MICRO_BATCHES, "router.balance_scope=global_batch"), ALL_ARMS),
    "bias": ((*MICRO_BATCHES, "router.balance_weight=0.0",
              f"router.bias_update_rate={BIAS_UPDATE_RATE}"), SWITCH_FORWARD_ARMS),
    "none": ((*MICRO_BATCHES, "router.balance_weight=0.0"), ALL_ARMS),
}
"""Balancing -> (the ``--override`` of every run, the arms that compose with it)."""


def command(balancing: str) -> str:
    """The ``experiments.compare`` command of one balancing's study root."""
    overrides, arms = LM_BALANCINGS[balancing]
    return (f"python -m experiments.compare --config {CONFIG} --root runs/lm_balancing_{balancing} "
            f"--arms {' '.join(arms)} --versus {VERSUS} --seeds {' '.join(map(str, SEEDS))} "
            + " ".join(f"--override {o}" for o in overrides)
            + " --parallel 2 --compact --no-dense")


def commands() -> list[str]:
    """One command per balancing, in :data:`LM_BALANCINGS`' order."""
    return [command(b) for b in LM_BALANCINGS]


def summary_command(balancing: str) -> str:
    """The command that summarises one balancing's finished root into ``docs/results``
    (``lm_balancing_{balancing}_cpu.{json,md,png}``, the router figure, the runs' small files)."""
    out = f"docs/results/lm_balancing_{balancing}"
    return (command(balancing).replace(" --parallel 2 --compact", "")
            + f" --summarize-only --out-json {out}_cpu.json --out-md {out}_cpu.md"
            f" --plot {out}_cpu.png --plot-router {out}_router_cpu.png"
            f" --pack {out}_runs.tar.gz")
