"""The arms of a convergence study and where their runs live (no training here).

Arm names say what they change, so a run directory names its own config:

* ``{router}_n{N}``: ``router.name`` (a key of ``sparsemixer_jax.routers.ROUTERS``, checked) with
  ``model.num_experts = N``, e.g. ``switch_n4``, ``sparsemixer_1st_n8``, ``default_moe_st_n4``
  (router names contain underscores: the router is everything before the first ``_n{digits}``);
* ``dense``: no experts;
* either, followed by modifiers ``_lr{peak_lr}``, ``_eps{jitter_eps}``, ``_bal{balance_weight}``,
  ``_z{z_loss_weight}``, ``_norm{0|1}`` (``normalize_top_k``), ``_trainable{0|1}``
  (``router.trainable``: 0 freezes the routers), e.g. ``sparsemixer_n4_lr2e-3``,
  ``sparsemixer_n4_eps0.5``, ``switch_n8_eps0_norm1`` (Mixtral's top-k routing).

Each arm is compared with its *target arm*: the Switch arm of the same N and the same
modifiers if the study has it (so a learning-rate arm meets Switch at that rate), else the
plain ``switch_n{N}``; the dense arm meets the Switch arm of the smallest N.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

DIVERGED = "diverged.json"

#: Arm-name modifier -> the config field it sets.
MODIFIERS = {"lr": "optim.peak_lr", "eps": "router.jitter_eps", "bal": "router.balance_weight",
             "z": "router.z_loss_weight", "norm": "router.normalize_top_k",
             "trainable": "router.trainable"}
_ARM = re.compile(
    r"^(?:(?P<router>[a-z0-9_]+?)_n(?P<n>\d+)|dense)(?P<mods>(?:_[a-z]+[-+.e0-9]+)*)$")
_MOD = re.compile(r"_([a-z]+)([-+.e0-9]+)")

#: Named groups of arms for ``--study`` (N from ``--experts`` where it says ``{n}``).
STUDIES = {
    "main": ["switch_n{n}", "sparsemixer_n{n}", "dense"],
    "ablations": ["switch_n{n}", "sparsemixer_1st_n{n}", "sparsemixer_2nd_n{n}",
                  "sparsemixer_nomask_n{n}", "sparsemixer_n{n}_eps0.5"],
    # multi30k_n4's peak rate is 1e-3: half and double it.
    "lr": ["switch_n{n}_lr5e-4", "sparsemixer_n{n}_lr5e-4", "switch_n{n}_lr2e-3",
           "sparsemixer_n{n}_lr2e-3"],
    # The reference adds alpha * balance loss to a loss *summed* over tokens (docs/science.md):
    # per token that is about alpha / (tokens per batch), 0.01 / 6.5k at 8192 padded tokens.
    "refbalance": ["switch_n{n}_bal1.5e-6", "sparsemixer_n{n}_bal1.5e-6"],
    # The routers that give the router a gradient for unchosen experts (docs/routing.md).
    "successors": ["switch_n{n}", "sparsemixer_n{n}", "densemixer_n{n}", "default_moe_n{n}"],
}


def arm_names(experts: Sequence[int], dense: bool = True) -> list[str]:
    """``switch_n4``, ``sparsemixer_n4``, ... for each N, then ``dense`` (N does not apply)."""
    names = [f"{router}_n{n}" for n in experts for router in ("switch", "sparsemixer")]
    return [*names, "dense"] if dense else names


def study_arms(studies: Sequence[str], experts: Sequence[int], dense: bool = True) -> list[str]:
    """The arms of the named ``STUDIES`` for each N, in order, without repeats."""
    arms: list[str] = []
    for study in studies:
        if study not in STUDIES:
            raise ValueError(f"unknown study {study!r}; choose from {sorted(STUDIES)}")
        for n in experts:
            for template in STUDIES[study]:
                arm = template.format(n=n)
                if arm not in arms and (dense or arm != "dense"):
                    arms.append(arm)
    return arms


def parse_arm(arm: str) -> dict[str, Any]:
    """The config fields an arm sets: ``{"router.name", "model.num_experts", ...modifiers}``."""
    match = _ARM.match(arm)
    if match is None:
        raise ValueError(f"arm {arm!r} is not '{{router}}_n{{N}}' or 'dense' followed by "
                         f"modifiers _{{{','.join(MODIFIERS)}}}VALUE")
    from sparsemixer_jax.routers import ROUTERS

    if match["router"] is not None and match["router"] not in ROUTERS:
        raise ValueError(f"arm {arm!r}: unknown router {match['router']!r}; known: "
                         f"{sorted(ROUTERS)}")
    fields: dict[str, Any] = {"router.name": match["router"] or "switch",
                              "model.num_experts": int(match["n"] or 0)}
    for key, value in _MOD.findall(match["mods"]):
        if key not in MODIFIERS:
            raise ValueError(f"arm {arm!r}: unknown modifier {key!r}; known: {sorted(MODIFIERS)}")
        try:
            fields[MODIFIERS[key]] = float(value)
        except ValueError:
            raise ValueError(f"arm {arm!r}: modifier {key!r} needs a number, got {value!r}") \
                from None
    return fields


def arm_settings(arm: str) -> tuple[str, int]:
    """``(router.name, model.num_experts)`` of an arm name (dense: ``("switch", 0)``)."""
    fields = parse_arm(arm)
    return fields["router.name"], fields["model.num_experts"]


def _modifiers(arm: str) -> str:
    match = _ARM.match(arm)
    return match["mods"] if match else ""


def target_arm(arm: str, arms: Sequence[str]) -> str:
    """The Switch arm ``arm`` is measured against (module docstring)."""
    n = arm_settings(arm)[1]
    if n == 0:
        sizes = sorted(arm_settings(a)[1] for a in arms if arm_settings(a)[1])
        n = sizes[0] if sizes else 0
    same_mods = f"switch_n{n}{_modifiers(arm)}"
    return same_mods if same_mods in arms else f"switch_n{n}"


def run_dir(root: str, arm: str, seed: int) -> str:
    return os.path.join(root, f"{arm}_s{seed}")


def run_state(workdir: str) -> str:
    """``"finished"``, ``"diverged"``, ``"partial"`` (started) or ``"new"``."""
    if os.path.exists(os.path.join(workdir, "results.json")):
        return "finished"
    if os.path.exists(os.path.join(workdir, DIVERGED)):
        return "diverged"
    return "partial" if os.path.isdir(workdir) else "new"
