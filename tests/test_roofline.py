"""The roofline of compiled programs (``sparsemixer_jax.aot.roofline``): its arithmetic on
hand-written optimised HLO (a matmul, an elementwise chain in a loop, collectives, a cuBLAS GEMM,
cuDNN attention, Pallas kernels), and ``--roofline`` end to end on a one-layer dense language
model compiled for one H100 without the hardware (skipped without the compile packages of
requirements-compile.txt).

The chip of the arithmetic tests has round figures (1 TFLOP/s, 1 GB/s, a 0.1 GB/s link), so
every expected time below is the hand count divided by a power of ten.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from sparsemixer_jax.aot import command, hlo, roofline, targets
from tests import kit

CHIP = roofline.Chip("round", peak_flops=1e12, hbm_bandwidth=1e9, link_bandwidth=1e8,
                     source="test")


def _ops(text: str, devices: int = 1) -> dict[str, roofline.Op]:
    return {op.name: op for op in roofline.program_ops(hlo.parse_module(text), devices)}


MATMUL = """HloModule m

FileNames
1 "/home/someone/project/sparsemixer_jax/models/causal_lm.py"

FunctionNames
1 "Attention.attend"

FileLocations
1 {file_name_id=1 function_name_id=1 line=209 end_line=209 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%gemm_computation (p0: bf16[256,512], p1: bf16[1024,512]) -> bf16[256,1024] {
  %p0 = bf16[256,512]{1,0} parameter(0)
  %p1 = bf16[1024,512]{1,0} parameter(1)
  ROOT %dot.1 = bf16[256,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, \
rhs_contracting_dims={1}
}

ENTRY %main (a: bf16[256,512], b: bf16[1024,512]) -> bf16[256,1024] {
  %a = bf16[256,512]{1,0} parameter(0)
  %b = bf16[1024,512]{1,0} parameter(1)
  ROOT %gemm = bf16[256,1024]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_computation, \
metadata={op_name="jit(f)/dot_general" stack_frame_id=1}
}
"""


def test_a_matmul_fusion_costs_its_flops_and_its_operands_and_output():
    (op,) = _ops(MATMUL).values()
    flops = 2 * 256 * 512 * 1024
    moved = 2 * (256 * 512 + 1024 * 512 + 256 * 1024)
    assert (op.kind, op.flops, op.bytes, op.count) == ("gemm", flops, moved, 1)
    assert op.source == "sparsemixer_jax/models/causal_lm.py:209 (Attention.attend)"
    # 268 MFLOP at 1 TFLOP/s (268 us) against 1.57 MB at 1 GB/s (1.57 ms): memory-bound.
    assert op.bound(CHIP) == "memory"
    result = roofline.roofline(MATMUL, CHIP, model_flops=flops / 2, calibration=roofline.PURE)
    assert result["predicted_seconds_pure"] == pytest.approx(moved / 1e9, rel=1e-12)
    assert result["mfu_bound_pure"] == pytest.approx(flops / 2 / 1e12 / (moved / 1e9),
                                                     rel=1e-12)
    assert result["top_ops"][0]["shapes"] == "bf16[256,1024] <- bf16[256,512], bf16[1024,512]"


def test_the_calibration_adds_a_kernel_cost_and_slows_small_matmuls():
    calibration = roofline.Calibration(kernel_seconds=1e-3, gemm_peak_fraction=0.5,
                                       gemm_half_flops=2 * 256 * 512 * 1024,
                                       memory_fraction=0.5)
    fast = roofline.Chip("fast memory", peak_flops=1e12, hbm_bandwidth=1e15,
                         link_bandwidth=1e8, source="test")
    (op,) = _ops(MATMUL).values()
    # Compute-bound on this chip: the matmul reaches 0.5 x (F / (F + F)) = 25% of peak.
    assert op.seconds(fast, calibration) == pytest.approx(op.flops / 0.25e12 + 1e-3, rel=1e-12)
    # Memory-bound on the round chip: half its bandwidth.
    assert op.seconds(CHIP, calibration) == pytest.approx(op.bytes / 0.5e9 + 1e-3, rel=1e-12)


LOOP = """HloModule m

%body_fusion (p0: f32[6,1024,256], p1: s32[], p2: f32[1024,256]) -> f32[6,1024,256] {
  %p0 = f32[6,1024,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[1024,256]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %slice = f32[1,1024,256]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), \
dynamic_slice_sizes={1,1024,256}
  %row = f32[1024,256]{1,0} bitcast(%slice)
  %sum = f32[1024,256]{1,0} add(%row, %p2)
  %exp = f32[1024,256]{1,0} exponential(%sum)
  %mul = f32[1024,256]{1,0} multiply(%exp, %p2)
  %update = f32[1,1024,256]{2,1,0} bitcast(%mul)
  %whole = f32[6,1024,256]{2,1,0} bitcast(%p0)
  ROOT %dus = f32[6,1024,256]{2,1,0} dynamic-update-slice(%whole, %update, %p1, %zero, %zero)
}

%body (state: (s32[], f32[6,1024,256], f32[1024,256])) -> (s32[], f32[6,1024,256], f32[1024,256]) {
  %state = (s32[], f32[6,1024,256]{2,1,0}, f32[1024,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %stack = f32[6,1024,256]{2,1,0} get-tuple-element(%state), index=1
  %x = f32[1024,256]{1,0} get-tuple-element(%state), index=2
  %chain = f32[6,1024,256]{2,1,0} fusion(%stack, %i, %x), kind=kLoop, calls=%body_fusion
  ROOT %next = (s32[], f32[6,1024,256]{2,1,0}, f32[1024,256]{1,0}) tuple(%i, %chain, %x)
}

%condition (state: (s32[], f32[6,1024,256], f32[1024,256])) -> pred[] {
  %state = (s32[], f32[6,1024,256]{2,1,0}, f32[1024,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (s: (s32[], f32[6,1024,256], f32[1024,256])) -> (s32[], f32[6,1024,256], \
f32[1024,256]) {
  %s = (s32[], f32[6,1024,256]{2,1,0}, f32[1024,256]{1,0}) parameter(0)
  ROOT %loop = (s32[], f32[6,1024,256]{2,1,0}, f32[1024,256]{1,0}) while(%s), \
condition=%condition, body=%body, backend_config={"known_trip_count":{"n":"6"}}
}
"""


def test_an_elementwise_chain_in_a_scanned_layer_reads_one_slice_and_updates_in_place():
    ops = _ops(LOOP)
    chain = ops["chain"]
    layer = 4 * 1024 * 256  # one f32 [1024, 256] slice
    # Reads its layer's slice of the stack, x and the index (4 bytes), writes one layer in
    # place: not the stack.
    assert (chain.kind, chain.flops, chain.bytes, chain.count) == \
        ("fusion", 0.0, 3 * layer + 4, 6)
    # The loop condition's scalar comparison is bookkeeping, not a kernel.
    assert set(ops) == {"chain"}
    result = roofline.roofline(LOOP, CHIP, model_flops=None)
    assert result["predicted_seconds_pure"] == pytest.approx(6 * (3 * layer + 4) / 1e9,
                                                             rel=1e-12)
    assert result["kernels"] == 6 and result["mfu_bound"] is None
    # Without the trip count in the loop's backend config (as TPU programs have it), the
    # condition's bound says the same: i < 6 from 0.
    unknown = LOOP.replace(', backend_config={"known_trip_count":{"n":"6"}}', "")
    assert "known_trip_count" not in unknown
    assert _ops(unknown)["chain"].count == 6


COLLECTIVES = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

ENTRY %main (g: f32[1024,1024], w: bf16[512,256]) -> (f32[1024,1024], bf16[2048,256]) {
  %g = f32[1024,1024]{1,0} parameter(0)
  %w = bf16[512,256]{1,0} parameter(1)
  %reduced = f32[1024,1024]{1,0} all-reduce(%g), replica_groups={{0,1,2,3},{4,5,6,7}}, \
to_apply=%add
  %gather = (bf16[512,256]{1,0}, bf16[2048,256]{1,0}) all-gather-start(%w), dimensions={0}, \
replica_groups=[2,4]<=[8]
  %gathered = bf16[2048,256]{1,0} all-gather-done(%gather)
  ROOT %out = (f32[1024,1024]{1,0}, bf16[2048,256]{1,0}) tuple(%reduced, %gathered)
}
"""


def test_collectives_cost_their_ring_traffic_at_the_link_bandwidth():
    ops = _ops(COLLECTIVES, devices=8)
    assert set(ops) == {"reduced", "gather"}  # the -done half launches nothing
    buffer, shard = 4 * 1024 * 1024, 2 * 512 * 256
    # Ring all-reduce over 4 devices: 2 (n-1)/n of the buffer; all-gather: (n-1) x the shard.
    assert ops["reduced"].link_bytes == 2 * 3 / 4 * buffer
    assert ops["gather"].link_bytes == 3 * shard
    assert ops["reduced"].bound(CHIP) == "link"
    result = roofline.roofline(COLLECTIVES, CHIP, None, devices=8)
    assert result["predicted_seconds_pure"] == pytest.approx((1.5 * buffer + 3 * shard) / 1e8,
                                                             rel=1e-12)
    assert result["link_bytes"] == 1.5 * buffer + 3 * shard


GEMM = """HloModule m

ENTRY %main (a: bf16[8192,1024], b: bf16[1024,4096]) -> bf16[8192,4096] {
  %a = bf16[8192,1024]{1,0} parameter(0)
  %b = bf16[1024,4096]{1,0} parameter(1)
  %gemm = (bf16[8192,4096]{1,0}, s8[33554432]{0}) custom-call(%a, %b), \
custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,\
"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],\
"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %out = bf16[8192,4096]{1,0} get-tuple-element(%gemm), index=0
}
"""


def test_a_cublas_gemm_counts_from_its_shapes_and_dimension_numbers():
    (op,) = _ops(GEMM).values()
    flops = 2 * 8192 * 1024 * 4096
    moved = 2 * (8192 * 1024 + 1024 * 4096 + 8192 * 4096)  # the workspace is not HBM traffic
    assert (op.kind, op.flops, op.bytes) == ("gemm", flops, moved)
    # 68.7 ms of compute at 1 TFLOP/s against 92.3 ms of traffic at 1 GB/s.
    assert op.bound(CHIP) == "memory"
    assert roofline.roofline(GEMM, CHIP, flops)["predicted_seconds_pure"] == pytest.approx(
        max(flops / 1e12, moved / 1e9), rel=1e-12)


ATTENTION = """HloModule m

ENTRY %main (q: bf16[4,2048,16,64], k: bf16[4,2048,16,64], v: bf16[4,2048,16,64]) -> \
bf16[4,2048,16,64] {
  %q = bf16[4,2048,16,64]{3,2,1,0} parameter(0)
  %k = bf16[4,2048,16,64]{3,2,1,0} parameter(1)
  %v = bf16[4,2048,16,64]{3,2,1,0} parameter(2)
  %fmha = (bf16[4,2048,16,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), \
custom_call_target="__cudnn$fmhaSoftmax", \
backend_config={"cudnn_fmha_backend_config":{"bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","2"],"rhs_batch_dimensions":["0","2"]},"mask_type":"CAUSAL"}}
  ROOT %out = bf16[4,2048,16,64]{3,2,1,0} get-tuple-element(%fmha), index=0
}
"""


# How XLA writes an einsum attention's matmuls for a TPU (from a one-layer model compiled for
# tpu:v5e:2x2: 2 rows a device of 256 tokens, 2 key-value heads of 2 query heads each, head
# width 64): the batch dimensions (rows, heads) become spatial dimensions with a window the
# size of the dimension, dilated or padded so that one tap of it lands on the input.
CONVOLUTIONS = """HloModule m

%scores_computation (q: bf16[2,256,2,64,1], k: bf16[2,256,2,2,64]) -> f32[2,2,256,256,2] {
  %q = bf16[2,256,2,64,1]{4,3,2,1,0} parameter(0)
  %k = bf16[2,256,2,2,64]{4,3,2,1,0} parameter(1)
  ROOT %scores = f32[2,2,256,256,2]{4,3,2,1,0} convolution(%q, %k), \
window={size=2x2x2 pad=0_0x0_0x1_1 lhs_dilate=2x2x1 rhs_reversal=0x0x1}, \
dim_labels=0b1f2_0o12i->01bf2
}

%values_computation (p: f32[2,2,256,256,2], v: bf16[2,256,2,2,64]) -> f32[2,2,256,64,1] {
  %p = f32[2,2,256,256,2]{4,3,2,1,0} parameter(0)
  %v = bf16[2,256,2,2,64]{4,3,2,1,0} parameter(1)
  ROOT %dv = f32[2,2,256,64,1]{4,3,2,1,0} convolution(%p, %v), \
window={size=2x2x2 lhs_dilate=2x2x1}, dim_labels=01bf2_0i12o->01bf2
}

%query_projection (x: bf16[2,256,256,1], w: bf16[4,64,256,1]) -> bf16[2,256,4,64] {
  %x = bf16[2,256,256,1]{3,2,1,0} parameter(0)
  %w = bf16[4,64,256,1]{3,2,1,0} parameter(1)
  ROOT %q = bf16[2,256,4,64]{3,2,1,0} convolution(%x, %w), \
window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
}

%weight_gradient (x: bf16[2,256,256], dy: bf16[2,256,1024]) -> bf16[256,1024,1] {
  %x = bf16[2,256,256]{2,1,0} parameter(0)
  %dy = bf16[2,256,1024]{2,1,0} parameter(1)
  ROOT %dw = bf16[256,1024,1]{2,1,0} convolution(%x, %dy), window={size=2}, \
dim_labels=0fb_0io->bf0
}

ENTRY %main (q: bf16[2,256,2,64,1], k: bf16[2,256,2,2,64]) -> f32[2,2,256,256,2] {
  %q = bf16[2,256,2,64,1]{4,3,2,1,0} parameter(0)
  %k = bf16[2,256,2,2,64]{4,3,2,1,0} parameter(1)
  ROOT %s = f32[2,2,256,256,2]{4,3,2,1,0} fusion(%q, %k), kind=kOutput, \
calls=%scores_computation
}
"""


@pytest.mark.parametrize("computation, flops", [
    ("scores_computation", 2 * 2 * 4 * 256 * 256 * 64),  # rows, query heads, T x T, width
    ("values_computation", 2 * 2 * 4 * 256 * 256 * 64),  # a gradient: the group's heads summed
    ("query_projection", 2 * 2 * 256 * 256 * (4 * 64)),  # tokens x hidden x heads' widths
    ("weight_gradient", 2 * (2 * 256) * 256 * 1024),  # the rows summed: a window of 2
])
def test_a_tpu_convolution_counts_the_taps_that_land_on_its_input(computation, flops):
    """Counting every tap of the window counted these matmuls once per head (or row) too."""
    flops_counted, kind = roofline.computation_flops(hlo.parse_module(CONVOLUTIONS),
                                                     computation)
    assert (flops_counted, kind) == (flops, "gemm")


def test_cudnn_attention_counts_two_batched_matmuls_halved_by_the_causal_mask():
    (op,) = _ops(ATTENTION).values()
    scores = 2 * (4 * 16) * 2048 * 2048 * 64  # q k^T; the weighted sum is as large
    assert (op.kind, op.flops) == ("attention", 2 * scores / 2)
    backward = ATTENTION.replace("fmhaSoftmax", "fmhaSoftmaxBackward")
    assert _ops(backward)["fmha"].flops == 5 * scores / 2
    # Packed documents (cuDNN's segment offsets) are causal within each: half at most.
    packed = ATTENTION.replace('"mask_type":"CAUSAL"', '"mask_type":"PADDING_CAUSAL"')
    assert _ops(packed)["fmha"].flops == 2 * scores / 2
    assert _ops(ATTENTION.replace('"CAUSAL"', '"NO_MASK"'))["fmha"].flops == 2 * scores
    # As XLA prints a compiled program's backend config: a space after each colon.
    spaced = ATTENTION.replace('"mask_type":"CAUSAL"', '"mask_type": "CAUSAL"')
    assert _ops(spaced)["fmha"].flops == 2 * scores / 2


GROUPED = """HloModule m

ENTRY %main (x: bf16[4096,1024], w: bf16[8,1024,2048], sizes: s32[8]) -> bf16[4096,2048] {
  %x = bf16[4096,1024]{1,0} parameter(0)
  %w = bf16[8,1024,2048]{2,1,0} parameter(1)
  %sizes = s32[8]{0} parameter(2)
  ROOT %kernel = bf16[4096,2048]{1,0} custom-call(%x, %w, %sizes), \
custom_call_target="mosaic_gpu_v2", backend_config="..."
}
"""


@pytest.mark.parametrize("operands, output", [
    ("%x, %w, %sizes", "bf16[4096,2048]{1,0}"),  # forward: x [M, K] @ w[g] [K, N]
    ("%y, %w, %sizes", "bf16[4096,1024]{1,0}"),  # input gradient: dy [M, N] @ w[g]^T
    ("%x, %y, %sizes", "bf16[8,1024,2048]{2,1,0}"),  # weight gradient: x_g^T dy_g per group
])
def test_a_pallas_grouped_matmul_counts_2_m_k_n_in_every_role(operands, output):
    text = GROUPED.replace("%x, %w, %sizes", operands).replace(
        "ROOT %kernel = bf16[4096,2048]{1,0}", f"ROOT %kernel = {output}").replace(
        "%sizes = s32[8]{0} parameter(2)",
        "%sizes = s32[8]{0} parameter(2)\n  %y = bf16[4096,2048]{1,0} parameter(3)")
    (op,) = _ops(text).values()
    assert (op.kind, op.flops) == ("kernel", 2 * 4096 * 1024 * 2048)


def test_a_pallas_kernel_that_is_no_matmul_counts_no_flops_and_a_tpu_estimate_is_used():
    text = GROUPED.replace("bf16[8,1024,2048]", "bf16[8,1000,2048]")  # no (grouped) matmul
    assert _ops(text)["kernel"].flops == 0.0
    estimated = GROUPED.replace('"mosaic_gpu_v2", backend_config="..."',
                                '"tpu_custom_call", backend_config={"custom_call_config": {}, '
                                '"cost_estimate": {"flops": 1234, "transcendentals": 0, '
                                '"bytes_accessed": 5678}}')
    op = _ops(estimated)["kernel"]
    assert (op.kind, op.flops, op.bytes) == ("kernel", 1234.0, 5678.0)
    # A TPU program's buffer reservations are no kernels.
    reserved = GROUPED.replace('"mosaic_gpu_v2", backend_config="..."', '"AllocateBuffer"')
    assert _ops(reserved) == {}


SPLASH = """HloModule m

ENTRY %main (q: bf16[4,384,128], k: bf16[2,384,128]) -> bf16[4,384,128] {
  %q = bf16[4,384,128]{2,1,0} parameter(0)
  %k = bf16[2,384,128]{2,1,0} parameter(1)
  %info = s8[1,3,3]{2,1,0} constant({...})
  %splash_mha_fwd_no_residuals.1 = bf16[4,384,128]{2,1,0} custom-call(%info, %q, %k, %k), \
custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 128}"
}}, metadata={op_name="jit(f)/splash_attention_blocks_6_of_9/splash_mha_fwd_no_residuals/\
pallas_call"}, backend_config={"custom_call_config":{}}
  ROOT %after = bf16[4,384,128]{2,1,0} add(%splash_mha_fwd_no_residuals.1, %q)
}
"""


def test_a_splash_kernel_printed_over_several_lines_counts_its_computed_blocks():
    """A TPU kernel prints its frontend attributes over three lines (the last starting with
    ``}}``, which must not end the computation); splash attention's forward is two matmuls of
    ``2 H T S D`` FLOPs over the 6 of 9 score blocks its scope names."""
    ops = _ops(SPLASH)
    assert set(ops) == {"splash_mha_fwd_no_residuals.1", "after"}
    assert ops["splash_mha_fwd_no_residuals.1"].flops == 2 * 2 * 4 * 384 * 384 * 128 * 6 / 9
    unscoped = SPLASH.replace("splash_attention_blocks_6_of_9/", "")
    assert _ops(unscoped)["splash_mha_fwd_no_residuals.1"].flops == 2 * 2 * 4 * 384 * 384 * 128


@pytest.fixture(scope="module")
def tiny_lm_roofline(tmp_path_factory):
    """``python -m experiments.compile ... --roofline --json`` on the language model of the LM
    tests (one dense layer, cuDNN's fused attention), for one H100: its printout and its JSON."""
    kit.target_devices_or_skip("h100:1x1")
    if not targets.module_found("nvidia.cudnn"):
        pytest.skip("cuDNN attention compiles where cuDNN is installed: pip install "
                    "nvidia-cudnn-cu13==9.12.0.46 (or -r requirements-compile.txt)")
    path = tmp_path_factory.mktemp("roofline") / "compile.json"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.compile", "--config", "tests/tiny_lm_config.py",
         "--config.data.vocab_size=512", "--config.data.seq_len=64",
         "--config.data.batch_size=4", "--config.model.compute_dtype=bfloat16",
         # Dense (model.num_experts=0) and one layer: a tenth of the kernels of the two-layer
         # MoE model to compile (loops are the arithmetic tests').
         "--config.model.num_experts=0", "--config.model.num_layers=1",
         "--config.model.attention_impl=cudnn", "--target", "h100:1x1", "--roofline",
         "--json", str(path)],
        capture_output=True, text=True, timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-2000:]
    with open(path) as f:
        return result.stdout, json.load(f)["results"][0]


def test_the_compile_command_reports_a_roofline_per_program(tiny_lm_roofline):
    printed, result = tiny_lm_roofline
    (step,) = result["programs"]
    assert step["name"].startswith("train step")
    # The JSON's keys that readers of --json rely on.
    assert {"predicted_seconds", "mfu_bound", "predicted_seconds_pure", "mfu_bound_pure",
            "top_ops"} <= set(step)
    assert {"predicted_seconds", "mfu_bound", "predicted_seconds_pure",
            "mfu_bound_pure"} <= set(result["step"])
    assert 0 < step["predicted_seconds_pure"] <= step["predicted_seconds"]
    assert 0 < len(step["top_ops"]) <= 15
    assert {"flops", "bytes", "bound", "source", "shapes"} <= set(step["top_ops"][0])
    costs = [op["seconds"] for op in step["top_ops"]]
    assert costs == sorted(costs, reverse=True)
    # The step's matmuls are in the program: XLA computes at least the model's FLOPs.
    assert step["flops"] >= step["model_flops"] > 0
    assert 0 < step["mfu_bound"] <= step["mfu_bound_pure"] < 1
    assert result["step"]["predicted_seconds"] == step["predicted_seconds"]
    # Each costly operation names the Python line that traced it (here the layers' GEMMs,
    # flax's Linear, lead: at this size each costs about its kernel's fixed cost).
    assert all(re.fullmatch(r"\S+\.py:\d+ \(.+\)", op["source"]) for op in step["top_ops"])
    # cuDNN's attention compiled without the GPU (forward and backward), and the roofline
    # counts its matmuls; every kernel is in one kind.
    assert step["kinds"]["attention"]["kernels"] == 2 and step["kinds"]["attention"]["flops"] > 0
    assert sum(k["kernels"] for k in step["kinds"].values()) == step["kernels"]
    assert sum(k["seconds"] for k in step["kinds"].values()) == pytest.approx(
        step["predicted_seconds"], rel=1e-9)
    # So does every kernel in one class of the calibration, the attention by its variant.
    assert sum(k["seconds"] for k in step["classes"].values()) == pytest.approx(
        step["predicted_seconds"], rel=1e-9)
    assert sum(k["kernels"] for k in step["classes"].values()) == step["kernels"]
    # The tiny config's documents reach cuDNN as a bias (its default document mask).
    assert {c for c in step["classes"] if c.startswith("attention")} == {
        "attention forward CAUSAL bias", "attention backward CAUSAL bias"}
    # The printout says the same.
    assert f"roofline on H100 SXM: {1e3 * step['predicted_seconds']:.2f} ms" in printed
    assert "training step: predicted" in printed

def test_the_step_is_accumulate_once_per_micro_batch_plus_cast_and_update():
    programs = [
        {"name": "cast (once per update)", "model_flops": None, "predicted_seconds": 0.125,
         "predicted_seconds_pure": 0.0625},
        {"name": "accumulate (one of 4 micro-batches), batch [8, 64]", "model_flops": 1e12,
         "predicted_seconds": 2.0, "predicted_seconds_pure": 1.0},
        {"name": "update", "model_flops": None, "predicted_seconds": 0.5,
         "predicted_seconds_pure": 0.25}]
    step = command.step_prediction(programs, CHIP)
    assert step["predicted_seconds"] == 0.125 + 4 * 2.0 + 0.5
    assert step["predicted_seconds_pure"] == 0.0625 + 4 * 1.0 + 0.25
    assert step["mfu_bound"] == pytest.approx(4e12 / 8.625 / 1e12, rel=1e-12)

WRAPPED = """HloModule m

%slice_and_kernel (p0: bf16[6,8,1024,2048], p1: s32[], p2: bf16[4096,1024], p3: s32[8]) -> \
bf16[4096,2048] {
  %p0 = bf16[6,8,1024,2048]{3,2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[4096,1024]{1,0} parameter(2)
  %p3 = s32[8]{0} parameter(3)
  %zero = s32[] constant(0)
  %layer = bf16[1,8,1024,2048]{3,2,1,0} dynamic-slice(%p0, %p1, %zero, %zero, %zero), \
dynamic_slice_sizes={1,8,1024,2048}
  %w = bf16[8,1024,2048]{2,1,0} bitcast(%layer)
  ROOT %kernel = bf16[4096,2048]{1,0} custom-call(%p3, %p2, %w), \
custom_call_target="mosaic_gpu_v2"
}

ENTRY %main (s: bf16[6,8,1024,2048], i: s32[], x: bf16[4096,1024], g: s32[8]) -> \
bf16[4096,2048] {
  %s = bf16[6,8,1024,2048]{3,2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %x = bf16[4096,1024]{1,0} parameter(2)
  %g = s32[8]{0} parameter(3)
  ROOT %fused = bf16[4096,2048]{1,0} fusion(%s, %i, %x, %g), kind=kCustom, \
calls=%slice_and_kernel
}
"""


def test_a_pallas_kernel_wrapped_in_a_fusion_counts_as_the_kernel_on_its_layer():
    """XLA wraps a kernel that reads one layer of a stacked weight in a fusion with the
    slice: the kernel's FLOPs, and the layer (not the stack) read."""
    (op,) = _ops(WRAPPED).values()
    layer = 2 * 8 * 1024 * 2048
    assert (op.kind, op.flops) == ("kernel", 2 * 4096 * 1024 * 2048)
    assert op.bytes == layer + 4 + 2 * 4096 * 1024 + 4 * 8 + 2 * 4096 * 2048


def test_model_flops_of_a_program_come_from_its_batch_and_are_per_device():
    from configs import wmt
    from sparsemixer_jax.aot import model_flops
    from sparsemixer_jax.tasks import run_config

    config = wmt.get_config("n4")
    sizes = {"emb": 512, "mlp": 2048, "layers": 6, "vocab": config.data.vocab_size,
             "length": 32, "tokens": 8 * 32}
    run = run_config(config)
    flops = command.COMPILERS["translation"]
    got = flops.program_model_flops(run, "accumulate (one of 2 micro-batches), batch "
                                    "[8, 32]", devices=4)
    assert got == model_flops.model_flops_per_step(sizes, 4, config.router.name) / 4
    assert flops.program_model_flops(run, "update", devices=4) is None
