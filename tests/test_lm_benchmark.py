"""The language model's benchmark section (``lm_throughput``, lab.benchmarks.lm_step) and its
model-FLOP count. Tiny sizes, one repeat: the section runs end to end and writes what
docs/benchmarks.md reads, never how fast anything is."""

from __future__ import annotations

import dataclasses
import json
import math

from configs import lm_quickstart
from lab.benchmarks import flops, lm_step, report, runner
from sparsemixer_jax.models.lm_config import LMConfig
from sparsemixer_jax.tasks.language_model import LMTask
from sparsemixer_jax.training.cli import load_config_file

TINY_LM = {"emb": 16, "mlp": 16, "heads": 2, "kv_heads": 1, "layers": 1, "vocab": 64,
           "tokens": 32, "length": 16, "warmup": 1, "repeats": 1}


def test_lm_throughput_section_writes_sane_json(tmp_path):
    out = tmp_path / "bench.json"
    runner.run(runner.BenchmarkSettings(out=str(out), sections=["lm_throughput", "lm_profile"],
                                        lm_routers=["sparsemixer_v2"], attention_impl="xla",
                                        profile_dir=str(tmp_path / "trace"), profile_steps=1,
                                        **TINY_LM),
               command="test")
    result = json.loads(out.read_text())
    lm = result["lm_throughput"]
    assert lm["attention_impl"] == result["lm_profile"]["attention_impl"] == "xla"
    # The profile traced its step and summarised the trace (what the summary finds on a CPU
    # depends on which threads XLA ran the tiny program on; the GPU layout is tested on a
    # synthesized trace in test_benchmark.py).
    profile = result["lm_profile"]
    assert profile["steps"] == 1 and profile["wall_s_per_step_traced"] > 0
    assert {"device_s_per_step", "categories", "top_ops"} <= set(profile)
    arms = ("top2", "sparsemixer_v2", "dense")
    assert lm["tokens_per_step"] == 32 and lm["sizes"]["experts"] == 8
    for name in arms:
        a = lm[name]
        assert a["tokens_per_s"] > 0 and math.isfinite(a["tokens_per_s"])
        lo, hi = a["tokens_per_s_range"]
        assert lo <= a["tokens_per_s"] <= hi
        assert a["to_top2"]["paired_ratio"]["n"] == 1
        assert a["model_flops_per_token"]["total"] > 0
    assert lm["top2"]["router"] == "switch" and lm["dense"]["router"] is None
    assert lm["sparsemixer_v2"]["router"] == "sparsemixer_v2"
    # Equal active parameters: the dense MLP (width 2 x 16) has the two chosen experts'
    # matmul parameters; the MoE model adds its router (16 x 8) and nothing else.
    assert lm["top2"]["active_params"] - lm["dense"]["active_params"] == 16 * 8
    assert lm["top2"]["num_params"] - lm["top2"]["active_params"] == (8 - 2) * 3 * 16 * 16
    assert lm["top2"]["model_flops_per_token"]["ffn"] == \
        lm["dense"]["model_flops_per_token"]["ffn"]
    assert lm["moe_to_dense"]["paired"]["n"] == lm["moe_to_dense"]["paired_cpu"]["n"] == 1
    assert lm["top2"]["to_top2"]["ratio"] == 1.0
    tables = report.markdown_tables({"lm_throughput": lm})
    assert "| top2 |" in tables and "| dense |" in tables


def test_lm_bench_config_gives_the_target_sizes_and_its_dense_twin():
    sizes = lm_step.lm_sizes_of(load_config_file("configs/lm_bench.py:moe"))
    assert sizes == {"emb": 2048, "mlp": 2048, "heads": 16, "kv_heads": 4, "layers": 16,
                     "vocab": 32768, "tokens": 65536, "length": 4096, "experts": 8, "top_k": 2,
                     "micro_rows": 8}
    assert lm_step.micro_batches_of(sizes) == 2
    # The benchmark's dense arm, built from the MoE config, is the :dense variant's model: every
    # field equal but those only the (unused) MoE layers read.
    twin = lm_step.dense_twin(LMTask.from_config(load_config_file("configs/lm_bench.py:moe")))
    dense = LMTask.from_config(load_config_file("configs/lm_bench.py:dense"))
    moe_only = {"moe_intermediate_size", "num_experts", "dispatch", "hf_config"}
    # The sections' fields (dispatch, the widths) side by side with the others.
    a, b = ({**d.pop("arch"), **d.pop("execution"), **d}
            for d in (dataclasses.asdict(twin.lm), dataclasses.asdict(dense.lm)))
    assert {k for k in a if a[k] != b[k]} <= moe_only
    assert not any(twin.lm.arch.moe_layers) and twin.lm.arch.intermediate_size == 4096


def test_lm_throughput_from_a_config_runs_its_micro_batches():
    c = lm_quickstart.get_config()
    c.data.update(vocab_size=64, seq_len=16, batch_size=4, micro_batch_size=2)
    c.model.update(hidden_size=16, mlp_dim=16, num_layers=1, num_heads=2, num_kv_heads=1,
                   num_experts=4)
    out = lm_step.bench_lm_throughput(lm_step.lm_sizes_of(c), "float32", 1, 1, routers=[],
                                      base=c)
    assert out["micro_batches"] == 2 and out["tokens_per_step"] == 4 * 16
    assert out["sizes"]["experts"] == 4 and out["top2"]["router"] == "switch"
    # Model FLOPs are per update: the two micro-batches' tokens.
    flops_per_step = out["top2"]["model_flops_per_token"]["total"] * 64
    assert math.isclose(out["top2"]["achieved_flops_per_s"] * out["top2"]["step_s"]["median"],
                        flops_per_step, rel_tol=1e-12)


def _tiny_lm(router: str = "switch") -> LMConfig:
    # head_dim 6 apart from hidden / heads = 2, grouped-query attention (4 query heads on 2
    # key/value heads), one dense layer and one routed layer.
    return LMConfig.build(model_type="qwen3_moe", vocab_size=50, hidden_size=8, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=6, intermediate_size=20,
                    moe_intermediate_size=12, num_experts=4, top_k=2,
                    moe_layers=(False, True), router=router,
                    norm_topk_prob=router != "sparsemixer_v2")


def test_lm_flops_match_a_hand_count():
    seq = 10
    # Forward, per token. Attention projections per layer: q 2*8*24 = 384, k and v 2*8*12 = 192
    # each, out 2*24*8 = 384: 1152, two layers 2304. Scores and weighted sum over the causal
    # lower triangle, 11/2 keys a query on average: 4*5.5*4*6 = 528 per layer, 1056.
    # Feed-forward: dense 6*8*20 = 960, routed two experts 2*6*8*12 = 1152: 2112.
    # Router 2*8*4 = 64 (one routed layer). LM head 2*8*50 = 800. Sum 6336; training x 3.
    got = flops.lm_flops_per_token(_tiny_lm(), seq)
    assert got["attention_proj"] == 3 * 2304
    assert got["attention_scores"] == 3 * 1056
    assert got["ffn"] == 3 * 2112
    assert got["router"] == 3 * 64
    assert got["lm_head"] == 3 * 800
    assert got["unchosen"] == 0
    assert got["total"] == 19008
    # SparseMixer runs the same matmuls as top-k.
    assert flops.lm_flops_per_token(_tiny_lm("sparsemixer_v2"), seq)["total"] == 19008
    # DenseMixer: every token through all 4 SwiGLU experts, forward only (4*6*8*12 = 2304),
    # plus the unchosen-expert term, 2*4*8 forward and as much backward (128).
    dm = flops.lm_flops_per_token(_tiny_lm("densemixer"), seq)
    assert dm["unchosen"] == 2304 + 128
    assert dm["total"] == 19008 + 2432



def test_document_masks_set_the_model_field_or_drop_the_segment_ids():
    import jax
    import pytest
    from flax import nnx

    from sparsemixer_jax.models.causal_lm import CausalLM

    sizes = {**{k: v for k, v in TINY_LM.items() if k not in ("warmup", "repeats")},
             "experts": 4, "top_k": 2}
    config = lm_step.lm_model_config(sizes, "switch", "float32", document_mask="offsets")
    assert config.model.cudnn_document_mask == "offsets"
    causal = lm_step.lm_model_config(sizes, "switch", "float32", document_mask="causal")
    assert causal.model.cudnn_document_mask == "bias"  # the config's; the batch changes
    with pytest.raises(ValueError, match=r"document_mask='mask'; choose one of bias, offsets"):
        lm_step.lm_model_config(sizes, "switch", "float32", document_mask="mask")
    with_ids = lm_step.synthetic_lm_batch(sizes)
    without = lm_step.synthetic_lm_batch(sizes, segments=False)
    assert "segments" in with_ids and "segments" not in without
    # One document a row: the loss without segment ids is the loss with them, to the bit.
    task = LMTask.from_config(causal)
    model = CausalLM(task.lm, rngs=nnx.Rngs(params=0, router=1))
    key = jax.random.key(0)
    losses = [float(task.loss(model, batch, key)[0]) for batch in (with_ids, without)]
    assert losses[0] == losses[1] and math.isfinite(losses[0])
