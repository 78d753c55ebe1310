"""Fine-tuning: policies (frozen routers, a learning rate of their own, training only some
roles) and the routing diagnostics logged at each evaluation.

The labels of every task's model (translation, ELECTRA, language model), the optimizer's update
against the hand-computed AdamW step, the one-line errors, and a fine-tuning run of the tiny
Mixtral checkpoint under a policy: its frozen parameters bitwise unchanged, its resume bitwise
the uninterrupted run (tests/kit's resume test, with this module's ``task``), its routing churn,
load and collapse warnings. The runs share one compilation of the policy's train step.
"""

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import training
from sparsemixer_jax.moe.layer import routing_param_paths
from sparsemixer_jax.tasks import check_config, run_config
from sparsemixer_jax.tasks.language_model import LMTask, train_lm
from sparsemixer_jax.training.hosts import BatchPlacer
from sparsemixer_jax.training.optim import OptimSettings, ParamRoles, make_optimizer, param_labels
from sparsemixer_jax.training.routing_watch import CollapseRule, RoutingWatch
from sparsemixer_jax.training.state import restore_checkpoint
from sparsemixer_jax.training.steps import Steps
from tests import kit, tiny_lm_config
from tests.test_lm_task import HF_DATA, _word_tokenizer

# Experts frozen, routers at twice the rate of the rest: all three labels in one run.
POLICY = {"optim.train_only": "non_experts", "optim.router_lr_scale": 2.0}
EXPERT_NAMES = ("w_gate", "w_up", "w_down", "omega")  # the tiny LM's (SparseMixer-v2*: omega)


def _config(corpus, **overrides):
    """The tiny language model from scratch, under the policy."""
    return kit.tiny_config("lm", corpus, **{"data.wikitext": "", "sample.tokens": 0, **POLICY,
                                            **overrides})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tiny_lm_config.write_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def finetune_config(corpus, tmp_path_factory):
    """``config(**overrides)``: fine-tuning ``tests/data/hf/mixtral`` (3 layers of 6 experts,
    top-3, Switch routing) with a word-level tokenizer, under the policy."""
    path = str(tmp_path_factory.mktemp("ckpt") / "mixtral")
    shutil.copytree(os.path.join(HF_DATA, "mixtral"), path)
    _word_tokenizer(corpus, 97).save(os.path.join(path, "tokenizer.json"))
    return lambda **overrides: _config(corpus, init_from=path, **overrides)


@pytest.fixture(scope="module")
def task(finetune_config):
    return kit.Task("lm", lambda workdir, **o: train_lm(finetune_config(**o), workdir))


@pytest.fixture(scope="module")
def task_steps(finetune_config):
    config = finetune_config()
    return training.build_steps(run_config(config), config.data.vocab_size)


# The resume test every training task runs, here under the policy.
test_extending_a_run_equals_the_uninterrupted_run = (
    kit.test_extending_a_run_equals_the_uninterrupted_run)


def _paths(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _abstract_params(config):
    run = check_config(config)
    task = run.task
    model = nnx.eval_shape(lambda: task.build_model(run, 120, None))
    return model, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("name", ["translation", "pretraining", "lm"])
def test_every_tasks_routers_and_experts_are_labelled(name, corpus):
    """Each MoE layer's router, experts and omega by role; everything else (ELECTRA's dense
    generator with its own ``wi``/``wo``, attention, embeddings) is neither."""
    config = kit.tiny_config(name, None if name == "translation" else corpus)
    model, params = _abstract_params(config)
    roles = _paths(jax.tree_util.tree_map_with_path(
        lambda path, _: ParamRoles(*routing_param_paths(model)).role(
            tuple(str(getattr(k, "key", k)) for k in path)), params))
    routers = sorted(p for p, r in roles.items() if r == "router")
    experts = sorted(p for p, r in roles.items() if r == "expert")
    layers = sorted({p.rsplit("/router/", 1)[0] for p in routers})
    assert layers and all(p.rsplit("/", 1)[0].endswith("router") for p in routers)
    names = {"translation": ("wi", "bi", "wo", "bo", "omega"),
             "pretraining": ("wi", "bi", "wo", "bo", "omega"), "lm": EXPERT_NAMES}[name]
    assert experts == sorted(f"{layer}/{n}" for layer in layers for n in names)
    others = [p for p, r in roles.items() if r == "other"]
    assert others and not any(p.startswith(tuple(f"{layer}/" for layer in layers))
                              for p in others)
    if name == "pretraining":
        assert roles["generator/layers/0/ffn/wi/kernel"] == "other"


def test_the_update_is_the_hand_computed_adamw_step_per_role(corpus):
    """The first update of AdamW is ``-lr * g / (|g| + eps)`` (its moments' bias corrections
    cancel); the routers' is ``router_lr_scale`` times that, a frozen parameter's is zero. On the
    tiny language model's parameters, with random gradients."""
    model, params = _abstract_params(_config(corpus))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: np.ones(s.shape, np.float32), params)
    grads = jax.tree.map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)
    roles = ParamRoles(*routing_param_paths(model))
    base = OptimSettings(schedule="linear", peak_lr=1e-2, warmup_steps=0, decay_steps=10)
    lr = 1e-2 * 9 / 10  # update 1 of the linear decay to 0 at update 10
    policies = [({"router_lr_scale": 3.0}, {"router": 3.0, "expert": 1.0}),
                ({"train_routers": False}, {"router": 0.0, "expert": 1.0}),
                ({"train_only": "routers", "router_lr_scale": 0.5},
                 {"router": 0.5, "expert": 0.0, "other": 0.0}),
                ({"train_only": "experts"}, {"router": 0.0, "other": 0.0})]
    optims = [OptimSettings(**{**vars(base), **policy, "roles": roles}).check()
              for policy, _ in policies]

    @jax.jit  # every policy's first update in one compilation
    def first_updates(grads, params):
        return [make_optimizer(o).update(grads, make_optimizer(o).init(params), params)[0]
                for o in optims]

    labels = _paths(jax.tree_util.tree_map_with_path(
        lambda path, _: roles.role(tuple(str(getattr(k, "key", k)) for k in path)), params))
    gradients = {path: np.asarray(g) for path, g in _paths(grads).items()}
    for (_, scales), updates in zip(policies, first_updates(grads, params), strict=True):
        for path, update in _paths(updates).items():
            g = gradients[path]
            expected = -scales.get(labels[path], 1.0) * lr * g / (np.abs(g) + base.eps)
            # A few float32 roundings apart: the moments and their bias corrections.
            np.testing.assert_allclose(update, expected, rtol=1e-6, atol=1e-12, err_msg=path)


@pytest.mark.parametrize("train_only, experts_train", [("experts", True),
                                                       ("non_experts", False)])
def test_gpt_oss_expert_biases_are_the_experts(train_only, experts_train):
    """gpt-oss's experts have biases (``gate_up_proj_bias``, ``down_proj_bias``: the layer's
    ``b_gate``, ``b_up``, ``b_down``): ``train_only="experts"`` trains them with the experts'
    weights and ``"non_experts"`` freezes them, as it freezes the weights; the router's weight
    and bias and attention's sinks follow the other side."""
    from sparsemixer_jax import hf
    from sparsemixer_jax.models.causal_lm import CausalLM

    config = hf.from_hf(hf.read_config(os.path.join(HF_DATA, "gpt_oss")))
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    optim = OptimSettings(train_only=train_only, roles=ParamRoles(*routing_param_paths(model)))
    labels = _paths(param_labels(optim, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    moe = [p for p in labels if "/mlp/moe/" in p]
    trained = {p.rsplit("/", 1)[1] for p in moe if labels[p] != "frozen"}
    frozen = {p.rsplit("/", 1)[1] for p in moe if labels[p] == "frozen"}
    experts = {"w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"}
    assert (trained if experts_train else frozen) == experts
    assert (frozen if experts_train else trained) == {"kernel", "bias"}  # the router's
    assert {labels[p] for p in labels if p.endswith("/sinks")} == \
        {"frozen" if experts_train else "rest"}


def test_frozen_gradients_do_not_clip_the_trained_ones():
    """Clipping by global norm measures the trained parameters' gradients only."""
    params = {"router": {"kernel": jnp.ones((2, 2))}, "wi": jnp.ones((2, 3))}
    grads = {"router": {"kernel": jnp.full((2, 2), 0.1)}, "wi": jnp.full((2, 3), 100.0)}
    roles = ParamRoles(routers=(("router",),), experts=(("wi",),))
    optim = OptimSettings(peak_lr=1.0, clip_norm=1.0, b1=0.0, b2=0.0, eps=1.0,
                          train_only="routers", roles=roles)
    tx = make_optimizer(optim)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    # Unclipped (norm 0.2 < 1): -lr * g / (|g| + eps) with b1 = b2 = 0.
    np.testing.assert_allclose(updates["router"]["kernel"], -0.1 / 1.1, rtol=1e-6)
    np.testing.assert_array_equal(updates["wi"], 0.0)
    assert jax.tree.leaves(param_labels(optim, params)) == ["router", "frozen"]


@pytest.mark.parametrize("overrides, message", [
    ({"optim.train_only": "heads"}, "config.optim.train_only='heads'; choose one of"),
    ({"optim.train_only": "routers", "optim.router_lr_scale": 1.0, "router.trainable": False},
     "train_only='routers' with config.router.trainable=False trains no parameter"),
    ({"router.trainable": False}, "router_lr_scale=2.0 has no effect: the routers do not train"),
    ({"optim.router_lr_scale": 0.0}, "config.optim.router_lr_scale must be > 0"),
])
def test_policy_errors_are_one_line(corpus, overrides, message):
    with pytest.raises(ValueError) as error:
        check_config(_config(corpus, **overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_policy_that_trains_nothing_of_the_model_is_one_line(corpus):
    config = _config(corpus, **{"model.num_experts": 0, "optim.train_only": "experts",
                                "optim.router_lr_scale": 1.0})
    run = run_config(config)
    model = nnx.eval_shape(lambda: run.task.build_model(run, 120, None))  # shapes only
    with pytest.raises(ValueError) as error:
        Steps(model, run.task, run.optim)
    assert "train_only='experts' trains no parameter of this model" in str(error.value)


def test_frozen_parameters_are_bitwise_unchanged_by_training(straight_run, task_steps,
                                                             last_checkpoint):
    """The experts (frozen by ``train_only=non_experts``) end the run as the checkpoint has
    them; the routers and the rest trained."""
    workdir, _ = straight_run
    trained, meta = last_checkpoint(workdir, task_steps)
    assert meta["step"] == 6
    start, end = _paths(task_steps.params), _paths(trained)
    for path, value in end.items():
        if path.rsplit("/", 1)[-1] in EXPERT_NAMES:
            np.testing.assert_array_equal(value, start[path], err_msg=path)
        else:
            assert not np.array_equal(value, start[path]), path


@pytest.fixture(scope="module")
def routing_at_start_and_end(finetune_config, straight_run, task_steps):
    """``(batches, place, start state, end state)`` of the fine-tuning run: its validation
    batches (read from the run's packing cache) and the train states of steps 0 and 6."""
    workdir, _ = straight_run
    config = finetune_config()
    task = LMTask.from_config(config)
    batches = task.load_data(workdir, 1).valid
    end = restore_checkpoint(workdir, task_steps.abstract_state(), "last").state
    start = task_steps.new_state(task_steps.params, task_steps.layer_state)
    return batches, BatchPlacer(None, task.batch_keys), start, end


def test_routing_churn_and_load_are_logged_at_each_evaluation(straight_run, task_steps,
                                                              routing_at_start_and_end):
    """metrics.jsonl holds each MoE layer's churn, max share and load entropy at steps 3 and
    6; at step 6 they equal what numpy computes from the two models' chosen experts."""
    workdir, results = straight_run
    records = [r for r in kit.read_metrics(workdir) if "valid_loss" in r]
    assert [r["step"] for r in records] == [3, 6]
    assert all(sorted(r["routing"]) == ["layer_0", "layer_1", "layer_2"] for r in records)
    batches, place, start, end = routing_at_start_and_end
    chosen = {"start": [], "end": []}
    for batch in batches:
        for name, state in (("start", start), ("end", end)):
            choices, mask = task_steps.routing(state, place(batch))
            chosen[name].append(({k: np.asarray(v) for k, v in choices.items()},
                                 np.asarray(mask)))
    for layer, logged in records[-1]["routing"].items():
        before = np.concatenate([c[layer][m] for c, m in chosen["start"]])  # [tokens, k]
        after = np.concatenate([c[layer][m] for c, m in chosen["end"]])
        assert before.shape[1] == 3 and np.all(np.diff(after, axis=1) > 0)  # sets of 3
        shares = np.bincount(after.astype(int).ravel(), minlength=6) / len(after)
        p = shares / shares.sum()
        # Counts of at most a few hundred tokens: exact in float32 and float64 alike.
        assert logged["churn"] == np.mean(np.any(before != after, axis=1))
        assert logged["max_share"] == shares.max()
        # The entropy in float32 (its sum over 6 terms), against numpy's float64.
        assert logged["load_entropy"] == pytest.approx(
            -np.sum(p * np.log(p)) / np.log(6), rel=1e-6)
    assert results["routing"] == records[-1]["routing"]  # the last evaluation's
    assert 0 < records[-1]["routing"]["layer_0"]["churn"] < 1  # trained routers moved some


def test_a_collapsing_layer_is_named_on_one_warning_line(task_steps, routing_at_start_and_end,
                                                         caplog):
    """With a share every layer reaches, each layer is named once, on the evaluation that
    completes the run of ``evaluations`` (counted on across a resumption); with a share no
    layer reaches, none is."""
    batches, place, start, end = routing_at_start_and_end
    watch = RoutingWatch(task_steps, start, batches, place, CollapseRule(0.01, 2))
    quiet = RoutingWatch(task_steps, start, batches, place, CollapseRule(1.0, 1))
    warned = []
    for step in (1, 2, 3):
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            watch.evaluate(step, task_steps, end)
            quiet.evaluate(step, task_steps, end)
        warned.append([r.getMessage() for r in caplog.records])
    assert warned[0] == warned[2] == []
    assert [m.split(": ")[1].split()[0] for m in warned[1]] == ["layer_0", "layer_1", "layer_2"]
    assert all(m.startswith("router collapse at step 2: ") and "\n" not in m for m in warned[1])
    # Resumed after one collapsed evaluation: the streak goes on; a record below the share
    # breaks it (layer_2).
    resumed = RoutingWatch(task_steps, start, batches, place, CollapseRule(0.01, 2))
    resumed.continue_from([{"step": 1, "valid_loss": 1.0, "routing": {
        layer: {"max_share": 0.5 if layer != "layer_2" else 0.0}
        for layer in ("layer_0", "layer_1", "layer_2")}}])
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        resumed.evaluate(2, task_steps, end)
    assert [r.getMessage().split(": ")[1].split()[0] for r in caplog.records] == [
        "layer_0", "layer_1"]
