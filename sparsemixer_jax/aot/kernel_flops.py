"""What a custom call costs in a compiled program: the FLOPs and bytes of the GEMM, attention
and Pallas kernels that XLA's own cost analysis counts as zero, read from their shapes and
attributes in the optimised HLO (:mod:`sparsemixer_jax.aot.roofline` adds them up).

* cuBLAS GEMMs: from their shapes and the dimension numbers of their backend config.
* cuDNN attention: the two batched matmuls of the forward (five in the backward) from the query
  and key shapes, halved for a causal mask (the kernel skips masked blocks; packed documents,
  causal within each, at most that).
* Splash attention (jax's Pallas TPU flash attention): its matmuls per phase from the query and
  key shapes, times the fraction of score blocks it computes, which our wrapper writes into
  the kernels' scope (:mod:`sparsemixer_jax.kernels.splash_attention`).
* Other Pallas kernels: their cost estimate where the kernel gives one (TPU), else from shapes
  when the three largest arrays are a (grouped) matmul's.
"""

from __future__ import annotations

import math
import re

from sparsemixer_jax.aot import hlo
from sparsemixer_jax.kernels.splash_attention import SCOPE

# Pallas: Mosaic GPU, Mosaic TPU and Triton kernels.
_KERNEL_TARGETS = re.compile(r"^(mosaic_gpu|tpu_custom_call|__gpu\$xla\.gpu\.triton)")
_INDICES = re.compile(r'"(\d+)"|(\d+)')


def dims(text: str | None) -> list[int]:
    """The integers of an HLO attribute's list (``{0,2}``, ``["1","2"]``)."""
    return [int(a or b) for a, b in _INDICES.findall(text or "")]


def custom_call_cost(instruction: hlo.Instruction, types: dict[str, str]
                     ) -> tuple[str, float, float]:
    """``(kind, flops, bytes)`` of a custom call."""
    target = instruction.attribute(r'custom_call_target="([^"]*)"') or ""
    operands = [a for o in instruction.operands for a in hlo.arrays(types.get(o, ""))]
    outputs = instruction.outputs
    if target.startswith(("__cublas", "__cudnn")):
        outputs = [a for a in outputs if a.dtype not in ("s8", "u8")]  # the workspace
    moved = float(sum(a.bytes for a in operands) + sum(a.bytes for a in outputs))
    if target.startswith("__cublas") and outputs and operands:
        contracting = dims(instruction.attribute(r'"lhs_contracting_dimensions":\[([^\]]*)\]'))
        contracted = math.prod(operands[0].dims[d] for d in contracting)
        return "gemm", 2.0 * outputs[0].size * contracted, moved
    if target.startswith("__cudnn$fmha") and len(operands) >= 2:
        return "attention", _attention_flops(instruction, operands, target), moved
    if _KERNEL_TARGETS.match(target):
        splash = _splash_flops(instruction, operands)
        if splash is not None:
            return "kernel", splash, moved
        estimate = instruction.attribute(r'"cost_estimate":\s*\{[^}]*"flops":\s*(\d+)')
        if estimate is not None:
            accessed = instruction.attribute(r'"bytes_accessed":\s*(\d+)')
            return "kernel", float(estimate), float(accessed) if accessed else moved
        return "kernel", matmul_flops_from_shapes(operands, outputs), moved
    return "custom-call", 0.0, moved


# Splash attention's kernels (jax's Pallas TPU flash attention, named by jax after the phase) and
# the scope our wrapper runs them in with the blocks they compute (its SCOPE, read back).
_SPLASH_PHASE = re.compile(r"splash_m[hq]a_(fwd|dq|dkv)")
_SPLASH_BLOCKS = re.compile(SCOPE.format(computed=r"(\d+)", total=r"(\d+)"))
# Matmuls per computed block and query head, each 2 b_q b_kv D FLOPs: the forward q k^T and p v;
# dq recomputes q k^T, then dp = do v^T and dq = ds k; dkv recomputes q k^T and dp, then
# dv = p^T do and dk = ds^T q.
_SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def _splash_flops(instruction: hlo.Instruction, operands: list[hlo.Array]) -> float | None:
    """FLOPs of a splash attention kernel, from its queries ``[(B,) H, T, D]`` and keys
    ``[(B,) KV, S, D]`` (its first two floating operands of rank 3 or more) and the fraction of
    score blocks it computes (from the scope, 1 without it); None for any other kernel."""
    op_name = instruction.attribute(r'op_name="([^"]*)"') or ""
    phase = _SPLASH_PHASE.search(op_name)
    arrays = [a for a in operands if a.dtype in hlo.FLOAT_TYPES and len(a.dims) >= 3]
    if phase is None or len(arrays) < 2:
        return None
    q, k = arrays[:2]
    blocks = _SPLASH_BLOCKS.search(op_name)
    computed = int(blocks.group(1)) / int(blocks.group(2)) if blocks else 1.0
    return 2.0 * _SPLASH_MATMULS[phase.group(1)] * q.size * k.dims[-2] * computed


def attention_variant(instruction: hlo.Instruction) -> str:
    """What kind of cuDNN attention call ``instruction`` is, as the roofline's calibration
    tells them apart: ``"<forward|backward> <mask type>"`` (XLA's ``mask_type``: ``NO_MASK``,
    ``CAUSAL``, ``PADDING_CAUSAL``, ...) and `` bias`` where the call reads a bias operand
    (an explicit mask: ``__cudnn$fmhaScaleBiasSoftmax...``)."""
    target = instruction.attribute(r'custom_call_target="([^"]*)"') or ""
    mask = instruction.attribute(r'"mask_type":\s*"(\w+)"') or "NO_MASK"
    direction = "backward" if "Backward" in target else "forward"
    return f"{direction} {mask}" + (" bias" if "Bias" in target else "")


def _attention_flops(instruction: hlo.Instruction, operands: list[hlo.Array],
                     target: str) -> float:
    q, k = operands[0], operands[1]
    batch = dims(instruction.attribute(
        r'"bmm1_dot_dimension_numbers":\{[^}]*"lhs_batch_dimensions":\[([^\]]*)\]'))
    contract = dims(instruction.attribute(
        r'"bmm1_dot_dimension_numbers":\{[^}]*"lhs_contracting_dimensions":\[([^\]]*)\]'))
    if not contract:  # no dimension numbers: [B, T, H, D], as jax's cuDNN attention lays out
        batch, contract = [0, 2], [3]
    rhs_batch = dims(instruction.attribute(
        r'"bmm1_dot_dimension_numbers":\{[^}]*"rhs_batch_dimensions":\[([^\]]*)\]')) or batch
    rhs_contract = dims(instruction.attribute(
        r'"bmm1_dot_dimension_numbers":\{[^}]*"rhs_contracting_dimensions":\[([^\]]*)\]')) \
        or contract
    rows = math.prod(d for i, d in enumerate(q.dims) if i not in batch and i not in contract)
    keys = math.prod(d for i, d in enumerate(k.dims)
                     if i not in rhs_batch and i not in rhs_contract)
    bmm = 2.0 * math.prod(q.dims[i] for i in batch) * rows * keys \
        * math.prod(q.dims[i] for i in contract)
    flops = bmm * (5 if "Backward" in target else 2)
    # CAUSAL, and PADDING_CAUSAL (packed documents: causal within each, so at most half).
    # (XLA writes the backend config with a space after each colon.)
    causal = "CAUSAL" in (instruction.attribute(r'"mask_type":\s*"(\w+)"') or "")
    return flops / 2 if causal else flops


def matmul_flops_from_shapes(operands: list[hlo.Array], outputs: list[hlo.Array]) -> float:
    """FLOPs of a kernel whose two largest floating operands and largest floating output are a
    matmul's (``[M, K] [K, N] -> [M, N]``, in any role and order) or a grouped matmul's (one of
    the three ``[G, ., .]``): ``2 M K N``, with ``(M K N)^2`` the product of the three sizes
    over ``G``. 0 when the shapes are not a matmul's."""
    floats = [a for a in operands if a.dtype in hlo.FLOAT_TYPES and len(a.dims) in (2, 3)]
    results = [a for a in outputs if a.dtype in hlo.FLOAT_TYPES and len(a.dims) in (2, 3)]
    if len(floats) < 2 or not results:
        return 0.0
    a, b = sorted(floats, key=lambda x: x.size)[-2:]
    c = max(results, key=lambda x: x.size)
    grouped = [x for x in (a, b, c) if len(x.dims) == 3]
    if len(grouped) == 1:
        groups = grouped[0].dims[0]
    elif len(grouped) == 3 and len({x.dims[0] for x in grouped}) == 1:
        groups = grouped[0].dims[0]  # batched: B (M K N)^2 B^2 / B
    elif not grouped:
        groups = 1
    else:
        return 0.0
    square = a.size * b.size * c.size // groups
    root = math.isqrt(square)
    return 2.0 * root if root * root == square else 0.0
