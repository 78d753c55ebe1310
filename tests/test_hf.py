"""Hugging Face checkpoints in and out, against transformers' own outputs.

``tests/data/hf/<type>/`` holds tiny random models saved by transformers 5.23 and their float32
logits and greedy generations (made by ``scripts/make_hf_references.py``; no torch here)."""

import copy
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from sparsemixer_jax import hf
from sparsemixer_jax.hf.families import family_of
from sparsemixer_jax.layers.rope import RopeConfig
from sparsemixer_jax.models.layer_stacks import LayerKind, layer_pattern_stacks
from sparsemixer_jax.models.lm_config import MODEL_TYPES
from sparsemixer_jax.models.lm_generate import _extend as extend
from sparsemixer_jax.models.lm_generate import generate

DATA = os.path.join(os.path.dirname(__file__), "data", "hf")


@nnx.jit
def logits_of(model, ids):
    """The model's logits, compiled once per model (eager op-by-op dispatch is slower)."""
    return model(ids)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def reference(model_type):
    return dict(np.load(os.path.join(DATA, model_type, "reference.npz")))


def relative_error(got, want):
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def reload(path, config):
    """The checkpoint at ``path`` with ``config``'s ``hf_config`` text (the file it was first
    read from), so its logits reuse the first model's compiled forward: the config's other
    fields come from ``path`` and must equal ``config``'s for the model to build alike."""
    model, again = hf.load_pretrained(path, hf_config=config.hf_config)
    assert again == config
    return model


@pytest.fixture(scope="module")
def loaded():
    """Each type loaded once: ``{type: (model, config)}``."""
    return {t: hf.load_pretrained(os.path.join(DATA, t)) for t in MODEL_TYPES}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_logits_and_greedy_generation_equal_transformers(loaded, model_type):
    model, _ = loaded[model_type]
    ref = reference(model_type)
    assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) <= 1e-4
    got = generate(model, jnp.asarray(ref["input_ids"][:, :5]), 8)
    np.testing.assert_array_equal(np.asarray(got), ref["generated"])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_round_trip_writes_what_transformers_wrote(loaded, model_type, tmp_path):
    """load -> save -> load gives the same logits; the saved directory has the tensor names and
    shapes transformers' own save_pretrained wrote, and a config.json that reads back the same."""
    model, config = loaded[model_type]
    hf.save_pretrained(model, config, str(tmp_path))
    assert hf.from_hf(hf.read_config(str(tmp_path))).replace(hf_config="") == \
        config.replace(hf_config="")
    again = reload(str(tmp_path), config)
    ids = reference(model_type)["input_ids"]
    np.testing.assert_array_equal(np.asarray(logits_of(again, ids)),
                                  np.asarray(logits_of(model, ids)))

    skipped = tuple(family_of(model_type).skipped)  # multi-token prediction: not exported

    def shapes(directory):
        with safe_open(os.path.join(directory, "model.safetensors"), "np") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()  # noqa: SIM118
                    if not k.startswith(skipped)}

    assert shapes(str(tmp_path)) == shapes(os.path.join(DATA, model_type))
    saved = read_json(tmp_path / "config.json")
    assert saved["model_type"] == model_type and "rope_parameters" in saved


def test_sharded_checkpoint_and_a_missing_shard(loaded, tmp_path):
    model, config = loaded["qwen2_moe"]
    hf.save_pretrained(model, config, str(tmp_path), max_shard_bytes=40_000)
    index = read_json(tmp_path / "model.safetensors.index.json")
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    again = reload(str(tmp_path), config)
    ids = reference("qwen2_moe")["input_ids"]
    np.testing.assert_array_equal(np.asarray(logits_of(again, ids)),
                                  np.asarray(logits_of(model, ids)))
    os.remove(tmp_path / shards[1])
    with pytest.raises(ValueError, match=f"shard '{shards[1]}' named in .* is missing"):
        hf.load_pretrained(str(tmp_path))


def test_bfloat16_checkpoint_loads(loaded, tmp_path):
    """A bfloat16 checkpoint (as the Hub's are; the safetensors package's numpy reader has no
    bfloat16) loads: every parameter is the float32 original rounded to bfloat16, exactly."""
    model, config = loaded["qwen3_moe"]
    hf.save_pretrained(model, config, str(tmp_path), dtype="bfloat16")
    again = reload(str(tmp_path), config)
    want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    got = nnx.to_pure_dict(nnx.state(again, nnx.Param))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(b),
                                      np.asarray(a).astype(jnp.bfloat16).astype(np.float32))


@pytest.mark.parametrize("model_type", ["mixtral", "phimoe"])
def test_fused_expert_layout_loads_the_same(loaded, model_type, tmp_path):
    """transformers 5's in-memory layout: experts fused into gate_up_proj [N, 2I, emb] and
    down_proj [N, emb, I] under ``mlp.``; Phi-3.5-MoE's router as ``mlp.router.weight``."""
    source = os.path.join(DATA, model_type)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    cfg = read_json(os.path.join(source, "config.json"))
    fused, layers, n = {}, cfg["num_hidden_layers"], cfg["num_local_experts"]
    for name, value in tensors.items():
        if ".experts." not in name:
            name = name.replace("block_sparse_moe.gate", "mlp.router" if model_type == "phimoe"
                                else "mlp.gate")
            fused[name] = value
    for layer in range(layers):
        expert = f"model.layers.{layer}.block_sparse_moe.experts"

        def stacked(w, expert=expert):
            return np.stack([tensors[f"{expert}.{j}.{w}.weight"] for j in range(n)])

        fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.concatenate(
            [stacked("w1"), stacked("w3")], axis=1)
        fused[f"model.layers.{layer}.mlp.experts.down_proj"] = stacked("w2")
    save_file(fused, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(source, "config.json"), tmp_path)
    again = reload(str(tmp_path), loaded[model_type][1])
    ids = reference(model_type)["input_ids"]
    np.testing.assert_array_equal(np.asarray(logits_of(again, ids)),
                                  np.asarray(logits_of(loaded[model_type][0], ids)))


def test_config_spellings_read_the_same():
    """4.x spellings (top-level rope_theta / rope_scaling with ``type``, Qwen3-MoE's
    num_experts) give the config the 5.x spellings (rope_parameters, num_local_experts) give."""
    for model_type in ("mixtral", "qwen3_moe", "phimoe"):
        new = read_json(os.path.join(DATA, model_type, "config.json"))
        old = copy.deepcopy(new)
        rope = old.pop("rope_parameters")
        old["rope_theta"] = rope.pop("rope_theta")
        kind = rope.pop("rope_type")
        old["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
        if model_type == "qwen3_moe":
            old["num_experts"] = old.pop("num_local_experts")
        strip = {"hf_config": ""}
        assert hf.from_hf(old).replace(**strip) == hf.from_hf(new).replace(**strip)
    assert hf.from_hf(new).arch.rope.kind == "longrope"


def test_one_line_errors(tmp_path):
    cfg = read_json(os.path.join(DATA, "mixtral", "config.json"))
    with pytest.raises(ValueError, match="is not a Hugging Face model directory"):
        hf.load_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="'llama' is not supported; supported: "
                                         + ", ".join(MODEL_TYPES) + " "):  # all thirteen
        hf.from_hf({**cfg, "model_type": "llama"})
    assert len(MODEL_TYPES) == 13
    with pytest.raises(ValueError, match="key 'attn_logit_softcapping' is not known"):
        hf.from_hf({**cfg, "attn_logit_softcapping": 30.0})
    with pytest.raises(ValueError, match="rope scaling 'dynamic' is not implemented"):
        hf.from_hf({**cfg, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="'gelu'; only 'silu'"):
        hf.from_hf({**cfg, "hidden_act": "gelu"})
    # A wrong shape and a missing tensor, each named.
    source = os.path.join(DATA, "mixtral")
    tensors = load_file(os.path.join(source, "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    save_file({**tensors, name: tensors[name][:, :-1].copy()},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{name}' has shape \[16, 15\], expected "
                                         r"\[16, 16\]"):
        hf.load_pretrained(str(tmp_path))
    del tensors[name]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' is missing"):
        hf.load_pretrained(str(tmp_path))
    # A truncated file and one that is not safetensors at all, each named.
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model.safetensors: tensor '.*' ends past the end of "
                                         r"the file \(\d+ bytes\): the file is truncated"):
        hf.load_pretrained(str(tmp_path))
    file.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file"):
        hf.load_pretrained(str(tmp_path))


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "deepseek_v3", "glm4_moe",
                                        "qwen3_next", "qwen3_5_moe_text", "glm4_moe_lite",
                                        "minimax_m2", "llama4_text"])
def test_cached_decoding_gives_the_full_forward_logits(loaded, model_type):
    """Prefill 5 slots (row 0 left-padded by one), then one token at a time: every step's logits
    equal a full forward pass of the same real tokens (Mixtral: sliding window 5 < 12 tokens on
    every layer; gpt-oss: window 4 on layers 0 and 3 of 4, attention sinks; DeepSeek-V3: latent
    attention, whose cache holds the normed latent and the rotated shared key; GLM-4.5: half of
    each head rotated, q/k norms before the rotation; Qwen3-Next and Qwen3.5: Gated DeltaNet
    layers, whose cache entries are the convolution's last inputs and the state, padding left
    out of both; GLM-4.7-Flash: latent attention with the rotated halves not interleaved, dense
    layers between MoE layers; MiniMax-M2: q/k norms over the whole projections before the
    head split, half of each head rotated; Llama 4: chunks of 4 on the rotary layers, a layer
    without rotary positions whose queries' scale grows with the position). Through
    ``generate``'s own compiled step, at the shapes the generation test compiled it for."""
    model, _ = loaded[model_type]
    ids = jnp.asarray(reference(model_type)["input_ids"])
    full = np.asarray(logits_of(model, ids))
    padded = jnp.concatenate([jnp.zeros((2, 1), ids.dtype), ids], axis=1)
    mask = jnp.ones(padded.shape, bool).at[0, 0].set(False).at[1, 12].set(False)
    padded = padded.at[1].set(jnp.concatenate([ids[1], jnp.zeros((1,), ids.dtype)]))
    logits, cache, _ = extend(model, padded[:, :5], mask[:, :5], model.init_cache(2, 13))
    steps = [logits]
    for t in range(5, 13):
        logits, cache, _ = extend(model, padded[:, t:t + 1], mask[:, t:t + 1], cache)
        steps.append(logits)
    cached = np.stack([np.asarray(x) for x in steps], axis=1)  # positions 4..12
    atol = 1e-5 * np.abs(full).max()
    np.testing.assert_allclose(cached[0], full[0, 3:], rtol=1e-5, atol=atol)
    np.testing.assert_allclose(cached[1, :8], full[1, 4:], rtol=1e-5, atol=atol)


def test_llama3_rope_scaling_equals_transformers():
    """llama3 rope scaling (any type; here Mixtral's) as transformers computes it: of head_dim
    8's four frequencies one kept, one blended and two divided by the factor. Its logits are
    transformers' within 1e-4 of the largest (float32 sums in another order), the default
    rope's are not, and the export says llama3 with its settings."""
    path = os.path.join(DATA, "mixtral_llama3")
    ref = reference("mixtral_llama3")
    model, config = hf.load_pretrained(path)
    assert config.arch.rope.kind == "llama3" and config.arch.rope.high_freq_factor == 8.0
    assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) <= 1e-4
    unscaled, _ = hf.load_pretrained(path, rope=RopeConfig(theta=config.arch.rope.theta))
    assert relative_error(logits_of(unscaled, ref["input_ids"]), ref["logits"]) > 1e-3
    written = hf.to_hf(config)["rope_parameters"]
    assert hf.from_hf({**hf.read_config(path), "rope_parameters": written}).arch.rope == \
        config.arch.rope
    cfg = hf.read_config(path)
    del cfg["rope_parameters"]["low_freq_factor"]
    with pytest.raises(ValueError, match=r"llama3 rope scaling needs low_freq_factor$"):
        hf.from_hf(cfg)


def test_sampled_generation(loaded):
    model, _ = loaded["olmoe"]
    prompt = jnp.asarray(reference("olmoe")["input_ids"][:, :5])
    # 8 new tokens: the shapes the generation test compiled generate's steps for.
    a = generate(model, prompt, 8, temperature=1.0, key=jax.random.key(1))
    b = generate(model, prompt, 8, temperature=1.0, key=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a[:, :5]), np.asarray(prompt))
    greedy = generate(model, prompt, 8)
    top1 = generate(model, prompt, 8, temperature=0.7, top_k=1, key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(top1), np.asarray(greedy))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        generate(model, prompt, 2, temperature=1.0)


def test_nucleus_keeps_the_fewest_tokens_that_reach_top_p():
    """Probabilities 0.5, 0.3, 0.15, 0.05 (shuffled): top_p 0.8 keeps the first two (0.5 + 0.3
    reaches it), 0.81 the first three, 0.4 the first alone; top_k applies first."""
    from sparsemixer_jax.models.lm_generate import sampling_logits

    probs = np.array([[0.15, 0.5, 0.05, 0.3]])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
    for top_p, kept in ((0.8, [1, 3]), (0.81, [0, 1, 3]), (0.4, [1]), (1.0, [0, 1, 2, 3])):
        out = np.asarray(sampling_logits(logits, 1.0, None, top_p))
        assert sorted(np.flatnonzero(np.isfinite(out[0]))) == kept, top_p
    out = np.asarray(sampling_logits(logits, 1.0, 2, 0.99))
    assert sorted(np.flatnonzero(np.isfinite(out[0]))) == [1, 3]


def test_decoding_is_one_program_whatever_its_length(loaded, monkeypatch):
    """The prompt is fed once and every new token inside the compiled loop: one call of the
    prefill for 2 or 8 new tokens; a tiny nucleus samples the argmax."""
    from sparsemixer_jax.models import lm_generate

    model, _ = loaded["olmoe"]
    prompt = jnp.asarray(reference("olmoe")["input_ids"][:, :5])
    calls = []
    extend = lm_generate._extend
    monkeypatch.setattr(lm_generate, "_extend", lambda *a: calls.append(1) or extend(*a))
    greedy = generate(model, prompt, 8)
    assert len(calls) == 1
    nucleus = generate(model, prompt, 8, temperature=1.0, top_p=1e-6, key=jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(nucleus), np.asarray(greedy))
    generate(model, prompt, 2)
    assert len(calls) == 3
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(model, prompt, 2, temperature=1.0, top_p=0.0, key=jax.random.key(0))


def test_routers_that_keep_or_change_the_forward():
    """At evaluation DenseMixer and Default MoE route as the checkpoint (top-k softmax);
    SparseMixer routes by its masked argmax, which changes a Mixtral checkpoint's logits; on a
    phimoe checkpoint SparseMixer-v2 is the checkpoint's own router and plain top-2 changes it."""
    ref = reference("mixtral")
    path = os.path.join(DATA, "mixtral")
    for router in ("densemixer",):
        model, config = hf.load_pretrained(path, router=router)
        assert config.router == router
        assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) <= 1e-4
    model, _ = hf.load_pretrained(path, router="sparsemixer_v2", jitter_eps=0.1)
    assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) > 1e-3
    ref = reference("phimoe")
    model, _ = hf.load_pretrained(os.path.join(DATA, "phimoe"), router="switch", jitter_eps=0.0)
    assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) > 1e-3


def test_bfloat16_compute_and_training_mode(loaded):
    ref = reference("qwen3_moe")
    model, _ = hf.load_pretrained(os.path.join(DATA, "qwen3_moe"), compute_dtype="bfloat16")
    assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) <= 5e-2
    # Training mode: phimoe samples its experts and jitters its MoE input (different logits);
    # the load-balancing loss is there for the task.
    model, _ = hf.load_pretrained(os.path.join(DATA, "phimoe"))
    model.train()
    out = nnx.jit(lambda m, ids: m.forward(ids))(model, jnp.asarray(
        reference("phimoe")["input_ids"]))
    assert relative_error(out.logits, reference("phimoe")["logits"]) > 1e-4
    assert float(out.aux["balance_loss"]) > 0


def test_layers_are_scanned_in_few_stacks(loaded):
    """Qwen2-MoE's dense/MoE alternation over 5 layers is one stack of a (dense, MoE) unit twice
    plus a dense layer: the unit compiles once however deep the model."""
    model, config = loaded["qwen2_moe"]
    assert config.arch.moe_layers == (False, True, False, True, False)
    dense, moe = LayerKind(moe=False, linear=False), LayerKind(moe=True, linear=False)
    assert model.stack_patterns == (((dense, moe), 2), ((dense,), 1))
    # Qwen3.5's three Gated DeltaNet layers and one attention layer: two stacks.
    model, _ = loaded["qwen3_5_moe_text"]
    assert model.stack_patterns == (((LayerKind(moe=True, linear=True),), 3), ((moe,), 1))
    assert layer_pattern_stacks((True,) * 48) == (((True,), 48),)
    assert layer_pattern_stacks((False,) + (True,) * 7) == (((False,), 1), ((True,), 7))
