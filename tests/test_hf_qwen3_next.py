"""The Gated DeltaNet hybrids: Qwen3-Next (``qwen3_next``) and Qwen3.5-MoE
(``qwen3_5_moe_text``, and the Hub's image-text-to-text ``qwen3_5_moe`` directory read as its
text model); the Hub's spellings, the skipped tensors, the one-line refusals and fine-tuning
under every router (their logits, generation, cached decoding and round trip are
tests/test_hf.py's, as every type's; loading onto a mesh tests/test_fsdp.py's).

``tests/data/hf/qwen3_next`` (config.json in the Hub's spelling: ``full_attention_interval``,
top-level ``rope_theta`` and ``partial_rotary_factor``; one multi-token-prediction layer's
``mtp.*`` tensors), ``tests/data/hf/qwen3_5_moe_text`` (as transformers saves it) and
``tests/data/hf/qwen3_5_moe`` (the image-text-to-text model with a one-block vision tower, the
text model's tensors under ``model.language_model.``, ``mtp.*`` tensors, the Hub's
``text_config`` keys) were made by ``scripts/make_hf_references.py`` with transformers 5.23."""

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from sparsemixer_jax import hf
from sparsemixer_jax.hf.scratch import check_router_for_lm, router_overrides
from sparsemixer_jax.models.lm_generate import generate
from sparsemixer_jax.models.lm_loss import token_nll
from sparsemixer_jax.parallel.partitioning import path_name
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.routers.registry import ROUTERS, routers_taking
from tests.test_hf import DATA, logits_of, read_json, reference, relative_error, reload

VL_DIR = os.path.join(DATA, "qwen3_5_moe")


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "skipped the" in r.getMessage()]


def test_image_text_to_text_directory_loads_as_its_text_model(tmp_path, caplog):
    """The Hub's Qwen3.5-MoE directory: its text model's logits (within 1e-4 of the largest,
    float32 sums in another order) and greedy tokens equal transformers' of the whole model on
    text; the vision tower's and the MTP layer's tensors skipped with one line each naming how
    many; exported as ``qwen3_5_moe_text`` (``model.*`` names, no vision tower), which loads
    back to the same logits."""
    with caplog.at_level(logging.INFO, logger="sparsemixer_jax.hf.checkpoint"):
        model, config = hf.load_pretrained(VL_DIR)
    with safe_open(os.path.join(VL_DIR, "model.safetensors"), "np") as f:
        names = list(f.keys())
    visual = sum(name.startswith("model.visual.") for name in names)
    mtp = sum(name.startswith("mtp.") for name in names)
    assert visual > 0 and mtp > 0
    assert sorted(_messages(caplog)) == sorted([
        f"{VL_DIR}: skipped the {visual} tensors under 'model.visual.' (vision tower, which "
        "this model does not compute)",
        f"{VL_DIR}: skipped the {mtp} tensors under 'mtp.' (multi-token prediction, which "
        "this model does not compute)"])
    assert config.arch.model_type == "qwen3_5_moe_text"
    assert config.arch.linear_layers == (True, True, True, False)
    assert config.arch.linear_layout == "separate" and config.norm_topk_prob
    ref = reference("qwen3_5_moe")
    assert relative_error(logits_of(model, ref["input_ids"]), ref["logits"]) <= 1e-4
    generated = generate(model, jnp.asarray(ref["input_ids"][:, :5]), 8)
    np.testing.assert_array_equal(np.asarray(generated), ref["generated"])
    hf.save_pretrained(model, config, str(tmp_path))
    saved = read_json(tmp_path / "config.json")
    assert saved["model_type"] == "qwen3_5_moe_text" and "text_config" not in saved
    assert saved["architectures"] == ["Qwen3_5MoeForCausalLM"]
    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:
        written = set(f.keys())
    text = {name.replace("model.language_model.", "model.") for name in names
            if not name.startswith(("model.visual.", "mtp."))}
    assert written == text
    again = reload(str(tmp_path), config)
    np.testing.assert_array_equal(np.asarray(logits_of(again, ref["input_ids"])),
                                  np.asarray(logits_of(model, ref["input_ids"])))


def test_the_hubs_spellings_read_as_transformers_5s(caplog):
    """Qwen3-Next's Hub config.json (``full_attention_interval`` 2, top-level rope keys,
    ``use_sliding_window`` false) reads as its ``layer_types`` spelled out would; without
    either every fourth layer is attention (transformers' default); Qwen3.5's ``mrope_section``
    and ``mrope_interleaved`` read as plain rotary positions (text positions are one grid)."""
    cfg = read_json(os.path.join(DATA, "qwen3_next", "config.json"))
    hub = hf.from_hf(cfg)
    assert hub.arch.linear_layers == (True, False, True, False)
    assert hub.arch.moe_layers == (True, True, False, True)
    assert hub.arch.rope.partial_rotary_factor == 0.5 and hub.arch.rope.theta == 20000.0
    assert hub.arch.norm == "zero_centred_rms" and hub.arch.attention_output_gate
    spelled = {k: v for k, v in cfg.items() if k != "full_attention_interval"}
    spelled["layer_types"] = ["linear_attention", "full_attention"] * 2
    assert hf.from_hf(spelled).replace(hf_config="") == hub.replace(hf_config="")
    default = {**spelled, "num_hidden_layers": 8, "mlp_only_layers": []}
    del default["layer_types"]
    assert hf.from_hf(default).arch.linear_layers == (True, True, True, False) * 2
    text = read_json(os.path.join(DATA, "qwen3_5_moe_text", "config.json"))
    plain = dict(text, rope_parameters={k: v for k, v in text["rope_parameters"].items()
                                        if not k.startswith("mrope")})
    assert hf.from_hf(plain).replace(hf_config="") == hf.from_hf(text).replace(hf_config="")


def test_mtp_tensors_are_skipped_with_one_line(caplog):
    path = os.path.join(DATA, "qwen3_next")
    with caplog.at_level(logging.INFO, logger="sparsemixer_jax.hf.checkpoint"):
        hf.check_checkpoint(path, hf.from_hf(hf.read_config(path)))
        hf.load_pretrained(path)
    assert _messages(caplog) == [f"{path}: skipped the 3 tensors under 'mtp.' (multi-token "
                                 "prediction, which this model does not compute)"]


def _with_config(tmp_path, source: str, change) -> str:
    """A copy of ``source`` with its config.json changed by ``change(cfg)`` and a weight file
    that is not safetensors: a refusal of the config comes before any tensor is read."""
    cfg = read_json(os.path.join(DATA, source, "config.json"))
    change(cfg)
    directory = tmp_path / source
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    (directory / "model.safetensors").write_bytes(b"never read")
    return str(directory)


@pytest.mark.parametrize("source, change, message", [
    ("qwen3_next", lambda c: c.update(layer_types=["linear_attention", "full_attention",
                                                   "sliding_attention", "full_attention"]),
     r"config.json \(qwen3_next\): layer_types\[2\]='sliding_attention' is not implemented "
     r"\(implemented: linear_attention, full_attention\)"),
    ("qwen3_next", lambda c: c.update(linear_num_value_heads=3),
     r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
    ("qwen3_5_moe_text", lambda c: c.update(linear_key_head_dim=0),
     r"linear_key_head_dim must be an int >= 1, got 0"),
    ("qwen3_next", lambda c: c.update(full_attention_interval=0),
     r"full_attention_interval=0 must be an integer >= 1"),
    ("qwen3_5_moe", lambda c: c.update(text_config={"model_type": "qwen3_5_moe_vision"}),
     r"config.json \(qwen3_5_moe\): text_config must hold the text model \(model_type "
     r"'qwen3_5_moe_text'\), got 'qwen3_5_moe_vision'"),
    ("qwen3_5_moe", lambda c: c.pop("text_config"),
     r"text_config must hold the text model .*got None"),
    ("qwen3_5_moe_text", lambda c: c.update(attn_output_gate=False),
     r"attn_output_gate=False is not implemented \(only True\)"),
])
def test_bad_input_is_one_line_before_any_tensor_is_read(tmp_path, source, change, message):
    with pytest.raises(ValueError, match=message) as error:
        hf.load_pretrained(_with_config(tmp_path, source, change))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("source", ["qwen3_next", "qwen3_5_moe"])
def test_every_router_fine_tunes_the_checkpoint_or_is_refused_in_one_line(source):
    """Fine-tuning with the router section (``init_router="config"``, as the language-model
    task reads a checkpoint): every router of the registry composes with the hybrids' softmax
    top-k and gated shared expert; Qwen3.5, whose router always renormalises its top-k gates,
    refuses a router that takes ``normalize_top_k`` with it off, in one line, and takes it on."""
    cfg = hf.read_config(os.path.join(DATA, source))
    renormalised = source == "qwen3_5_moe"
    for name in ROUTERS:
        jitter = 0.1 if "sparsemixer" in name else 0.0
        router = RouterConfig(name=name, top_k=3, jitter_eps=jitter)
        if renormalised and name in routers_taking("normalize_top_k"):
            with pytest.raises(ValueError, match=f"normalize_top_k=False: {source} "
                                                 "renormalises its top-k gates") as error:
                check_router_for_lm(router, source)
            assert "\n" not in str(error.value)
            router = RouterConfig(name=name, top_k=3, jitter_eps=jitter, normalize_top_k=True)
        check_router_for_lm(router, source)
        config = hf.from_hf(cfg, **router_overrides(router, source, over_type=False))
        assert config.router == name and config.shared_expert_size == 20
        assert config.arch.linear_layers and config.top_k == 3


def test_fine_tuning_reaches_every_parameter():
    """A training-mode gradient of the Qwen3.5 checkpoint under SparseMixer-v2* (sampled
    routes, omega, its own backward pass; every router's own forward and gradient is the
    routers' tests, the hybrid layers are what is new here): finite everywhere, and non-zero
    for the Gated DeltaNet layers' decay, convolution, projections and gated norm, the gate
    half of the attention's q_proj, the router and the shared expert's gate."""
    model, _ = hf.load_pretrained(os.path.join(DATA, "qwen3_5_moe_text"),
                                  router="sparsemixer_v2star", jitter_eps=0.1)
    model.train()
    ids = jnp.asarray(reference("qwen3_5_moe_text")["input_ids"])

    def loss_fn(m):
        return token_nll(m(ids)[:, :-1], ids[:, 1:]).mean()

    grads = nnx.jit(nnx.grad(loss_fn))(model)
    flat = {path_name(path): np.asarray(g)
            for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads))}
    assert all(np.isfinite(g).all() for g in flat.values())
    for part in ("linear_attn/A_log", "linear_attn/dt_bias", "linear_attn/conv1d",
                 "linear_attn/norm/weight", "linear_attn/in_proj_qkv/kernel",
                 "linear_attn/in_proj_z/kernel", "linear_attn/in_proj_b/kernel",
                 "linear_attn/in_proj_a/kernel", "self_attn/q_proj/kernel", "moe/router/kernel",
                 "shared_experts/gate/kernel"):
        found = [g for name, g in flat.items() if name.endswith(part)]
        assert found and all(np.abs(g).max() > 0 for g in found), part
    # The gate half of each head's q_proj columns (per head: 8 query, then 8 gate columns).
    q_proj = next(g for name, g in flat.items() if name.endswith("self_attn/q_proj/kernel"))
    assert np.abs(q_proj.reshape(*q_proj.shape[:-1], 4, 2, 8)[..., 1, :]).max() > 0


def test_packed_documents_do_not_see_each_other():
    """Two rows whose second documents are the same 7 tokens after different first documents
    (``segment_ids``, positions restarting): the second documents' logits are equal, so neither
    the attention layers nor the Gated DeltaNet layers (state and convolution restarted) carry
    anything across a document boundary; the first documents' differ."""
    model, _ = hf.load_pretrained(os.path.join(DATA, "qwen3_5_moe_text"))
    ids = jnp.asarray(reference("qwen3_5_moe_text")["input_ids"])
    packed = ids.at[1, 5:].set(ids[0, 5:])
    segments = jnp.broadcast_to(jnp.asarray([0] * 5 + [1] * 7), packed.shape)
    positions = jnp.broadcast_to(jnp.asarray(list(range(5)) + list(range(7))), packed.shape)
    logits = np.asarray(nnx.jit(lambda m: m(packed, segment_ids=segments,
                                            positions=positions))(model))
    # Equal up to float32 rounding: the chunked delta rule's decay ratios within a chunk come
    # from cumulative log decays that include the first document's, which round differently
    # per row (1e-5 of the largest; anything carried across the boundary moves them by the
    # first documents' difference, over 1e-2).
    np.testing.assert_allclose(logits[0, 5:], logits[1, 5:], rtol=0,
                               atol=1e-5 * np.abs(logits).max())
    assert np.abs(logits[0, :5] - logits[1, :5]).max() > 1e-2 * np.abs(logits).max()


def test_hybrid_flops_count_its_tensors():
    """Model FLOPs of the hybrids' token mixing: 2 per weight per token of every attention and
    Gated DeltaNet projection and convolution (counted from the reference checkpoint's tensors,
    the gate half of q_proj included), x 3 for the backward; the scores over (L + 1) / 2 keys
    on the attention layers, 6 dk dv per value head on the Gated DeltaNet layers."""
    from sparsemixer_jax.aot.model_flops import lm_flops_per_token

    config = hf.from_hf(read_json(os.path.join(DATA, "qwen3_next", "config.json")))
    with safe_open(os.path.join(DATA, "qwen3_next", "model.safetensors"), "np") as f:
        weights = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys()  # noqa: SIM118
                      if (".self_attn." in k or ".linear_attn." in k)
                      and k.endswith(("proj.weight", "ba.weight", "qkvz.weight", "conv1d.weight")))
    got = lm_flops_per_token(config, 12)
    assert got["attention_proj"] == 3 * 2 * weights
    a = config.arch
    assert got["attention_scores"] == 3 * (2 * 2 * 13 / 2 * a.num_heads * 2 * a.head_dim
                                           + 2 * 6 * 4 * a.linear_key_head_dim
                                           * a.linear_value_head_dim)


@pytest.mark.slow  # fast counterparts: the router and fine-tuning gradient tests above
def test_the_language_model_task_fine_tunes_and_exports_qwen3_5(tmp_path):
    """The Hub's Qwen3.5-MoE directory (with a word-level tokenizer) fine-tuned 2 steps by the
    language-model task under SparseMixer-v2* (``init_router="config"``), then exported: a
    finite validation loss, and the export a ``qwen3_5_moe_text`` checkpoint recording the
    trained routing that loads back to the trained model."""
    from sparsemixer_jax.tasks import lm_export
    from sparsemixer_jax.tasks.language_model import train_lm
    from tests import tiny_lm_config
    from tests.test_lm_task import _word_tokenizer, tiny

    corpus = tiny_lm_config.write_corpus(str(tmp_path / "corpus"))
    path = str(tmp_path / "ckpt")
    shutil.copytree(VL_DIR, path)
    _word_tokenizer(corpus, 97).save(os.path.join(path, "tokenizer.json"))
    workdir = str(tmp_path / "w")
    train_lm(tiny(corpus, init_from=path, train_steps=2, eval_every=2, checkpoint_every=2,
                  init_router="config", **{"data.wikitext": "", "sample.tokens": 0,
                                           "router.top_k": 3}), workdir)
    assert np.isfinite(read_json(os.path.join(workdir, "results.json"))["valid_loss"])
    out = str(tmp_path / "out")
    lm_export.export_run(workdir, out)
    saved = read_json(os.path.join(out, "config.json"))
    assert saved["model_type"] == "qwen3_5_moe_text"
    assert saved[hf.ROUTING_KEY]["router"] == "sparsemixer_v2star"
    _, config = hf.load_pretrained(out)
    assert config.router == "sparsemixer_v2star" and config.arch.linear_layers == (True,) * 3 + (
        False,)
