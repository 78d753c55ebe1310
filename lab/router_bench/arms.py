"""Arms of the benchmark: one frozen record per trained configuration, and the tables.

An arm fixes the student (router, ``jitter_eps``, top-k, number of experts, depth, dense
baselines), the teacher it learns from (experts ``K``, margin, depth) and the learning-rate
multiplier. Each arm is compared, seed by seed, with its *baseline*: the Switch arm of the same
setting (see :func:`baseline_of`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sparsemixer_jax.routers import check_router

FAMILIES = ("mlp", "tanh")
"""Expert families of teacher and student (:class:`Arm`'s ``family``)."""


@dataclass(frozen=True)
class Arm:
    """One trained configuration (hashable: it is a static argument of the compiled run).

    ``teacher_experts`` defaults to ``num_experts``. ``dense``: ``"params"`` (one expert as
    wide as all ``N``) or ``"flops"`` (one expert of the MoE's width, the active compute of
    top-1). ``oracle_router``: the student's router is the teacher's (scaled by 20, so the
    softmax is one-hot) and frozen; only the experts learn. ``measure_gradient``: log the
    cosine with the exact router gradient (one layer, top-1 only; it doubles compile time).

    Setup choices (the robustness table varies them one at a time):
    ``family``: ``"mlp"``, teacher experts ReLU MLPs ``d -> 8 -> d`` and student experts ReLU
    MLPs of the run's ``hidden`` width (wider than the teacher's), or ``"tanh"``, teacher
    experts ``tanh(x W_i)`` (``W_i [d, d]``) and student experts ``tanh(x wi + bi) wo + bo`` of
    width ``d``, a family that contains the teacher's with nothing to spare.
    ``balance_weight``: weight of the Switch balance loss (None: the run's). ``fresh_data``:
    every step draws new inputs and labels them clean (no label noise), instead of drawing from
    a fixed pool and adding label noise. ``batch``: tokens per step (None: the run's).
    ``omega``: False freezes SparseMixer's ``omega`` at its initial 1 (no effect on routers
    without it). ``student_family``: the student's experts of that family instead of
    ``family``'s (None: the same), to tell which half of the family matters.

    Balancing (the balancing table): ``balance_scope`` (the router's, ``"micro_batch"`` or
    ``"global_batch"``: the counts of the update's micro-batches so far), ``bias_update_rate``
    (> 0: bias balancing, the selection bias stepped after every optimizer step) and
    ``micro_batches``: the step's batch split into this many micro-batches whose gradients are
    averaged before the one optimizer step (the step's tokens and its task gradient are
    unchanged; the balance loss and the loads are counted per micro-batch or over the update).
    ``score``: the router's expert scores, ``"softmax"`` or ``"sigmoid"`` (the scores table).
    """

    name: str
    router: str = "switch"
    jitter_eps: float = 0.1
    top_k: int = 1
    num_experts: int = 8
    teacher_experts: int | None = None
    depth: int = 1
    margin: float = 0.5
    lr_mult: float = 1.0
    dense: str | None = None
    oracle_router: bool = False
    measure_gradient: bool = True
    teacher_gate_scale: float = 0.0
    family: str = "mlp"
    balance_weight: float | None = None
    fresh_data: bool = False
    batch: int | None = None
    omega: bool = True
    student_family: str | None = None
    balance_scope: str = "micro_batch"
    bias_update_rate: float = 0.0
    micro_batches: int = 1
    score: str = "softmax"

    def __post_init__(self):
        if self.micro_batches < 1:
            raise ValueError(f"arm {self.name!r}: micro_batches must be >= 1, got "
                             f"{self.micro_batches}")
        for field in ("family", "student_family"):
            value = getattr(self, field)
            if value not in FAMILIES and not (field == "student_family" and value is None):
                raise ValueError(f"arm {self.name!r}: {field} must be one of {FAMILIES}, "
                                 f"got {value!r}")

    @property
    def student_experts(self) -> str:
        """The student's expert family: ``student_family``, else ``family``."""
        return self.student_family or self.family

    @property
    def k_teacher(self) -> int:
        return self.num_experts if self.teacher_experts is None else self.teacher_experts

    def router_options(self) -> dict:
        """The balancing fields of the router's config (:class:`~sparsemixer_jax.routers.
        RouterConfig`)."""
        return {"balance_scope": self.balance_scope, "bias_update_rate": self.bias_update_rate,
                "score": self.score}

    def refusal(self) -> str | None:
        """Why the router's config refuses this arm (an option a router does not take), in
        one line; None if it composes."""
        if self.dense is not None:
            return None
        try:
            check_router(self.router, top_k=self.top_k, jitter_eps=self.jitter_eps,
                                 num_experts=self.num_experts, **self.router_options())
        except ValueError as err:
            return str(err)
        return None

    def setting(self) -> tuple:
        """What pairs arms: the same teacher and the same data stream per seed."""
        return (self.k_teacher, self.depth, self.margin, self.teacher_gate_scale, self.family)


def _arm(name: str, **kw) -> Arm:
    return Arm(name=name, **kw)


def baseline_of(arm: Arm, arms: dict[str, Arm]) -> str | None:
    """Name of the Switch arm ``arm`` is compared with: the same setting, learning rate, N and
    top-k (``omega`` aside: Switch has none), the same ``jitter_eps`` if such a Switch arm
    exists, else the default 0.1.
    None for the Switch arm itself when nothing else matches."""
    base = dataclasses.replace(arm, name="", router="switch", dense=None, oracle_router=False,
                               measure_gradient=True, omega=True)
    candidates = [base, dataclasses.replace(base, jitter_eps=0.1)]
    for cand in candidates:
        for other in arms.values():
            same = dataclasses.replace(other, name="", measure_gradient=True,
                                       omega=True) == cand
            if same and other.name != arm.name:
                return other.name
    return None


def main_table() -> list[Arm]:
    """The main table: one-layer setting at N = K = 8, margin 0.5, plus the sweeps."""
    arms = []
    for router in ("switch", "sparsemixer", "sparsemixer_1st", "sparsemixer_2nd",
                   "sparsemixer_nomask"):
        arms.append(_arm(router, router=router))
    for eps in (0.05, 0.3, 0.5, 1.0):
        arms.append(_arm(f"switch_eps{eps}", router="switch", jitter_eps=eps))
        arms.append(_arm(f"sparsemixer_eps{eps}", router="sparsemixer", jitter_eps=eps))
    for router in ("switch", "sparsemixer_v2", "sparsemixer_v2star"):
        arms.append(_arm(f"{router}_top2", router=router, top_k=2))
    for lr in (0.3, 3.0):
        for router in ("switch", "sparsemixer"):
            arms.append(_arm(f"{router}_lr{lr}", router=router, lr_mult=lr,
                             measure_gradient=False))
    for n in (4, 16):
        for router in ("switch", "sparsemixer"):
            arms.append(_arm(f"{router}_n{n}", router=router, num_experts=n,
                             measure_gradient=n == 4))
        arms.append(_arm(f"sparsemixer_n{n}_eps0.5", router="sparsemixer", num_experts=n,
                         jitter_eps=0.5, measure_gradient=n == 4))
    for margin in (0.0, 1.0):
        for router in ("switch", "sparsemixer"):
            arms.append(_arm(f"{router}_margin{margin}", router=router, margin=margin,
                             measure_gradient=False))
    arms.append(_arm("dense_params", dense="params"))
    arms.append(_arm("dense_flops", dense="flops"))
    return arms


def depth_table() -> list[Arm]:
    """The stacked setting: 3 residual MoE layers, N = K = 8, margin 0.25 per layer."""
    arms = [_arm(f"{router}_depth3", router=router, depth=3, margin=0.25)
            for router in ("switch", "sparsemixer", "sparsemixer_1st")]
    arms.append(_arm("dense_params_depth3", dense="params", depth=3, margin=0.25))
    return arms


def gate_table() -> list[Arm]:
    """The soft teacher (gate ``softmax(2 z)_D``, Switch's own family) at N = K = 8 and 16: does
    SparseMixer's edge come from its gate being exactly 1 where the mask leaves one expert?"""
    arms = [_arm(f"{router}_softgate", router=router, teacher_gate_scale=2.0)
            for router in ("switch", "sparsemixer", "sparsemixer_1st", "sparsemixer_nomask")]
    arms += [_arm(f"{router}_n16_softgate", router=router, num_experts=16,
                  teacher_gate_scale=2.0, measure_gradient=False)
             for router in ("switch", "sparsemixer")]
    return arms


SUCCESSORS = ("switch", "sparsemixer", "densemixer", "densemixer_blog", "default_moe",
              "default_moe_forward")
"""The routers of :func:`successors_table`: Switch, SparseMixer and the routers that also give
the router a gradient for the experts a token did not choose (DenseMixer, Default MoE with its
defaults in the backward only, ``default_moe``, or also in the forward,
``default_moe_forward``)."""


def successors_table() -> list[Arm]:
    """Every estimator on the same seeds, in the settings where the main table found
    differences: the main setting (N = K = 8, margin 0.5), N = K = 16, data packed up to the
    routing boundaries (margin 0, N = 8), and top-2 at N = 8 for Switch, DenseMixer and both
    forms of Default MoE. The names of the main table's arms are reused (the same
    configurations, so the same runs)."""
    arms = [_arm(router, router=router) for router in SUCCESSORS]
    arms += [_arm(f"{router}_n16", router=router, num_experts=16, measure_gradient=False)
             for router in SUCCESSORS]
    arms += [_arm(f"{router}_margin0.0", router=router, margin=0.0, measure_gradient=False)
             for router in SUCCESSORS]
    arms += [_arm(f"{router}_top2", router=router, top_k=2)
             for router in ("switch", "densemixer", "default_moe", "default_moe_forward")]
    return arms


def quick_table() -> list[Arm]:
    """A handful of arms for ``--quick`` and the tests."""
    return [_arm("switch", router="switch", num_experts=4),
            _arm("sparsemixer", router="sparsemixer", num_experts=4),
            _arm("dense_flops", dense="flops", num_experts=4)]




# The two corner setups of the robustness table. "p": the main setting above (ReLU MLP
# experts, the student's wider than the teacher's; balance loss 0.01; a fixed pool of 16,384
# inputs with label noise 0.1; batch 128; SparseMixer's omega trained; margin 0.5). "i": a
# minimal teacher-student setup (tanh(x W_i) experts in teacher and student; no balance loss;
# fresh clean inputs every step; batch 256; no omega; no margin). Both: hard teacher, Adam 3e-3,
# jitter_eps 0.1, 1,500 steps, evaluation with argmax routing.
CORNERS = {
    "p": {},
    "i": {"family": "tanh", "balance_weight": 0.0, "fresh_data": True, "batch": 256,
          "omega": False, "margin": 0.0},
}

# One-at-a-time changes from each corner: label -> fields. The first six move a factor to the
# other corner's level; the last three change what both corners share.
FLIPS = {
    "p": {"tanh": {"family": "tanh"}, "nobalance": {"balance_weight": 0.0},
          "fresh": {"fresh_data": True}, "batch256": {"batch": 256},
          "noomega": {"omega": False}, "margin0": {"margin": 0.0}},
    "i": {"mlp": {"family": "mlp"}, "balance": {"balance_weight": None},
          "pool": {"fresh_data": False}, "batch128": {"batch": None},
          "omega": {"omega": True}, "margin0.5": {"margin": 0.5}},
}
SHARED_FLIPS = {"softgate": {"teacher_gate_scale": 2.0}, "lr0.3": {"lr_mult": 0.3},
                "lr3": {"lr_mult": 3.0}}
# The family moves teacher and student together; these move one half of it.
HALF_FAMILY_FLIPS = {
    "p": {"teachertanh": {"family": "tanh", "student_family": "mlp"},
          "studenttanh": {"student_family": "tanh"}},
    "i": {"teachermlp": {"family": "mlp", "student_family": "tanh"},
          "studentmlp": {"student_family": "mlp"}},
}
ROBUSTNESS_ROUTERS = ("switch", "sparsemixer", "densemixer", "default_moe")


def robustness_arm(router: str, corner: str, n: int, flip: str | None = None) -> Arm:
    """The arm ``{router}_{corner}{n}[_{flip}]``: ``router`` at ``N = K = n`` in corner
    ``corner`` (:data:`CORNERS`), with the change ``flip`` (:data:`FLIPS`,
    :data:`SHARED_FLIPS`) if given."""
    fields = dict(CORNERS[corner])
    if flip is not None:
        fields.update({**FLIPS[corner], **SHARED_FLIPS, **HALF_FAMILY_FLIPS[corner]}[flip])
    name = f"{router}_{corner}{n}" + (f"_{flip}" if flip else "")
    return _arm(name, router=router, num_experts=n, measure_gradient=False, **fields)


def robustness_table() -> list[Arm]:
    """Which setup choices decide the sign of each estimator (SparseMixer, DenseMixer, Default
    MoE) minus Switch: both corners at N = 8 and 16, then one change at a time from each corner
    at N = 16 (Switch and SparseMixer first, then DenseMixer and Default MoE), then the shared
    changes, then the expert family of the teacher or of the student alone (N = 16 only), then
    the same at N = 8. Ordered by priority: a run cut short keeps the decisive
    arms."""
    arms, seen = [], set()

    def add(router, corner, n, flip=None):
        if flip in ("omega", "noomega") and router != "sparsemixer":
            return  # omega exists only on SparseMixer's layer
        arm = robustness_arm(router, corner, n, flip)
        if arm.name not in seen:
            seen.add(arm.name)
            arms.append(arm)

    for corner in ("i", "p"):
        for n in (8, 16):
            for router in ROBUSTNESS_ROUTERS:
                add(router, corner, n)
    for n in (16, 8):
        for routers in (("switch", "sparsemixer"), ("densemixer", "default_moe")):
            for corner in ("i", "p"):
                for flip in FLIPS[corner]:
                    for router in routers:
                        add(router, corner, n, flip)
        for corner in ("i", "p"):
            for flip in SHARED_FLIPS:
                for router in ROBUSTNESS_ROUTERS:
                    add(router, corner, n, flip)
        if n == 16:  # the family decides SparseMixer's sign at N = 16: which half of it?
            for corner in ("i", "p"):
                for flip in HALF_FAMILY_FLIPS[corner]:
                    for router in ROBUSTNESS_ROUTERS:
                        add(router, corner, n, flip)
    return arms


BALANCINGS = {
    "mb": {},
    "gb": {"balance_scope": "global_batch"},
    "bias": {"balance_weight": 0.0, "bias_update_rate": 0.01},
    "none": {"balance_weight": 0.0},
}
"""The balancings of :func:`balancing_table`, by arm-name suffix: the Switch balance loss over
each micro-batch (``mb``, the benchmark's default weight 0.01), the same loss over the update's
micro-batches (``gb``: its expert fractions count the micro-batches so far), bias balancing at
rate 0.01 without a loss (``bias``), and no balancing (``none``)."""

BALANCING_MICRO_BATCHES = 2
"""Micro-batches per step in :func:`balancing_table` (every balancing, so that they differ in
the balancing only)."""


def balancing_estimators(top_k: int) -> tuple[str, ...]:
    """The estimators of the balancing table at ``top_k``: top-k (Switch), SparseMixer (v1 for
    ``k = 1``, v2 and v2* for ``k = 2``), DenseMixer and Default MoE."""
    sparse = ("sparsemixer",) if top_k == 1 else ("sparsemixer_v2", "sparsemixer_v2star")
    return ("switch", *sparse, "densemixer", "default_moe")


def balancing_table() -> list[Arm]:
    """Every estimator under every balancing (:data:`BALANCINGS`), main setting (margin 0.5,
    ``N = K``), ``{router}_k{k}_n{N}_{balancing}``; ordered by priority: ``k = 2, N = 8``, then
    ``k = 1, N = 8``, then ``N = 16`` (``k = 2``, then ``k = 1``). A pair the router's
    config refuses would be reported and not trained (:meth:`Arm.refusal`); none is now."""
    return _estimator_arms(((2, 8), (1, 8), (2, 16), (1, 16)), BALANCINGS)


def _estimator_arms(cells: tuple[tuple[int, int], ...], settings: dict[str, dict]) -> list[Arm]:
    """``{router}_k{k}_n{N}_{suffix}`` for each ``(k, N)`` of ``cells``, each setting of
    ``settings`` (suffix -> Arm fields, over the balancing table's 2 micro-batches) and each of
    :func:`balancing_estimators` ``(k)``, in that order."""
    arms = []
    for k, n in cells:
        for suffix, fields in settings.items():
            fields = {"micro_batches": BALANCING_MICRO_BATCHES, **fields}
            for router in balancing_estimators(k):
                arms.append(_arm(f"{router}_k{k}_n{n}_{suffix}", router=router, top_k=k,
                                 num_experts=n, measure_gradient=False, **fields))
    return arms


BALANCING_SETTINGS = {
    "mb8": {"micro_batches": 8},
    "gb8": {"micro_batches": 8, "balance_scope": "global_batch"},
    "bias0.001": {"balance_weight": 0.0, "bias_update_rate": 0.001},
    "bias0.1": {"balance_weight": 0.0, "bias_update_rate": 0.1},
}
"""The balancing-settings table's balancings, by arm-name suffix: the two balance losses with
the step's 128 tokens split into 8 micro-batches of 16 (``mb8``, ``gb8``: with 2 tokens per
expert in a micro-batch at ``N = 8`` the micro-batch loss's expert fractions are noisy, where a
global-batch loss should differ from it if anywhere), and bias balancing at a tenth and ten
times the balancing table's rate (``bias0.001`` is Megatron-Core's and DeepSeek-V3's default;
2 micro-batches as in the balancing table)."""

SCORES = {
    "sig": {"score": "sigmoid"},
    "sigbias": {"score": "sigmoid", "balance_weight": 0.0, "bias_update_rate": 0.01},
}
"""The scores table's routings, by arm-name suffix: sigmoid scores under the micro-batch
balance loss (``sig``) and sigmoid scores with bias balancing at the balancing table's rate and
no loss (``sigbias``: DeepSeek-V3's routing); 2 micro-batches as in the balancing table."""

BALANCING_REFERENCE = {"gb": "mb", "bias": "mb", "none": "mb", "mb8": "mb", "gb8": "mb8",
                       "bias0.001": "bias", "bias0.1": "bias", "sig": "mb", "sigbias": "bias"}
"""Suffix -> the balancing each arm is compared with, same estimator: every balancing of the
balancing table with the micro-batch loss; ``mb8`` with ``mb`` (what 8 micro-batches do to the
micro-batch loss), ``gb8`` with ``mb8`` (the global-batch loss against the micro-batch loss at
8 micro-batches) and each bias rate with the balancing table's rate 0.01."""


def balancing_settings_table() -> list[Arm]:
    """The balancing table's estimators at ``N = 8`` (``k = 2``, then ``k = 1``) under
    :data:`BALANCING_SETTINGS`: more micro-batches for the two balance losses, other bias
    rates. Read with the balancing table's arms (``--merge``), which it is compared with."""
    return _estimator_arms(((2, 8), (1, 8)), BALANCING_SETTINGS)


def scores_table() -> list[Arm]:
    """The balancing table's estimators under sigmoid scores (:data:`SCORES`), ``k = 2`` at
    ``N = 8`` and ``16``, then ``k = 1`` (where only SparseMixer composes: the others' one
    renormalised gate is always 1, and their arms are listed as refused). Read with the
    balancing table's arms (``--merge``): each arm is compared with top-k under the same
    routing and with the same estimator under softmax scores and the same balancing."""
    return _estimator_arms(((2, 8), (2, 16), (1, 8), (1, 16)), SCORES)


TABLES = {"main": main_table, "depth": depth_table, "gate": gate_table,
          "successors": successors_table, "robustness": robustness_table,
          "balancing": balancing_table, "balancing_settings": balancing_settings_table,
          "scores": scores_table, "quick": quick_table}


# The arms each table's plot shows (experiments.router_bench).
PLOT_ARMS = {
    "main": ["switch", "sparsemixer", "sparsemixer_nomask", "sparsemixer_eps0.5",
             "switch_eps0.5", "dense_params", "dense_flops"],
    "depth": ["switch_depth3", "sparsemixer_depth3", "sparsemixer_1st_depth3",
              "dense_params_depth3"],
    "gate": ["switch_softgate", "sparsemixer_softgate", "sparsemixer_1st_softgate",
             "sparsemixer_nomask_softgate"],
    "successors": ["switch", "sparsemixer", "densemixer", "densemixer_blog", "default_moe",
                   "default_moe_forward"],
    "robustness": ["switch_i16", "sparsemixer_i16", "densemixer_i16", "switch_p16",
                   "sparsemixer_p16", "densemixer_p16"],
    "balancing": ["switch_k2_n8_mb", "switch_k2_n8_gb", "switch_k2_n8_bias", "switch_k2_n8_none",
                  "sparsemixer_v2_k2_n8_mb", "sparsemixer_v2_k2_n8_gb"],
    "balancing_settings": ["switch_k2_n8_mb8", "switch_k2_n8_gb8", "switch_k2_n8_bias0.001",
                           "switch_k2_n8_bias0.1", "densemixer_k2_n8_mb8",
                           "densemixer_k2_n8_gb8"],
    "scores": ["switch_k2_n8_sig", "sparsemixer_v2_k2_n8_sig", "switch_k2_n8_sigbias",
               "sparsemixer_v2_k2_n8_sigbias", "densemixer_k2_n8_sigbias"],
    "quick": ["switch", "sparsemixer", "dense_flops"],
}
