"""Known answers for the router-learning benchmark (lab.router_bench).

The training tests share tiny configurations so that each compiled program is built once.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lab.router_bench import metrics, report
from lab.router_bench.arms import SUCCESSORS, TABLES, Arm, baseline_of
from lab.router_bench.student import Student
from lab.router_bench.teacher import (
    TeacherConfig,
    make_data,
    make_teacher,
    teacher_forward,
)
from lab.router_bench.train import TrainConfig, train_arm
from sparsemixer_jax.routers import ESTIMATORS, ROUTERS, router_probs

TINY = TrainConfig(dim=8, hidden=16, teacher_hidden=4, batch=64, steps=300, eval_every=100,
                   lr=1e-2, train_size=1024, eval_size=256, grad_tokens=64)


# --------------------------------------------------------------------------- teacher


def test_margin_keeps_only_inputs_far_from_boundaries():
    cfg = TeacherConfig(dim=8, num_experts=4, hidden=4, depth=2, margin=0.5, train_size=512,
                        eval_size=128)
    teacher = make_teacher(jax.random.key(0), cfg)
    data = make_data(teacher, jax.random.key(1), cfg)
    _, experts, gaps = teacher_forward(teacher, jnp.asarray(data.train_x))
    assert float(jnp.min(gaps)) >= 0.5
    assert 0.0 < data.acceptance < 1.0  # the margin did reject some inputs
    # The labels are the teacher's, and the evaluation experts are its choices.
    y, e_eval, _ = teacher_forward(teacher, jnp.asarray(data.eval_x))
    np.testing.assert_allclose(np.asarray(y), data.eval_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(e_eval), data.eval_experts)
    assert len(np.unique(np.asarray(experts))) == 4  # every expert is used


def test_teacher_experts_differ_and_are_unit_rms():
    cfg = TeacherConfig(dim=8, num_experts=4, hidden=4)
    teacher = make_teacher(jax.random.key(3), cfg)
    x = jax.random.normal(jax.random.key(4), (2048, 8))
    from lab.router_bench.teacher import _experts_all

    outputs = _experts_all(teacher, 0, x)
    rms = jnp.sqrt(jnp.mean(outputs**2, axis=(1, 2)))
    np.testing.assert_allclose(np.asarray(rms), 1.0, rtol=0.1)
    gap = jnp.mean((outputs[0] - outputs[1]) ** 2)
    assert float(gap) > 0.5  # two experts disagree by about their own scale


# --------------------------------------------------------------------------- metrics


def test_partition_agreement_is_invariant_to_relabelling():
    rng = np.random.default_rng(0)
    teacher = rng.integers(0, 4, 1000)
    perm = np.array([2, 0, 3, 1])
    counts = metrics.confusion(jnp.asarray(perm[teacher]), jnp.asarray(teacher), 4, 4)
    assert metrics.partition_agreement(np.asarray(counts)) == 1.0
    noisy = np.where(rng.random(1000) < 0.3, rng.integers(0, 4, 1000), perm[teacher])
    counts = np.asarray(metrics.confusion(jnp.asarray(noisy), jnp.asarray(teacher), 4, 4))
    expected = np.mean(noisy == perm[teacher])
    assert metrics.partition_agreement(counts) == pytest.approx(expected)


def test_purity_counts_split_regions_agreement_does_not():
    teacher = np.repeat(np.arange(2), 100)
    student = np.concatenate([np.zeros(100), np.repeat([1, 2], 50)]).astype(int)  # split
    counts = np.asarray(metrics.confusion(jnp.asarray(student), jnp.asarray(teacher), 3, 2))
    assert metrics.partition_purity(counts) == 1.0
    assert metrics.partition_agreement(counts) == pytest.approx(0.75)


def test_paired_statistics_state_the_standard_error():
    base = np.array([10.0, 20.0, 30.0, 40.0])
    arm = base + np.array([1.0, 2.0, 3.0, 2.0])
    p = metrics.paired(arm, base)
    assert p.mean == pytest.approx(2.0)
    assert p.se == pytest.approx(np.std([1, 2, 3, 2], ddof=1) / 2.0)
    assert (p.below, p.n) == (0, 4)
    # Unpaired, the spread between seeds would swamp the difference; paired it does not.
    assert p.se < np.std(arm, ddof=1) / 2.0 / 10


def test_steps_to_threshold():
    curves = np.array([[1.0, 0.5, 0.2], [1.0, 0.9, 0.8]])
    got = metrics.steps_to_threshold(curves, np.array([0, 10, 20]), 0.5)
    assert got[0] == 10 and math.isnan(got[1])


@pytest.mark.parametrize("router", [
    pytest.param("switch", marks=pytest.mark.slow), "sparsemixer", "sparsemixer_nomask"])
def test_exact_router_gradient_matches_direct_differentiation(router):
    """The oracle-based gradient equals ``jax.grad`` of the enumerated expected loss."""
    n, d, b = 4, 3, 5
    keys = jax.random.split(jax.random.key(7), 6)
    logits = 2.0 * jax.random.normal(keys[0], (b, n))
    x = jax.random.normal(keys[1], (b, d))
    target = jax.random.normal(keys[2], (b, d))
    params = (jax.random.normal(keys[3], (n, d, 6)), jnp.zeros((n, 6)),
              jax.random.normal(keys[4], (n, 6, d)), jnp.zeros((n, d)))
    omega = 1.0 + 0.1 * jax.random.normal(keys[5], (d,))
    probs_fn = metrics.oracle_probs_fn(router, 0.3)
    kernel, bias = metrics.exact_router_grad(logits, x, target, params, omega, probs_fn)

    f = jnp.einsum("bnh,nhd->bnd", jax.nn.relu(jnp.einsum("bd,ndh->bnh", x, params[0])),
                   params[2])

    def expected_loss(w, c):
        z = logits + x @ w + c  # perturbation of the router's kernel and bias, at zero
        pi = jax.vmap(probs_fn)(z)
        per = jnp.mean(jnp.square(omega * pi[..., None] * f - target[:, None]), axis=-1)
        return jnp.mean(jnp.sum(pi * per, axis=-1))

    gw, gc = jax.grad(expected_loss, argnums=(0, 1))(jnp.zeros((d, n)), jnp.zeros(n))
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(gw), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(bias), np.asarray(gc), rtol=1e-4, atol=1e-6)
    assert router != "switch" or probs_fn(logits[0]).min() > 0  # Switch's objective is unmasked
    if router == "sparsemixer":
        assert float(jnp.min(router_probs(logits, 0.3))) == 0.0  # the mask is in play


# --------------------------------------------------------------------------- arms


def test_every_arm_has_a_switch_baseline():
    for table in TABLES.values():
        arms = {a.name: a for a in table()}
        for arm in arms.values():
            base = baseline_of(arm, arms)
            if arm.router == "switch" and arm.dense is None and arm.jitter_eps == 0.1:
                continue
            assert base is not None, arm.name
            other = arms[base]
            assert other.router == "switch" and other.setting() == arm.setting(), arm.name


def test_one_expert_student_is_dense_for_every_router():
    """N = 1: every router's gate is exactly 1, so each arm is the dense model of its width.

    Except that SparseMixer-2nd halves its training output on the argmax too (its known gap
    between training and inference), so there the dense model's output is halved."""
    x = jax.random.normal(jax.random.key(0), (32, 8))
    y = jax.random.normal(jax.random.key(1), (32, 8))
    dense = Arm("dense", dense="flops", num_experts=1)

    def loss_and_expert_grads(arm, scale=1.0):
        model = Student(arm, 8, 16, rngs=nnx.Rngs(params=0, router=1))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            pred, _ = nnx.merge(graphdef, p, rest, copy=True)(x)
            pred = scale * pred
            return jnp.mean(jnp.square(pred - y))

        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        layer = grads["layers"][0]
        router = layer["router"]
        router_norm = float(jnp.abs(router["kernel"][...]).sum()
                            + jnp.abs(router["bias"][...]).sum())
        return float(value), np.asarray(layer["wi"][...]), router_norm

    references = {}  # the dense model at each output scale, computed once
    for name, (_, options) in ROUTERS.items():
        rule = ESTIMATORS[options.get("estimator", "mix")]
        scale = rule.reduced_weight if name != "switch" and rule.on_argmax else 1.0
        if scale not in references:
            references[scale] = loss_and_expert_grads(dense, scale)
        ref_value, ref_wi, _ = references[scale]
        value, wi, router_norm = loss_and_expert_grads(
            dataclasses.replace(dense, name=name, router=name, dense=None))
        assert value == pytest.approx(ref_value, rel=1e-6), name
        np.testing.assert_allclose(wi, ref_wi, rtol=1e-5, atol=1e-7, err_msg=name)
        assert router_norm == 0.0, name


# --------------------------------------------------------------------------- training


ORACLE = Arm("oracle", num_experts=4, oracle_router=True, margin=0.5)
ORACLE_CFG = TINY._replace(measure_gradient=False, steps=600)


@pytest.fixture(scope="module")
def oracle_run():
    return train_arm(ORACLE, ORACLE_CFG, [0, 1])[0]


def test_student_with_the_teachers_router_reaches_the_noise_floor(oracle_run):
    floor = TINY.noise**2
    final_train = oracle_run.train_mse[:, -1]
    assert np.all(final_train < 1.5 * floor), final_train
    assert np.all(final_train > 0.7 * floor), final_train  # cannot beat the label noise
    assert np.all(oracle_run.eval_mse[:, -1] < floor), oracle_run.eval_mse[:, -1]
    agreement = [metrics.partition_agreement(c[0]) for c in oracle_run.confusion[:, -1]]
    assert min(agreement) == 1.0


@pytest.fixture(scope="module")
def one_expert_teacher_runs():  # three compiled programs: about a minute on 2 busy cores
    cfg = TINY._replace(measure_gradient=False)
    arms = [Arm("switch", num_experts=2, teacher_experts=1),
            Arm("sparsemixer", router="sparsemixer", num_experts=2, teacher_experts=1),
            Arm("dense", dense="flops", num_experts=2, teacher_experts=1)]
    return {a.name: train_arm(a, cfg, [0, 1, 2])[0] for a in arms}


@pytest.mark.slow
def test_one_expert_teacher_every_arm_learns_like_the_dense_model(one_expert_teacher_runs):
    runs = one_expert_teacher_runs
    dense = runs["dense"].eval_mse[:, -1]
    start = runs["dense"].eval_mse[:, 0]
    for name in ("switch", "sparsemixer"):
        final = runs[name].eval_mse[:, -1]
        # Both reach a small fraction of where they started, within a factor of the dense model.
        assert np.all(final < 0.2 * start), (name, final, start)
        ratio = np.exp(np.mean(np.log(final / dense)))
        assert 0.25 < ratio < 4.0, (name, ratio)


def test_fixed_seed_reproduces_its_curve_exactly(oracle_run):
    again = train_arm(ORACLE, ORACLE_CFG, [0, 1])[0]  # the same compiled program, rerun
    first = oracle_run
    np.testing.assert_array_equal(again.eval_mse, first.eval_mse)
    np.testing.assert_array_equal(again.train_mse, first.train_mse)
    other = train_arm(ORACLE, ORACLE_CFG, [5, 1])[0]
    assert not np.array_equal(other.eval_mse[0], first.eval_mse[0])  # the seed matters
    np.testing.assert_array_equal(other.eval_mse[1:], first.eval_mse[1:])  # seeds independent


@pytest.mark.slow
def test_report_rows_pair_by_seed(one_expert_teacher_runs):
    arms = {"switch": Arm("switch", num_experts=2, teacher_experts=1),
            "sparsemixer": Arm("sparsemixer", router="sparsemixer", num_experts=2,
                               teacher_experts=1)}
    results = {n: report.summarise(a, one_expert_teacher_runs[n], {}) for n, a in arms.items()}
    rows = {r["arm"]: r for r in report.paired_rows(results)}
    got = rows["sparsemixer"]["dlog_mse"]
    want = metrics.paired(np.log(one_expert_teacher_runs["sparsemixer"].eval_mse[:, -1]),
                          np.log(one_expert_teacher_runs["switch"].eval_mse[:, -1]))
    assert got.mean == pytest.approx(want.mean, abs=1e-4) and got.n == 3
    assert "sparsemixer" in report.markdown_table(results)


# --------------------------------------------------------------------------- successors


def test_successors_table_pairs_every_router_with_switch_of_its_setting():
    arms = {a.name: a for a in TABLES["successors"]()}
    settings = {"": (8, 0.5, 1), "_n16": (16, 0.5, 1), "_margin0.0": (8, 0.0, 1)}
    for suffix, (n, margin, k) in settings.items():
        for router in SUCCESSORS:
            arm = arms[router + suffix]
            assert (arm.router, arm.num_experts, arm.margin, arm.top_k) == (router, n, margin, k)
            want = None if router == "switch" else "switch" + suffix
            assert baseline_of(arm, arms) == want, arm.name
            # The exact-gradient cosine only in the main setting (it doubles compile time).
            assert arm.measure_gradient == (suffix == ""), arm.name
    for router in ("densemixer", "default_moe", "default_moe_forward"):
        assert baseline_of(arms[f"{router}_top2"], arms) == "switch_top2"
        assert arms[f"{router}_top2"].top_k == 2
    assert len(arms) == 3 * len(SUCCESSORS) + 4


@pytest.mark.parametrize("router", ["switch", "densemixer", "densemixer_blog", "default_moe",
                                    "default_moe_st"])
def test_oracle_probabilities_of_switch_forward_routers_are_the_plain_softmax(router):
    """DenseMixer and Default MoE route as Switch does: their objective samples from the
    unmasked softmax, not SparseMixer's masked one."""
    logits = jnp.array([3.0, 2.9, 0.0, -2.0])  # the reference mask at eps 0.1 keeps two
    assert float(jnp.min(router_probs(logits, 0.1))) == 0.0
    np.testing.assert_allclose(np.asarray(metrics.oracle_probs_fn(router, 0.1)(logits)),
                               np.asarray(jax.nn.softmax(logits)), rtol=1e-6)


def test_training_flops_per_token_of_each_router():
    emb, mlp, n = 16, 32, 8
    expert = 2 * (2 * emb * mlp)
    switch = 3 * (2 * emb * n + expert)
    assert report.train_flops_per_token(Arm("s"), emb, mlp) == switch == 6912
    assert report.train_flops_per_token(Arm("m", router="sparsemixer"), emb, mlp) == switch
    for name in ("densemixer", "densemixer_blog"):  # + dense forward pass + the term
        assert report.train_flops_per_token(Arm(name, router=name), emb, mlp) == (
            switch + n * expert + 4 * n * emb)
    for name in ("default_moe", "default_moe_st"):  # + the term + the EMA update
        assert report.train_flops_per_token(Arm(name, router=name), emb, mlp) == (
            switch + 4 * n * emb + emb)
    top2 = report.train_flops_per_token(Arm("t", top_k=2), emb, mlp)
    assert top2 == 3 * (2 * emb * n + 2 * expert)
    assert report.train_flops_per_token(Arm("d", router="densemixer", top_k=2), emb, mlp) == (
        top2 + n * expert + 4 * n * emb)


DEFAULT_MOE = Arm("default_moe", router="default_moe", num_experts=4)
SUCCESSOR_CFG = TINY._replace(measure_gradient=False)


@pytest.fixture(scope="module")
def default_moe_run():
    return train_arm(DEFAULT_MOE, SUCCESSOR_CFG, [0, 1])[0]


def test_default_moe_defaults_track_each_experts_mean_output(default_moe_run):
    """The default vectors live in the scan's carry: after training each is the running mean of
    its expert's outputs (zeros at init; one EMA step alone would give a tenth of it)."""
    params, rest = default_moe_run.final_state
    defaults = np.asarray(rest["layers"][0]["expert_defaults"][...])  # [S, N, d]
    assert defaults.shape == (2, 4, SUCCESSOR_CFG.dim)
    assert np.all(np.linalg.norm(defaults, axis=-1) > 0)
    assert not np.allclose(defaults[0], defaults[1])  # each seed its own
    graphdef = nnx.split(Student(DEFAULT_MOE, SUCCESSOR_CFG.dim, SUCCESSOR_CFG.hidden,
                                 rngs=nnx.Rngs(0)), nnx.Param, ...)[0]
    x = jax.random.normal(jax.random.key(3), (1024, SUCCESSOR_CFG.dim))
    checked = 0
    for s in range(2):
        seed_state = jax.tree.map(lambda a, s=s: a[s], (params, rest))
        layer = nnx.merge(graphdef, *seed_state).layers[0]
        choice = jnp.argmax(layer.router(x), axis=-1)
        wi, bi, wo, bo = (p[...] for p in (layer.wi, layer.bi, layer.wo, layer.bo))
        outputs = jnp.einsum("bh,bhd->bd", jax.nn.relu(jnp.einsum("bd,bdh->bh", x, wi[choice])
                                                       + bi[choice]), wo[choice]) + bo[choice]
        for i in range(4):
            if int(jnp.sum(choice == i)) < 50:
                continue
            mean = np.asarray(jnp.mean(outputs[choice == i], axis=0))
            rel = np.linalg.norm(defaults[s, i] - mean) / np.linalg.norm(mean)
            assert rel < 0.35, (s, i, rel)
            checked += 1
    assert checked >= 4


def test_default_moe_run_is_reproducible(default_moe_run):
    again = train_arm(DEFAULT_MOE, SUCCESSOR_CFG, [0, 1])[0]
    np.testing.assert_array_equal(again.eval_mse, default_moe_run.eval_mse)
    np.testing.assert_array_equal(
        np.asarray(again.final_state[1]["layers"][0]["expert_defaults"][...]),
        np.asarray(default_moe_run.final_state[1]["layers"][0]["expert_defaults"][...]))


def test_densemixer_trains_with_finite_loss_and_measured_gradient():
    arm = Arm("densemixer", router="densemixer", num_experts=4)
    history, timings = train_arm(arm, TINY, [0, 1])
    assert np.all(np.isfinite(history.train_mse[:, 1:]))
    assert np.all(history.eval_mse[:, -1] < 0.5 * history.eval_mse[:, 0]), history.eval_mse
    cos = history.grad_cos
    assert np.all(np.isfinite(cos)) and np.all(np.abs(cos) <= 1.0 + 1e-6), cos
    assert timings["compile_s"] > 0 and timings["run_s"] > 0


# --------------------------------------------------------------------------- robustness


def test_tanh_teacher_expert_is_exactly_tanh_of_x_w():
    cfg = TeacherConfig(dim=8, num_experts=4, hidden=4, activation="tanh")
    teacher = make_teacher(jax.random.key(5), cfg)
    x = jax.random.normal(jax.random.key(6), (256, 8))
    y, experts, _ = teacher_forward(teacher, x, 0.0, "tanh")
    w = np.asarray(teacher.w1[0])[np.asarray(experts[0])]  # [B, d, d]: each token's W_D
    want = np.tanh(np.einsum("bd,bde->be", np.asarray(x), w))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    assert len(np.unique(np.asarray(experts))) == 4


def test_robustness_flips_change_one_setup_choice_each():
    arms = {a.name: a for a in TABLES["robustness"]()}
    shared = {"teacher_gate_scale", "lr_mult"}
    for name, arm in arms.items():
        parts = name.split("_")
        if parts[-1][0] in "ip" and parts[-1][1:].isdigit():
            continue  # a corner
        corner = arms[name.rsplit("_", 1)[0]]
        changed = {f.name for f in dataclasses.fields(Arm)
                   if getattr(arm, f.name) != getattr(corner, f.name)} - {"name"}
        if arm.student_family is not None:  # the other corner's teacher or student family
            other = arms[f"switch_{'p' if '_i' in name else 'i'}{arm.num_experts}"]
            teacher_moved = arm.family != corner.family
            assert arm.family == (other.family if teacher_moved else corner.family), name
            assert arm.student_experts == (corner.family if teacher_moved else other.family)
            assert arm.family != arm.student_experts, name
            continue
        assert len(changed) == 1, (name, changed)
        if changed <= shared:
            continue
        other = "p" if "_i" in name else "i"
        other_corner = arms[f"switch_{other}{arm.num_experts}"]
        field = changed.pop()
        want = getattr(other_corner, field) if field != "omega" else (not corner.omega)
        assert getattr(arm, field) == want, name  # the other corner's level
    assert not any("omega" in n and not n.startswith("sparsemixer") for n in arms)
    halves = [n for n, a in arms.items() if a.student_family is not None]
    assert len(halves) == 16  # 4 routers x 2 corners x 2 halves, at N = 16


def test_student_family_sets_the_students_experts_and_leaves_the_teacher():
    cfg = TINY._replace(dim=8, hidden=12)
    arm = Arm("switch_mixed", family="tanh", student_family="mlp")
    assert cfg.teacher(arm).activation == "tanh" and cfg.student_hidden(arm) == 12
    student = Student(arm, cfg.dim, cfg.student_hidden(arm), rngs=nnx.Rngs(0))
    assert student.layers[0].moe.activation == "relu"
    arm = Arm("switch_mixed", family="mlp", student_family="tanh")
    assert cfg.teacher(arm).activation == "relu" and cfg.student_hidden(arm) == 8
    student = Student(arm, cfg.dim, cfg.student_hidden(arm), rngs=nnx.Rngs(0))
    assert student.layers[0].moe.activation == "tanh"
    with pytest.raises(ValueError, match="student_family must be one of"):
        Arm("bad", student_family="gelu")


ROBUST = Arm("sparsemixer_robust", router="sparsemixer", num_experts=4, family="tanh",
             fresh_data=True, margin=0.5, batch=32, omega=False, balance_weight=0.0)


@pytest.fixture(scope="module")
def robust_run():  # one compiled program
    return train_arm(ROBUST, TINY._replace(measure_gradient=False), [0, 1])[0]


def test_frozen_omega_stays_one_and_fresh_tanh_student_learns(robust_run):
    params, _ = robust_run.final_state
    omega = np.asarray(params["layers"][0]["omega"][...])
    np.testing.assert_array_equal(omega, 1.0)
    wi = np.asarray(params["layers"][0]["wi"][...])
    assert wi.shape == (2, 4, 8, 8)  # tanh family: experts as wide as the model
    final, start = robust_run.eval_mse[:, -1], robust_run.eval_mse[:, 0]
    assert np.all(np.isfinite(final)) and np.all(final < 0.5 * start), (final, start)


def test_summary_of_a_run_without_gradient_measure_raises_no_warning(robust_run):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = report.summarise(ROBUST, robust_run, {})
    assert summary["curves_mean"]["zero_grad"][0] is None or math.isnan(
        summary["curves_mean"]["zero_grad"][0])  # step 0: no training step measured yet
    assert summary["curves_mean"]["grad_cos"] is None


def test_default_output_is_outside_the_tracked_files_and_reuse_matches_config(tmp_path):
    import json

    from experiments import router_bench as cli

    assert cli.parse_args(["--quick"]).out == "runs/router_bench/quick.json"
    arms = [Arm("switch_p8", measure_gradient=False), Arm("switch_i8", family="tanh")]
    saved = {"config": TINY._asdict(), "arms": {"switch": {
        "arm": dataclasses.asdict(Arm("switch")), "per_seed": {"final_eval_mse": [0.1, 0.2]}}}}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    got = report.reused(str(path), arms, TINY, 2)
    assert list(got) == ["switch_p8"] and got["switch_p8"]["reused_from"] == "switch"
    assert report.reused(str(path), arms, TINY._replace(batch=7), 2) == {}  # other run settings
    assert report.reused(str(path), arms, TINY, 3) == {}  # other seeds


def test_robustness_summary_pairs_each_router_with_its_settings_switch(robust_run):
    from lab.router_bench.arms import robustness_arm

    summary = report.summarise(ROBUST, robust_run, {})
    results = {arm.name: {**summary, "arm": dataclasses.asdict(arm)} for arm in (
        robustness_arm("switch", "i", 8), robustness_arm("sparsemixer", "i", 8),
        robustness_arm("sparsemixer", "i", 8, "omega"))}
    table = report.markdown_robustness_table(results).splitlines()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table[2:]}
    assert set(rows) == {"i8", "i8_omega"}  # omega: paired with the corner's Switch
    for line in rows.values():  # the same runs: every difference is exactly zero
        assert "| +0.00 ± 0.00 | 0/2 | +0.00 ± 0.00 | – | – | – |" in line, line
