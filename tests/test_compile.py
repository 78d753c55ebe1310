"""Deviceless compiles on this CPU (``sparsemixer_jax.aot``): the translation model with its
experts split over the design card's TPU v5e 4x4 slice and over 8 H100s, and the MoE layer's
grouped kernels for one H100.

Each program is compiled once per module and shared by the assertions. They check what is known
before any hardware runs: that the target's compiler (not the CPU's: the devices are the
target's) accepts the program, the per-device memory against the chip's HBM, the collectives of
expert parallelism, and the number of Mosaic GPU kernels. The default run compiles a two-layer
model on the TPU slice and the grouped layer at the benchmark's size (about 40 s of CPU);
Transformer-base itself takes minutes of CPU per target and runs with ``-m slow``. The packages
are in requirements-compile.txt; without them these tests skip, saying which is missing.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import wmt
from sparsemixer_jax.aot import targets, translation
from sparsemixer_jax.aot.analysis import analyse
from sparsemixer_jax.moe import MoEFeedForward
from sparsemixer_jax.tasks import run_config
from sparsemixer_jax.training.steps import count_params
from tests import kit

GiB = 2**30


def _design_card(num_experts: int = 4):
    """Transformer-base, N experts, experts split over the mesh's expert axis."""
    config = wmt.get_config(f"n{num_experts}")
    config.mesh.expert = num_experts
    return config


@functools.cache
def _programs(spec: str, size: str):
    """The training programs of the design card ("base") or of a two-layer model with the same
    structure ("small": Transformer-base takes minutes of CPU to compile, so it is slow)."""
    target, devices = kit.target_devices_or_skip(spec)
    config = _design_card() if size == "base" else _small_design_card()
    reports = translation.compile_translation(kit.run_for_target(config, target), devices,
                                              decode_step=False)
    return target, config, {r.name.split(" ")[0]: r for r in reports}


def _small_design_card():
    config = _design_card()
    config.model.update(encoder_layers=1, decoder_layers=1, emb_dim=64, mlp_dim=128,
                        num_heads=2)
    config.data.update(vocab_size=512, max_len=32, max_tokens=1024)
    config.optim.tokens_per_update = 2048  # two micro-batches: accumulate, then update
    return config


def _param_bytes(config) -> int:
    model = translation.abstract_model(run_config(config))
    return 4 * count_params(nnx.state(model, nnx.Param))


def _check_training_programs(target, config, programs):
    moe_layers = len(range(0, int(config.model.encoder_layers), int(config.model.moe_every)))
    moe_layers += len(range(0, int(config.model.decoder_layers), int(config.model.moe_every)))
    # 2^17 (small: 2^11) tokens per update from micro-batches of data.max_tokens: the loop
    # accumulates, then updates.
    assert set(programs) == {"accumulate", "update"}
    accumulate = programs["accumulate"]
    assert accumulate.total < target.hbm_bytes
    # Expert weights are split over the expert axis: a device holds less than the model (and
    # the accumulator of its gradient).
    assert accumulate.arguments < 2 * _param_bytes(config)
    # Tokens travel to their experts' devices and back, forward and backward, in every MoE
    # layer; the gradient of the replicated weights is summed over the devices.
    assert accumulate.collectives.get("all-to-all", 0) >= 2 * moe_layers
    assert accumulate.collectives.get("all-reduce", 0) >= 1
    assert "all-to-all" not in programs["update"].collectives


@pytest.mark.parametrize("spec", [
    "tpu:v5e:4x4", pytest.param("h100:1x1x8", marks=pytest.mark.slow)])
def test_expert_parallel_training_step_compiles_on_the_design_cards_mesh(spec):
    """The design card's slice and mesh (4 x 4, experts split 4 ways), a two-layer model."""
    _check_training_programs(*_programs(spec, "small"))


@pytest.mark.slow  # minutes of CPU each
@pytest.mark.parametrize("spec", ["tpu:v5e:4x4", "h100:1x1x8"])
def test_design_card_training_step_compiles_and_fits(spec):
    _check_training_programs(*_programs(spec, "base"))


# Transformer-base N=4: MoE on layers 0, 2, 4 of the encoder and of the decoder.
MOE_LAYERS = 6


def _layer_gradient(layer_args: dict, tokens: int, dtype) -> tuple:
    """Forward and every gradient of one MoE layer at the benchmark's size, built abstractly."""
    sections = kit.moe_sections(layer_args["num_experts"], top_k=layer_args["top_k"],
                                dispatch=layer_args["dispatch"])
    layer = nnx.eval_shape(lambda: MoEFeedForward(
        (layer_args["emb_dim"], layer_args["mlp_dim"]), *sections, dtype=dtype,
        rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x, rest):
        rest = jax.tree.map(lambda v: v, rest)  # RNG counters owned by this trace level
        y, aux = nnx.merge(graphdef, params, rest)(x)
        # Squared: the gradient of a plain sum would not need y, and XLA would drop the
        # forward's second grouped matmul.
        return 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32))) + aux["balance_loss"]

    x = jax.ShapeDtypeStruct((8, tokens // 8, layer_args["emb_dim"]), dtype)
    return jax.grad(loss, argnums=(0, 1)), (params, x, rest)


@functools.cache
def _grouped_layer_on_one_h100(top_k: int = 1, dtype=jnp.bfloat16):
    target, devices = kit.target_devices_or_skip("h100:1x1x1")
    device = devices[0]
    args = dict(emb_dim=512, mlp_dim=2048, num_experts=4, top_k=top_k, dispatch="grouped")
    with jax.default_device(device):  # the kernels' sm90 check asks the target device
        fn, inputs = _layer_gradient(args, 32768, dtype)
        placed = jax.sharding.SingleDeviceSharding(device)
        inputs = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), inputs)
        compiled = jax.jit(fn).lower(*inputs).compile()
    return target, analyse("grouped layer", compiled, 0.0)


def test_grouped_moe_layer_compiles_to_mosaic_kernels_for_one_h100():
    target, report = _grouped_layer_on_one_h100()
    # Forward: two grouped matmuls (wi, wo). Backward: the two input gradients and the two
    # weight gradients (weight_grad="kernel" on a GPU). Each is one Mosaic GPU kernel.
    assert report.kernels == 6
    assert 0 < report.total < target.hbm_bytes


@pytest.mark.slow  # about a minute of CPU each; python -m pytest -q -m slow tests/test_compile.py
@pytest.mark.parametrize("top_k, dtype", [(2, jnp.bfloat16), (1, jnp.float16),
                                          (2, jnp.float16)])
def test_grouped_moe_layer_variants_compile_for_one_h100(top_k, dtype):
    target, report = _grouped_layer_on_one_h100(top_k, dtype)
    assert report.kernels == 6
    assert 0 < report.total < target.hbm_bytes


# The tile configurations of tests/test_grouped_ffn.py (64/64/64), of the benchmark (128/128,
# block_k 64: its defaults) and of experiments/gpu_campaign.sh (the benchmark's defaults), and
# the weight gradient by XLA instead of the kernel (4 kernels: the two weight gradients are
# XLA's ragged dots).
@pytest.mark.slow
@pytest.mark.parametrize("flags, kernels", [
    ([], 6),
    (["--block-m", "64", "--block-n", "64", "--block-k", "64"], 6),
    (["--dtype", "float16"], 6),
    (["--weight-grad", "xla"], 4),
], ids=["defaults", "tiles-64", "float16", "weight-grad-xla"])
def test_benchmark_compiles_every_tile_configuration_for_one_h100(flags, kernels, tmp_path):
    kit.target_devices_or_skip("h100:1x1x1")
    from lab.benchmarks import grouped_ffn as benchmark

    result = benchmark.main(["--target", "h100:1x1x1", "--experts", "4", "--capacities",
                             "--json", str(tmp_path / "b.json"), *flags])
    rows = {row["dispatch"]: row for row in result["rows"]}
    assert set(rows) == {"dense", "padded", "grouped"}
    assert all("error" not in row and "ms" not in row for row in rows.values())
    assert rows["grouped"]["compile_time_model"]["mosaic_kernels"] == kernels
    assert rows["dense"]["compile_time_model"]["mosaic_kernels"] == 0
    for row in rows.values():
        assert 0 < row["compile_time_model"]["total_bytes"] < targets.H100_HBM_BYTES


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["grouped", "padded", "dense"])
def test_design_card_training_step_compiles_for_one_h100(dispatch):
    target, devices = kit.target_devices_or_skip("h100:1x1x1")
    config = wmt.get_config("dense" if dispatch == "dense" else "n4")
    config.optim.tokens_per_update = 0  # one micro-batch: the fused training step
    if dispatch != "dense":
        config.model.dispatch = dispatch
    reports = translation.compile_translation(kit.run_for_target(config, target), devices,
                                              decode_step=False)
    (step,) = reports
    assert step.total < target.hbm_bytes
    assert step.kernels == (6 * MOE_LAYERS if dispatch == "grouped" else 0)


@pytest.mark.slow
def test_design_card_decode_step_compiles_for_a_tpu_v5e_4x4():
    target, devices = kit.target_devices_or_skip("tpu:v5e:4x4")
    config = _design_card()
    config.optim.tokens_per_update = 0
    reports = translation.compile_translation(kit.run_for_target(config, target), devices)
    assert [r.name.split(" ")[0] for r in reports] == ["train", "beam"]
    assert all(r.total < target.hbm_bytes for r in reports)
    assert reports[1].collectives.get("all-to-all", 0) >= 2 * MOE_LAYERS


@functools.cache
def _fsdp_programs():
    """The two-layer design card on the TPU slice with parameters and Adam state sharded 4 ways
    as well (mesh 1 x 4 x 4: fsdp 4, experts over 4)."""
    target, devices = kit.target_devices_or_skip("tpu:v5e:4x4")
    config = _small_design_card()
    config.mesh.update(data=1, fsdp=4)
    reports = translation.compile_translation(kit.run_for_target(config, target), devices,
                                              decode_step=False)
    return {r.name.split(" ")[0]: r for r in reports}


def test_fsdp_training_programs_shard_parameters_and_adam_state():
    """Against the design card's mesh (4 x 4: experts split, the rest replicated), the same
    model with the width over an fsdp axis of 4: each device holds a quarter of the dense
    weights and a sixteenth of the experts', of their gradient accumulator and of Adam's
    moments (XLA's own count of the programs' arguments shrinks accordingly), and XLA gathers
    the weights before use."""
    target, config, replicated = _programs("tpu:v5e:4x4", "small")
    sharded = _fsdp_programs()
    model = translation.abstract_model(run_config(config))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    expert_bytes = sum(4 * a.size for path, a in jax.tree_util.tree_leaves_with_path(params)
                       if path[-1].key in ("wi", "wo", "bi", "bo"))
    dense_bytes = 4 * count_params(params) - expert_bytes
    assert replicated["update"].parameters == expert_bytes // 4 + dense_bytes
    # Vectors whose logical axes map to no mesh axis stay whole (norm scales, attention and
    # expert hidden biases): 4% more than an even split here.
    assert sharded["update"].parameters < 1.1 * (expert_bytes // 16 + dense_bytes // 4)
    for program in ("update", "accumulate"):
        assert sharded[program].optimizer_state < 2.01 * sharded[program].parameters
        # XLA's memory analysis (TPU layouts pad small arrays): well under a third as much.
        assert sharded[program].arguments < 0.33 * replicated[program].arguments, program
        assert sharded[program].total < target.hbm_bytes
    assert sharded["accumulate"].collectives.get("all-gather", 0) >= 1
    assert "all-gather" not in replicated["accumulate"].collectives
    assert sharded["accumulate"].largest_buffer[1] > 0


def test_a_config_that_does_not_fit_names_its_largest_buffer():
    from sparsemixer_jax.aot.command import summary_line

    result = {"target": "tpu:v5e:4x4", "hbm_bytes": 16 * GiB, "programs": [
        {"name": "update", "total": 2 * GiB, "largest_buffer": ["f32[8]", 32]},
        {"name": "train step", "total": 20 * GiB,
         "largest_buffer": ["f32[4096,4096,64]", 4 * GiB]}]}
    assert summary_line(result) == (
        "tpu:v5e:4x4: DOES NOT FIT: the largest program (train step) needs 20.00 GiB of 16.00 "
        "GiB per device, over by 4.00 GiB; its largest buffer is f32[4096,4096,64] (4.00 GiB)")


def test_largest_buffer_leaves_fusions_out():
    from sparsemixer_jax.aot.analysis import largest_buffer

    hlo = """HloModule m
%fused_computation (p: f32[4,4]) -> f32[4] {
  %big = f32[1024,1024]{1,0} broadcast(%p), dimensions={}
  ROOT %r = f32[4]{0} reduce(%big)
}
ENTRY %main (a: f32[4,4], /*index=1*/b: f32[2]) -> f32[4] {
  %a = f32[4,4]{1,0} parameter(0)
  %b = bf16[16,16]{1,0:T(8,128)} convert(%a)
  %t = (f32[2]{0}, s8[300]{0}) fusion(%a), kind=kLoop, calls=%fused_computation
  ROOT %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation
}
"""
    assert largest_buffer(hlo) == ("bf16[16,16]", 512)
    assert largest_buffer(hlo.replace("bf16[16,16]", "bf16[1,16]")) == ("s8[300]", 300)
