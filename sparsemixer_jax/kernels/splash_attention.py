"""Causal attention on jax's splash attention, the Pallas TPU flash attention.

:func:`splash_heads` is ``model.attention_impl="splash"``'s attention for a causal full pass of a
language model (training and evaluation): the scores stay in the TPU's on-chip memory block by
block, where the einsum attention writes and reads ``float32 [B, H, T, T]`` scores and
probabilities in HBM for every layer, in both passes. Blocks of the score matrix that the causal
mask hides entirely are skipped; packed documents and padding are segment ids, applied inside
the kernel's blocks.

The kernel (``jax.experimental.pallas.ops.tpu.splash_attention``) is jax's own; this module
lays the heads out for it, picks its block sizes, and runs it on each device's rows inside
:func:`jax.shard_map` (a Pallas call is one device's program, which XLA's partitioner cannot
split: without ``shard_map`` it would gather every row onto every device). On a CPU host it runs
in Pallas' interpreter, which is how the tests check it against the einsum attention; on the
TPU, and compiled for a TPU slice without the hardware (``experiments.compile``), it is the
Mosaic kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sparsemixer_jax.kernels.mosaic_grouped_matmul import target_device

#: Block sizes tried, largest first: MaxText's splash defaults are 512 for every block
#: (``sa_block_q``, ``sa_block_kv``, ... in its ``base.yml``); a shorter sequence takes the
#: largest that divides it. 128 is the kernel's smallest (a TPU vector register's lanes).
BLOCKS = (512, 256, 128)

#: The named scope every splash call runs in, with the blocks of the score matrix the kernels
#: compute and the blocks in all: the roofline (:mod:`sparsemixer_jax.aot.roofline`) reads it
#: from the compiled program's metadata to count the kernels' FLOPs, which XLA cannot see.
SCOPE = "splash_attention_blocks_{computed}_of_{total}"

# The process-wide matmul precisions Mosaic's kernels accept on 16-bit operands.
_SIXTEEN_BIT_PRECISIONS = (None, "default", "bfloat16", "fastest")

# Padding gets a segment of its own, which no real token's id can equal (segment ids count up
# from 0 or 1), so no real query sees a padded key.
_PADDING_SEGMENT = -(2**31)


def splash_block(q_len: int, kv_len: int) -> int | None:
    """The block size of a ``q_len x kv_len`` causal pass (:data:`BLOCKS`), or None when no
    block divides both lengths (the caller then takes another attention)."""
    return next((b for b in BLOCKS if q_len % b == 0 and kv_len % b == 0), None)


def causal_blocks(q_len: int, kv_len: int, block: int) -> tuple[int, int]:
    """``(computed, total)`` blocks of a ``q_len x kv_len`` score matrix under the causal mask
    (query ``i`` sees keys ``<= i``): a block is computed when any of its entries is visible."""
    rows, cols = q_len // block, kv_len // block
    computed = sum(min(i + 1, cols) for i in range(rows))  # block (i, j) is visible iff j <= i
    return computed, rows * cols


def _interpret(device) -> bool:
    platform = getattr(device, "platform", None)
    if platform == "tpu":
        return False
    if platform == "cpu":
        return True  # Pallas' interpreter: the tests' check, slow beyond small shapes
    raise ValueError(f"model.attention_impl='splash' is a TPU kernel; this program is built for "
                     f"{platform!r} (on NVIDIA GPUs choose 'cudnn')")


def splash_heads(q: jax.Array, k: jax.Array, v: jax.Array, *,
                 segment_ids: jax.Array | None = None, token_mask: jax.Array | None = None,
                 mesh: Mesh | None = None) -> jax.Array:
    """Causal attention of ``q [B, T, H, D]`` over ``k, v [B, T, KV, D]`` (query head ``h``
    reads key/value head ``h // (H / KV)``), scale ``D^-0.5``, softmax in float32: the heads
    ``[B, T, H, D]`` in ``q``'s dtype.

    ``segment_ids`` (int ``[B, T]``): a query sees only the keys of its own segment (packed
    documents). ``token_mask`` (bool ``[B, T]``): padding, which no real query sees; a padded
    query sees the padding before it, so its output (never used) differs from the einsum
    attention's there. ``mesh``: the rows are split over every mesh axis (the models'
    activations, :func:`sparsemixer_jax.parallel.sharding.rows_sharding`) and each device attends
    over
    its own rows. ``T`` must be a multiple of 128 (:func:`splash_block`).
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as mask_lib,
    )

    b, t, h, d = q.shape
    s = k.shape[1]
    block = splash_block(t, s)
    if block is None:
        raise ValueError(f"splash attention over {t} queries and {s} keys: both must be "
                         f"multiples of {BLOCKS[-1]}")
    interpret = _interpret(target_device(mesh=mesh, array=q))
    precision = jax.config.jax_default_matmul_precision
    if q.dtype.itemsize == 2 and precision not in _SIXTEEN_BIT_PRECISIONS:
        # The kernels' matmuls take the process-wide precision, and Mosaic refuses float32
        # contract precision on 16-bit operands (whose products are exact at the default).
        raise ValueError(f"splash attention on {q.dtype} operands runs at the default matmul "
                         f"precision; jax_default_matmul_precision={precision!r} asks float32 "
                         f"of its kernels: unset it, or use compute_dtype float32")
    if token_mask is not None:
        ids = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids
        segment_ids = jnp.where(token_mask, ids.astype(jnp.int32), _PADDING_SEGMENT)
    # The kernel takes [heads, length, head_dim] per row and leaves the scale to the caller.
    q = jnp.swapaxes(q * jnp.asarray(d**-0.5, q.dtype), 1, 2)
    k, v = jnp.swapaxes(k.astype(q.dtype), 1, 2), jnp.swapaxes(v.astype(q.dtype), 1, 2)

    computed, total = causal_blocks(t, s, block)

    def attend(q, k, v, segment_ids):
        # Built inside the traced function: the kernel holds the mask's block tables as arrays.
        mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((t, s))] * h)
        sizes = kernel_lib.BlockSizes(
            block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
            block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
        kernel = kernel_lib.make_splash_mha(mask, block_sizes=sizes, head_shards=1,
                                            q_seq_shards=1, interpret=interpret)
        # The scope is inside the differentiated function, so that the forward kernel of a
        # gradient, which jax traces apart, carries it too.
        with jax.named_scope(SCOPE.format(computed=computed, total=total)):
            if segment_ids is None:
                return jax.vmap(kernel)(q, k, v)
            segments = kernel_lib.SegmentIds(q=segment_ids, kv=segment_ids)
            return jax.vmap(kernel)(q, k, v, segment_ids=segments)

    if mesh is None or mesh.size == 1 or b % mesh.size:
        out = attend(q, k, v, segment_ids)
    else:
        rows = P(mesh.axis_names)
        # check_vma=False: the kernel's outputs are declared without the mesh axes they vary
        # over, which shard_map's check would refuse.
        out = jax.shard_map(attend, mesh=mesh, in_specs=(rows, rows, rows, rows),
                            out_specs=rows, check_vma=False)(q, k, v, segment_ids)
    return jnp.swapaxes(out, 1, 2)
