"""Sharded parameters and optimizer state (FSDP over ``"fsdp"``, experts over ``"expert"``) on
the 8 simulated CPU devices: a few training steps equal the same steps on one device, for the
translation task through the training loop and for the decoder-only LM through the compiled
steps; a sharded run's checkpoint restores onto other mesh shapes; every parameter of every
model has logical axis names.

The one-device reference runs in a child process under the other implementation of XLA's
elementwise math (:func:`tests.kit.run_with_other_math`): the comparisons must hold across the
math libraries of every host, not only across summation orders. ``python -m tests.test_fsdp
translation WORKDIR`` and ``python -m tests.test_fsdp lm OUT.npz`` are those children.

Tolerances (derived in :mod:`tests.kit`): losses and gradient norms within
:func:`tests.kit.sum_rtol` of the longest chain of float32 additions a gradient element takes;
parameters within :func:`tests.kit.adam_parameter_atol`, with Adam in its linear regime
(``eps`` = :data:`tests.kit.LINEAR_ADAM_EPS`, above every gradient norm), where its update is
Lipschitz in the gradient. Routing decisions are the same in both runs: the routers' logits are
scaled to order 1, so that rounding cannot move a token to another expert.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys

if __name__ == "__main__":  # a reference child process: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from sparsemixer_jax import hf, training
from sparsemixer_jax.hf.families import family_of
from sparsemixer_jax.layers.rope import rope_cos_sin
from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.models.lm_config import MODEL_TYPES, LMConfig, LMExecution
from sparsemixer_jax.parallel import partitioning, sharding
from sparsemixer_jax.tasks import run_config, translation
from sparsemixer_jax.training.optim import OptimSettings, learning_rate_schedule
from sparsemixer_jax.training.state import restore_checkpoint
from sparsemixer_jax.training.steps import Steps
from tests import kit
from tests.tiny_wmt_config import tiny

STEPS = 5

# ------------------------------------------------------------------------- the decoder-only LM

LM = LMConfig.build(model_type="mixtral", vocab_size=64, hidden_size=16, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=8, intermediate_size=32, moe_intermediate_size=16,
              num_experts=4, top_k=2, moe_layers=(True, True, True), router="switch",
              jitter_eps=0.0, execution=LMExecution(dispatch="padded"))
LM_BATCH, LM_LEN = 8, 12
ROUTER_SCALE = 40.0  # routers' logits of order 1: a clear margin between the k-th and next
# Adam in its linear regime: an update of about 0.5 times the gradient's moving average.
LM_OPTIM = dataclasses.replace(OptimSettings.from_config(kit.tiny_config("translation").optim),
                               peak_lr=5.0, eps=kit.LINEAR_ADAM_EPS)
# The longest chain of float32 additions into a gradient element: the update's tokens (a weight
# gradient's sum over them) or, if longer, the layers times the widest contraction (the vocab).
LM_ADDITIONS = max(LM_BATCH * LM_LEN, LM.arch.num_layers * LM.arch.vocab_size)


@dataclasses.dataclass(frozen=True)
class NextTokenTask:
    """Next-token cross-entropy plus the routers' balance loss: what the steps call."""

    balance_weight: float = 0.01

    def loss(self, model, batch, key):
        del key  # the switch router without jitter draws nothing
        out = model.forward(batch["ids"][:, :-1])
        targets = batch["ids"][:, 1:]
        nll = optax.softmax_cross_entropy_with_integer_labels(out.logits, targets)
        tokens = jnp.asarray(targets.size, jnp.float32)
        sums = {"nll": jnp.sum(nll), "tokens": tokens, "balance_loss": out.aux["balance_loss"],
                "z_loss": out.aux["z_loss"]}
        return jnp.sum(nll) / tokens + self.balance_weight * out.aux["balance_loss"], sums

    def summarize(self, sums):
        return 1.0, {"loss": sums["nll"] / sums["tokens"], "balance_loss": sums["balance_loss"],
                     "z_loss": sums["z_loss"]}

    def evaluate(self, model, batch, key):
        return self.loss(model, batch, key)[1]


def lm_model(mesh, initial=None):
    """The LM on ``mesh`` (None: one device) with its routers scaled up; ``initial``: the state
    of the one-device model to start from instead (built abstractly, then filled: the same
    numbers on every mesh, without drawing them again)."""
    def build():
        return CausalLM(LM, mesh=mesh, rngs=nnx.Rngs(params=0, router=1))

    if initial is not None:
        model = nnx.eval_shape(build)
        nnx.update(model, initial)
        return model
    model = build()
    for stack in model.stacks:  # every router scaled up: logits of order 1
        for layer in stack.layers:
            if layer.is_moe:
                layer.mlp.moe.router.kernel[...] = layer.mlp.moe.router.kernel[...] * ROUTER_SCALE
    return model


@nnx.jit
def routing_margin(model, ids):
    """The smallest gap between a token's k-th and (k+1)-th router logit over every MoE layer
    of the deterministic forward of ``ids``: what float32 rounding would have to bridge to
    change a routing decision."""
    t = ids.shape[1]
    cos, sin = rope_cos_sin(LM.arch.rope, LM.arch.rotary_dim,
                            jnp.broadcast_to(jnp.arange(t), ids.shape))
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    h, margins = model.embed_tokens(ids), []
    for s, r, i in model.layer_index():
        graphdef, state = nnx.split(model.stacks[s])
        layer = nnx.merge(graphdef, jax.tree.map(lambda a, r=r: a[r], state)).layers[i]
        if layer.is_moe:
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), cos, sin)
            after_attention = h + layer.self_attn.attend(q, k, v, mask)
            logits = layer.mlp.moe.router(
                layer.post_attention_layernorm(after_attention).astype(jnp.float32))
            top = jnp.sort(logits, axis=-1)[..., ::-1]
            margins.append(jnp.min(top[..., LM.top_k - 1] - top[..., LM.top_k]))
        h, _, _ = layer(h, cos, sin, mask, None, None, True, False)
    return jnp.min(jnp.stack(margins))


def train_lm(mesh_shape, initial):
    """5 AdamW steps of the LM on a mesh ``(data, fsdp, expert)`` (None: one device) from the
    one-device model's state ``initial``: the metrics of each step, the final train state and
    (one device) the routing margins before and after."""
    mesh = None if mesh_shape is None else sharding.make_mesh(
        mesh_shape[0], mesh_shape[2], fsdp=mesh_shape[1])
    partitioner = None if mesh is None else partitioning.Partitioner(mesh)
    model = lm_model(mesh, jax.tree.map(jnp.copy, initial))
    if partitioner is not None:
        sharding.shard_state(model, partitioner)
    steps = Steps(model, NextTokenTask(), LM_OPTIM, partitioner)
    ids = jax.random.randint(jax.random.key(3), (LM_BATCH, LM_LEN + 1), 0, LM.arch.vocab_size)
    batch = {"ids": ids if mesh is None else jax.device_put(ids, sharding.batch_sharding(mesh))}
    margins = [float(routing_margin(model, ids))] if mesh is None else []
    state = steps.init_state()
    metrics = []
    for step in range(STEPS):
        state, out = steps.train_step(state, [batch], jax.random.key(step))
        metrics.append(jax.device_get(out))
    if mesh is None:
        margins.append(float(routing_margin(steps.model(state), ids)))
    return state, metrics, margins


def save_lm_reference(path: str) -> None:
    """The one-device LM run (:func:`train_lm`), written to ``path`` (npz): each step's metrics
    (``metrics/NAME``), the routing margins, the parameters and optimizer state by key path."""
    state, metrics, margins = train_lm(None, nnx.state(lm_model(None)))
    arrays = {f"metrics/{name}": np.array([float(m[name]) for m in metrics])
              for name in metrics[0]}
    arrays["margins"] = np.array(margins)
    for tree in ("params", "opt_state"):
        for key, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(getattr(state, tree))):
            arrays[tree + jax.tree_util.keystr(key)] = np.asarray(leaf)
    np.savez(path, **arrays)


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """The 1x4x2 run here, and the one-device reference from a child process under the other
    math library (module docstring)."""
    path = str(tmp_path_factory.mktemp("lm") / "one.npz")
    kit.run_with_other_math("tests.test_fsdp", "lm", path)
    with np.load(path) as f:
        reference = dict(f)
    return {"one": reference, (1, 4, 2): train_lm((1, 4, 2), nnx.state(lm_model(None)))}


def test_lm_sharded_training_equals_one_device(lm_runs):
    """5 AdamW steps on a 1x4x2 mesh equal them on one device. Losses and gradient norms within
    ``sum_rtol(LM_ADDITIONS)``; parameters within Adam's bound for that gradient rounding
    (:func:`tests.kit.adam_parameter_atol`); the moments within the same rounding: ``mu`` moves
    by at most ``d = grad_rtol * G``, ``nu`` by ``2 G d``."""
    one = lm_runs["one"]
    # Before and after the steps, every token's k-th choice leads the next by more than 1e-3:
    # float32 rounding of logits of order 1 (about 1e-6) cannot change a routing decision.
    assert one["margins"].min() > 1e-3, one["margins"]
    assert one["metrics/loss"][-1] < one["metrics/loss"][0]
    grad_rtol = kit.sum_rtol(LM_ADDITIONS)
    state, metrics, _ = lm_runs[(1, 4, 2)]
    for name in ("loss", "balance_loss", "z_loss", "grad_norm"):
        np.testing.assert_allclose([float(m[name]) for m in metrics], one[f"metrics/{name}"],
                                   rtol=grad_rtol, err_msg=name)
    lrs = np.asarray(learning_rate_schedule(LM_OPTIM)(jnp.arange(STEPS)))
    grad_norms = one["metrics/grad_norm"]
    atol = kit.adam_parameter_atol(lrs, grad_norms, LM_OPTIM.eps, grad_rtol)
    g, d = max(grad_norms), grad_rtol * max(grad_norms)
    for tree, tolerance in (("params", lambda key: atol),
                            ("opt_state", lambda key: 2 * g * d if ".nu" in key else d)):
        leaves = {tree + jax.tree_util.keystr(path): leaf for path, leaf in
                  jax.tree_util.tree_leaves_with_path(jax.device_get(getattr(state, tree)))}
        assert leaves.keys() == {key for key in one if key.startswith(tree)}
        for key, leaf in leaves.items():
            kit.assert_parameters_close(leaf, one[key], tolerance(key), STEPS, key)


def test_lm_state_stays_sharded(lm_runs):
    """After 5 steps the parameters and Adam moments are held as the rules say: the scanned
    experts ``[layers, N, emb, mlp]`` over expert and fsdp, matrices over fsdp, each device
    holding its part only."""
    state, _, _ = lm_runs[(1, 4, 2)]
    moe = state.params["stacks"][0]["layers"][0]["mlp"]["moe"]
    assert moe["w_gate"].sharding.spec == P(None, "expert", "fsdp")
    assert moe["w_gate"].sharding.shard_shape(moe["w_gate"].shape) == (3, 2, 4, 16)
    assert moe["w_down"].sharding.spec == P(None, "expert", None, "fsdp")
    attention = state.params["stacks"][0]["layers"][0]["self_attn"]["o_proj"]["kernel"]
    assert attention.sharding.spec == P(None, None, "fsdp")
    assert state.params["embed_tokens"]["embedding"].sharding.spec == P(None, "fsdp")
    moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state)
               if partitioning.path_name(path).endswith("moe/w_gate")]
    assert len(moments) == 2  # Adam's mu and nu
    assert all(m.sharding.spec == P(None, "expert", "fsdp") for m in moments)


# ------------------------------------------------------------------- translation, through the loop


class NoTestDecoding(translation.TranslationTask):
    """The translation task without its final test-set decoding (not what these tests check)."""

    def finish(self, run):
        return {}


# Adam in its linear regime (the tiny config warms up over 10 updates: these 5 take 0 to 0.4
# of the peak rate).
TRANSLATION_OPTIM = kit.LINEAR_ADAM


def run_translation(workdir, **mesh):
    """5 steps of the tiny translation run on ``mesh`` (``config.mesh`` fields). Routers drawn
    100 times the usual variance: logits of order 1, so that rounding cannot move a token to
    another expert (the SparseMixer draws are the same on every mesh: threefry partitions)."""
    config = tiny(**{"train_steps": STEPS, "eval_every": STEPS, "checkpoint_every": STEPS,
                     "log_every": 1, "router.init_scale": 100.0, **TRANSLATION_OPTIM,
                     **{f"mesh.{k}": v for k, v in mesh.items()}})
    return config, training.train(run_config(config, NoTestDecoding.from_config(config)),
                                  workdir)


@pytest.fixture(scope="module")
def translation_runs(tmp_path_factory):
    """The one-device run, from a child process under the other math library (module
    docstring), and the 1x4x2 run here, on the first run's vocabulary (the same data)."""
    root = tmp_path_factory.mktemp("fsdp")
    one, sharded = str(root / "one"), str(root / "sharded")
    kit.run_with_other_math("tests.test_fsdp", "translation", one)
    os.makedirs(sharded)
    shutil.copy(os.path.join(one, "spm.model"), sharded)
    _, results = run_translation(sharded, data=1, fsdp=4, expert=2)
    return {"one": one, "sharded": (sharded, results)}


def test_translation_sharded_run_equals_one_device(translation_runs, last_checkpoint):
    """5 updates on a 1x4x2 mesh equal them on one device. Each update holds 1,024 token
    positions (two micro-batches of 8 x 64), more than the layers times the widest contraction
    (the vocab, 128): losses and gradient norms within ``sum_rtol(1024)``; the parameters within
    Adam's bound for that gradient rounding (:func:`tests.kit.adam_parameter_atol`) with the
    logged rates and norms; the routing decisions (each layer's share of tokens per expert)
    the same."""
    one = translation_runs["one"]
    sharded, results = translation_runs["sharded"]
    records0, records = kit.read_metrics(one), kit.read_metrics(sharded)
    train0 = [r for r in records0 if "loss" in r]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    config0 = tiny(**TRANSLATION_OPTIM)
    grad_rtol = kit.sum_rtol(config0.optim.tokens_per_update)
    for got, want in zip(train, train0, strict=True):
        for name in ("loss", "grad_norm", "nll_loss", "balance_loss"):
            if name in want:
                np.testing.assert_allclose(got[name], want[name], rtol=grad_rtol,
                                           err_msg=f"step {want['step']} {name}")
        for layer, values in want["moe"].items():
            np.testing.assert_array_equal(got["moe"][layer]["expert_fraction"],
                                          values["expert_fraction"],
                                          err_msg=f"step {want['step']} {layer}")
    valid0 = [r["valid_loss"] for r in records0 if "valid_loss" in r]
    np.testing.assert_allclose(results["valid_loss"], valid0[-1], rtol=grad_rtol)
    atol = kit.adam_parameter_atol([r["lr"] for r in train0], [r["grad_norm"] for r in train0],
                                   kit.LINEAR_ADAM_EPS, grad_rtol)
    steps0 = training.build_steps(run_config(config0, NoTestDecoding.from_config(config0)),
                                  config0.data.vocab_size)
    params0, _ = last_checkpoint(one, steps0)
    params, _ = last_checkpoint(sharded, steps0)  # restored onto one device
    kit.assert_parameters_close(params, params0, atol, STEPS)


def test_sharded_checkpoint_restores_onto_another_mesh(translation_runs):
    """The 1x4x2 run's checkpoint (parameters and Adam state) restored onto a 2x2x2 mesh:
    placed as that mesh's rules say, with the values restored onto one device."""
    sharded = translation_runs["sharded"][0]
    config = tiny(**{"mesh.data": 2, "mesh.fsdp": 2, "mesh.expert": 2})
    # The model is only the template's shapes: built abstractly, as a reader would.
    run = run_config(config, NoTestDecoding.from_config(config))
    device_mesh = sharding.device_mesh(run.mesh)
    model = nnx.eval_shape(lambda: run.task.build_model(run, config.data.vocab_size,
                                                        device_mesh))
    steps = Steps(model, run.task, run.optim, sharding.mesh_partitioner(run.mesh, device_mesh))
    restored = restore_checkpoint(sharded, steps.abstract_state(), "last")
    assert restored.step == STEPS
    run_one = run_config(tiny(), NoTestDecoding.from_config(tiny()))
    one = nnx.eval_shape(lambda: run_one.task.build_model(run_one, tiny().data.vocab_size, None))
    reference = restore_checkpoint(sharded, Steps(one, run_one.task, run_one.optim
                                                  ).abstract_state(), "last")
    wi = restored.state.params["encoder_layers"][0]["ffn"]["wi"]
    assert wi.sharding.mesh.shape == device_mesh.shape
    assert wi.sharding.spec == P("expert", "fsdp")
    moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(restored.state.opt_state)
               if partitioning.path_name(path).endswith("encoder_layers/0/ffn/wi")]
    assert len(moments) == 2 and all(m.sharding.spec == P("expert", "fsdp") for m in moments)
    for tree in ("params", "opt_state"):
        jax.tree.map(np.testing.assert_array_equal,
                     jax.device_get(getattr(restored.state, tree)),
                     jax.device_get(getattr(reference.state, tree)))


# ------------------------------------------------------------------------- logical axis names


def test_every_parameter_of_every_model_has_logical_names():
    """The tiny translation model (also with gated shared experts), ELECTRA (with Admin's scales)
    and every decoder-only LM type (built abstractly): each parameter is named by the table, one
    name per dimension, scanned stacks led by "layers"."""
    from sparsemixer_jax.hf.checkpoint import read_config
    from sparsemixer_jax.hf.config import from_hf

    def abstract(build):
        return nnx.eval_shape(build)

    models = {}
    for label, overrides in (("translation", {}), ("translation-shared", {
            "model.num_shared_experts": 1, "model.shared_expert_gate": True})):
        config = tiny(**overrides)
        run = run_config(config)
        models[label] = abstract(lambda r=run: r.task.build_model(r, 128, None))
    for init in ("fairseq", "admin"):
        config = kit.tiny_config("pretraining", "unused", **{"model.init": init})
        run = run_config(config)
        models[f"electra-{init}"] = abstract(lambda r=run: r.task.build_model(r, 128, None))
    data = os.path.join(os.path.dirname(__file__), "data", "hf")
    for model_type in MODEL_TYPES:
        lm = from_hf(read_config(os.path.join(data, model_type)))
        models[model_type] = abstract(lambda c=lm: CausalLM(c, rngs=nnx.Rngs(0)))
    for label, model in models.items():
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            name = partitioning.path_name(path)
            names = partitioning.logical_axes_of(name, len(leaf.shape))
            assert names is not None, f"{label}: {name} {leaf.shape}"
            assert len(names) == len(leaf.shape)
            assert (names[0] == "layers") == name.startswith("stacks/"), (label, name, names)


def test_rules_are_config_fields():
    config = tiny(**{"mesh.fsdp": 8, "mesh.rules.mlp": "fsdp", "mesh.rules.embed": None})
    mesh_config = sharding.MeshConfig.from_config(config.mesh)
    assert dict(mesh_config.rules)["mlp"] == ("fsdp",)
    partitioner = sharding.mesh_partitioner(mesh_config, sharding.make_mesh(1, 1, fsdp=8))
    assert partitioner.spec(("expert", "embed", "mlp"), (2, 16, 32)) == P(None, None, "fsdp")
    assert partitioner.spec(("vocab", "embed"), (100, 16)) == P()
    with pytest.raises(ValueError, match=r"config.mesh.rules.hidden: unknown logical axis"):
        sharding.MeshConfig.from_config({"rules": {"hidden": "fsdp"}})
    with pytest.raises(ValueError, match=r"config.mesh.rules.embed='model': mesh axes are"):
        sharding.MeshConfig.from_config(tiny(**{"mesh.rules.embed": "model"}).mesh)
    # A dimension the axes do not divide stays whole: 6 experts over 4 devices.
    assert partitioning.Partitioner(sharding.make_mesh(2, 4)).spec(
        ("expert", "embed"), (6, 16)) == P()


# ------------------------------------------------------------------------- Hugging Face in and out


@nnx.jit
def logits_of(model, ids):
    return model(ids)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_next", "qwen3_5_moe_text",
                                        "glm4_moe_lite", "minimax_m2", "llama4_text"])
def test_hf_checkpoint_loads_onto_the_mesh_and_exports_the_same(tmp_path, model_type):
    """A Hugging Face checkpoint loaded straight onto a 1x2x2 mesh: its parameters sharded as
    the rules say (the experts over ``expert``, the width over ``fsdp``), its logits
    transformers' own, and its export (gathered one tensor at a time) the tensors it was loaded
    from (Qwen3-Next and Qwen3.5: Gated DeltaNet layers, their convolution and decay parameters
    included, in the fused and the separate projection layouts)."""
    from safetensors.numpy import load_file

    path = os.path.join(os.path.dirname(__file__), "data", "hf", model_type)
    mesh = sharding.make_mesh(1, 2, jax.devices()[:4], fsdp=2)
    model, config = hf.load_pretrained(path, mesh=mesh)
    stack, _, position = model.layer_index()[config.arch.moe_layers.index(True)]
    gate = model.stacks[stack].layers[position].mlp.moe.w_gate[...]
    assert gate.sharding.spec == P(None, "expert", "fsdp")
    repeats, experts, width, mlp = gate.shape  # [repeats, N, emb, mlp]
    assert gate.sharding.shard_shape(gate.shape) == (repeats, experts // 2, width // 2, mlp)
    if model_type == "qwen3_5_moe_text":  # the width over fsdp, the rest whole
        mixer = model.stacks[0].layers[0].linear_attn
        kernel = mixer.in_proj_qkv.kernel[...]  # 3 layers, width 32, queries + keys + values
        assert kernel.sharding.spec == P(None, "fsdp")
        assert kernel.sharding.shard_shape(kernel.shape) == (3, 16, 2 * 16 + 24)
        assert mixer.conv1d[...].sharding.spec == P()
    assert model.embed_tokens.embedding[...].sharding.spec == P(None, "fsdp")
    reference = dict(np.load(os.path.join(path, "reference.npz")))
    logits = np.asarray(logits_of(model, reference["input_ids"]))
    assert np.abs(logits - reference["logits"]).max() <= 1e-4 * np.abs(reference["logits"]).max()
    hf.save_pretrained(model, config, str(tmp_path))
    written = load_file(str(tmp_path / "model.safetensors"))
    skipped = tuple(family_of(model_type).skipped)  # multi-token prediction: not exported
    expected = {name: value for name, value in load_file(os.path.join(
        path, "model.safetensors")).items() if not name.startswith(skipped)}
    assert written.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)


def test_a_run_resumes_on_another_layout_of_as_many_devices(tmp_path):
    """A workdir saved before the fsdp axis and the rules existed resumes with them, also on
    another layout of its 8 devices; another number of devices is refused (its batches would
    differ), naming the device counts."""
    from sparsemixer_jax.training.resume import ResumeError, check_resume_config

    os.makedirs(tmp_path / "checkpoints" / "last" / "3")  # a trained run
    saved = json.loads(tiny(**{"mesh.data": 8}).to_json())
    del saved["mesh"]["fsdp"], saved["mesh"]["rules"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(saved, f)
    check_resume_config(str(tmp_path), run_config(tiny(**{"mesh.data": -1})))
    check_resume_config(str(tmp_path), run_config(tiny(**{
        "mesh.data": 1, "mesh.fsdp": 4, "mesh.expert": 2, "mesh.rules.mlp": "fsdp"})))
    with pytest.raises(ResumeError, match=r"config\.mesh\.devices \(saved 8, now 4\)"):
        check_resume_config(str(tmp_path), run_config(tiny(**{"mesh.data": 1, "mesh.fsdp": 4})))


def test_lm_model_is_placed_by_the_configs_rules():
    """A language model from scratch is placed by ``config.mesh.rules``, not the defaults: the
    optimizer state follows the config's rules, so the two must agree."""
    from sparsemixer_jax.tasks.language_model import LMTask

    config = kit.tiny_config("lm", **{"mesh.fsdp": 4, "mesh.expert": 2, "mesh.rules.embed": None,
                                      "mesh.rules.mlp": "fsdp"})
    task = LMTask.from_config(config)
    run = run_config(config, task)
    model = task.build_model(run, task.lm.arch.vocab_size, sharding.device_mesh(run.mesh))
    params = nnx.state(model, nnx.Param)
    assert params["embed_tokens"]["embedding"][...].sharding.spec in (P(), P(None, None))
    w_gate = params["stacks"][0]["layers"][0]["mlp"]["moe"]["w_gate"][...]
    assert w_gate.sharding.spec == P(None, "expert", None, "fsdp")


if __name__ == "__main__":  # the one-device references of the tests above
    if sys.argv[1] == "translation":
        run_translation(sys.argv[2], data=1)
    elif sys.argv[1] == "lm":
        save_lm_reference(sys.argv[2])
    else:
        raise SystemExit("usage: python -m tests.test_fsdp translation WORKDIR | lm OUT.npz")
