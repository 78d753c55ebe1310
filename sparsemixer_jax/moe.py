"""Mixture-of-experts feed-forward layer (SparseMixer / Switch, top-1 or top-k), dropless.

The layer routes every token to ``k`` experts (see :mod:`sparsemixer_jax.routing`; ``k = 1`` by
default), runs the expert MLPs on the rows they received (one row per token and chosen expert)
and returns ``omega * sum_t gate_t * f_{D_t}(x)``.

Dispatch (how tokens reach their expert) is chosen by name:

* ``"ragged"``: tokens sorted by expert, grouped matmul with :func:`jax.lax.ragged_dot`.
* ``"padded"``: tokens sorted by expert into a block-padded layout: each expert's group is padded
  to a multiple of a block of ``b`` rows, every block belongs to one expert, and one batched
  matmul multiplies each block by its expert's weights. Dropless with at most ``rows + N * b``
  rows (``b`` about ``rows / N``), so the work is at most about twice a dense FFN whatever ``N``.
  In capacity mode it is the Switch layout ``[N, capacity, emb]`` (one block per expert).
* ``"auto"``: per backend, from the measured table :data:`AUTO_DISPATCH` (``"padded"`` on CPU
  and GPU, ``"ragged"`` on GPU only with grouped kernels on, ``"ragged"`` on TPU).

Why ``auto`` picks ``padded`` on CPU: there XLA lowers ``ragged_dot`` to a masked dense dot over
all ``N`` groups, so it costs about ``N`` dense FFNs; the block-padded layout stays near one to
two. Measured with ``python -m experiments.bench_dispatch`` (forward + backward of
the expert FFN, float32, tokens=4096, emb=512, mlp=2048, random balanced routing, median of 3;
2 cores of an "AMD EPYC" (lscpu model name), jax 0.10.2, about 5 minutes). Other jobs shared the
2 cores (load average 4 to 5), so absolute times are inflated and noisy, the dense baseline
included; the ratio ragged / padded is the finding (an earlier run: 1.4x, 2.4x, 2.8x, 21x):

====  ==========  ==========
N     ragged ms   padded ms
====  ==========  ==========
2         2660        1512
4         2996        1180
8         5941        1583
16       18603        2967
====  ==========  ==========

(dense FFN, one expert over all tokens: 1632 ms in the same run.)

On GPU ``ragged_dot`` is as slow by default (:data:`AUTO_DISPATCH`), unless its grouped
Pallas/Triton lowering is on (:mod:`sparsemixer_jax.grouped_matmul`).

Randomness: the router key and the dropout key come from the module's own ``router`` and
``dropout`` RNG streams. Dropout masks are drawn per row from ``fold_in(key, row_id)`` with
``row_id = token_index * k + t`` for the token's ``t``-th expert (the token index when k = 1),
so they do not depend on where a token is computed (dispatch layout, device): the expert-parallel
layer (:mod:`sparsemixer_jax.sharding`) gives the same result as one device.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax import router_diagnostics, routing

DISPATCHES = ("auto", "ragged", "padded")


# What ``dispatch="auto"`` runs on each backend, from measurements (forward + backward of one
# MoE layer against the dense FFN of the same width, N = 2, 4, 8, 16):
# * cpu: "padded". ``python -m experiments.bench_dispatch`` on 2 cores of an AMD EPYC, jax 0.10.2,
#   float32, 4096 tokens, emb 512, mlp 2048: ragged / padded = 1.8x, 2.5x, 3.8x, 6.3x (module
#   docstring).
# * gpu: "padded". ``python -m experiments.benchmark --backend cuda --sections moe_vs_dense`` on
#   one H100 80GB, jax 0.11.2, CUDA 13, bf16, 32,768 tokens, emb 512, mlp 2048 (issue 8): ragged
#   147-203 ms, padded 4.3-4.9 ms, dense 1.7 ms. XLA:GPU lowers ragged_dot to a dense dot over
#   all groups; with the grouped Pallas/Triton lowering on ("ragged" below) it is unmeasured.
# * tpu: "ragged" (lowers to TPU's native ragged dot). NOT measured: no TPU was available.
AUTO_DISPATCH = {"cpu": "padded", "gpu": "padded", "tpu": "ragged"}
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def resolve_dispatch(dispatch: str, backend: str | None = None) -> str:
    """The concrete dispatch (``"ragged"`` or ``"padded"``) for ``dispatch`` on ``backend``.

    ``backend`` is a JAX platform name (default: ``jax.default_backend()``); ``"cuda"`` and
    ``"rocm"`` count as ``"gpu"``, unknown platforms get ``"padded"`` (dropless, at most about
    twice a dense FFN whatever the lowering). On a GPU ``auto`` picks ``"ragged"`` only while
    ``ragged_dot``'s grouped Pallas/Triton lowering is on
    (:func:`sparsemixer_jax.grouped_matmul.enable_triton_ragged_dot`).
    """
    if dispatch not in DISPATCHES:
        raise ValueError(f"unknown dispatch {dispatch!r}; expected one of {DISPATCHES}")
    if dispatch != "auto":
        return dispatch
    backend = backend or jax.default_backend()
    if backend in _GPU_PLATFORMS:
        from sparsemixer_jax.grouped_matmul import triton_ragged_dot_enabled

        return "ragged" if triton_ragged_dot_enabled() else AUTO_DISPATCH["gpu"]
    return AUTO_DISPATCH.get(backend, "padded")


def expert_capacity(capacity_factor: float, num_tokens: int, num_experts: int) -> int:
    """Switch capacity ``ceil(capacity_factor * num_tokens / num_experts)`` (at least 1)."""
    return max(1, math.ceil(capacity_factor * num_tokens / num_experts))


def _rank_in_group(group: jax.Array, num_groups: int) -> jax.Array:
    """For int ``group`` ``[R]``, the number of earlier rows in the same group: int32 ``[R]``.

    Rows with ``group >= num_groups`` (the "no group" sentinel) get an unspecified rank.
    """
    one_hot = jax.nn.one_hot(group, num_groups, dtype=jnp.int32)
    return jnp.sum((jnp.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=-1)


def _dropout(
    h: jax.Array, token_ids: jax.Array, key: jax.Array | None, rate: float
) -> jax.Array:
    """Inverted dropout on ``h`` ``[..., mlp]`` with one mask per token id ``[...]``.

    The mask of a row depends only on ``key`` and its token id, not on the row's position, so
    every dispatch layout and mesh drops the same units.
    """
    if key is None or rate <= 0.0:
        return h
    flat_ids = token_ids.reshape(-1)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, flat_ids)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, (h.shape[-1],)))(keys)
    keep = keep.reshape(h.shape)
    return jnp.where(keep, h / (1.0 - rate), 0.0).astype(h.dtype)


def _ragged_ffn(x, group, token_ids, wi, bi, wo, bo, drop_key, rate):
    """Sorted grouped matmul with ``ragged_dot``. See :func:`expert_ffn` for shapes."""
    num_groups = wi.shape[0]
    order = jnp.argsort(group, stable=True)  # sentinel rows (group == G) sort last
    sorted_group = group[order]
    group_sizes = jnp.bincount(group, length=num_groups + 1)[:num_groups].astype(jnp.int32)
    safe = jnp.minimum(sorted_group, num_groups - 1)
    h = jax.lax.ragged_dot(x[order], wi, group_sizes) + bi[safe]
    h = _dropout(jax.nn.relu(h), token_ids[order], drop_key, rate)
    y = jax.lax.ragged_dot(h, wo, group_sizes) + bo[safe]
    y = jnp.where((sorted_group < num_groups)[:, None], y, 0)
    # Undo the sort with a scatter (its transpose is a gather, cheaper than a second argsort).
    return jnp.zeros_like(y).at[order].set(y, unique_indices=True)


def _block_rows(rows: int, num_groups: int) -> int:
    """Block size of the padded layout: a power of two near ``rows / num_groups``, in [8, 512].

    Padding costs at most ``num_groups * (block - 1)`` rows; smaller blocks mean more blocks and
    so more gathered weight copies. ``rows / num_groups`` bounds both by about twice the dense
    cost.
    """
    target = max(1, rows // max(num_groups, 1))
    return int(min(512, max(8, 1 << (target.bit_length() - 1))))


def _padded_ffn(x, group, token_ids, wi, bi, wo, bo, drop_key, rate, capacity):
    """Block-padded batched matmul. See :func:`expert_ffn` for shapes.

    With ``capacity``: one block of ``capacity`` rows per group, the Switch
    ``[G, capacity, emb]`` layout, no weight gather; rows past the capacity output zeros.
    """
    rows, emb = x.shape
    num_groups = wi.shape[0]
    valid = group < num_groups
    rank = _rank_in_group(group, num_groups)
    if capacity is not None:
        valid = valid & (rank < capacity)  # over-capacity rows would spill into the next block
        block, num_blocks = capacity, num_groups
        slot = jnp.where(valid, group * capacity + rank, num_blocks * block)
        block_group = jnp.arange(num_groups)
    else:
        block = _block_rows(rows, num_groups)
        num_blocks = -(-rows // block) + num_groups  # sum_g ceil(n_g / b) <= ceil(R / b) + G
        counts = jnp.bincount(group, length=num_groups + 1)[:num_groups]
        padded = (counts + block - 1) // block * block
        start = jnp.cumsum(padded) - padded  # first slot of each group
        first = start[jnp.minimum(group, num_groups - 1)]
        slot = jnp.where(valid, first + rank, num_blocks * block)
        # Block k belongs to the group whose padded range holds slot k * b; blocks past the last
        # group hold no rows and reuse the last group's weights (their output is discarded).
        block_group = jnp.searchsorted(jnp.cumsum(padded), jnp.arange(num_blocks) * block,
                                       side="right")
        block_group = jnp.minimum(block_group, num_groups - 1)
    size = num_blocks * block
    # Rows without expert all point one past the end and are dropped, so slots are not unique.
    xb = jnp.zeros((size, emb), x.dtype).at[slot].set(x, mode="drop")
    ids = jnp.zeros((size,), token_ids.dtype).at[slot].set(token_ids, mode="drop")
    xb = xb.reshape(num_blocks, block, emb)
    if capacity is not None:
        wi_b, bi_b, wo_b, bo_b = wi, bi, wo, bo
    else:
        wi_b, bi_b, wo_b, bo_b = wi[block_group], bi[block_group], wo[block_group], bo[block_group]
    h = jnp.einsum("kbe,kem->kbm", xb, wi_b) + bi_b[:, None, :]
    h = _dropout(jax.nn.relu(h), ids.reshape(num_blocks, block), drop_key, rate)
    yb = jnp.einsum("kbm,kme->kbe", h, wo_b) + bo_b[:, None, :]
    y = yb.reshape(size, emb).at[slot].get(mode="fill", fill_value=0)
    return jnp.where(valid[:, None], y, 0)


def expert_ffn(
    x: jax.Array,
    group: jax.Array,
    token_ids: jax.Array,
    params: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    *,
    dispatch: str,
    dropout_key: jax.Array | None = None,
    dropout_rate: float = 0.0,
    capacity: int | None = None,
) -> jax.Array:
    """Each row through its expert: ``Dense -> ReLU -> dropout -> Dense``.

    Args:
      x: ``[R, emb]`` rows in the compute dtype.
      group: int32 ``[R]``, the expert of each row in ``[0, G)``; ``G`` (or more) means "no
        expert": the row outputs zeros.
      token_ids: int32 ``[R]``, a global id per row that seeds its dropout mask.
      params: ``(wi [G, emb, mlp], bi [G, mlp], wo [G, mlp, emb], bo [G, emb])`` in the compute
        dtype.
      dispatch: ``"ragged"`` or ``"padded"``.
      dropout_key: key of the activation dropout, or None for no dropout.
      capacity: ``"padded"`` only: the Switch layout with this many slots per group; rows past
        it (in row order) output zeros. The layer drops tokens before (``capacity_keep``), so
        its groups always fit.

    Returns: ``[R, emb]`` in the dtype of ``x``, zeros on rows without expert.
    """
    wi, bi, wo, bo = params
    group = group.astype(jnp.int32)
    if dispatch == "ragged":
        return _ragged_ffn(x, group, token_ids, wi, bi, wo, bo, dropout_key, dropout_rate)
    if dispatch == "padded":
        return _padded_ffn(x, group, token_ids, wi, bi, wo, bo, dropout_key, dropout_rate,
                           capacity)
    raise ValueError(f"expert_ffn: dispatch must be 'ragged' or 'padded', got {dispatch!r}")


def capacity_keep(
    expert: jax.Array, active: jax.Array, num_experts: int, capacity: int
) -> jax.Array:
    """Switch-style dropping: bool ``[...]``, True for tokens among the first ``capacity``
    active tokens (in flattened token order) routed to their expert.

    ``expert`` int ``[...]``, ``active`` bool ``[...]`` (padding is False and takes no slot).
    """
    flat_expert = jnp.where(active, expert, num_experts).reshape(-1)
    rank = _rank_in_group(flat_expert, num_experts)
    return (active.reshape(-1) & (rank < capacity)).reshape(expert.shape)


def _stream(rngs: nnx.Rngs, name: str, fallback: str) -> nnx.RngStream:
    """``rngs[name]`` (Rngs itself falls back to ``default``), else ``rngs[fallback]``."""
    try:
        return rngs[name]
    except KeyError:
        try:
            return rngs[fallback]
        except KeyError:
            raise ValueError(
                f"MoEFeedForward needs an RNG stream {name!r} (or {fallback!r}, or a default "
                f"seed) in rngs; got streams {sorted(rngs)}"
            ) from None


class MoEFeedForward(nnx.Module):
    """MoE feed-forward block: ``y = omega * sum_t gate_t * f_{D_t}(x)`` over ``top_k`` experts.

    Args:
      emb_dim, mlp_dim: model and expert hidden widths.
      num_experts: ``N >= 1``.
      router: a name in :data:`sparsemixer_jax.routing.ROUTERS`.
      jitter_eps: the router's jitter / mask threshold.
      top_k: experts per token, ``1 <= top_k <= N`` (distinct; see ``routing.sparsemixer_route``).
      activation_dropout: dropout rate after the expert ReLU.
      dispatch: ``"auto"``, ``"ragged"`` or ``"padded"`` (module docstring).
      capacity_factor: 0 for dropless; ``> 0`` caps every expert at
        ``ceil(capacity_factor * rows / N)`` rows (rows = ``B * T * top_k``: every position of
        the call and each of its experts). Rows are served first choices first (all tokens'
        first expert, in token order, then all second experts, ...), as in GShard; a dropped row
        outputs zeros, the token's other experts still count.
      dtype: compute dtype of the experts (params stay float32; the router runs in float32).
      mesh: optional mesh with axes ``("data", "expert")`` for expert parallelism
        (:mod:`sparsemixer_jax.sharding`); ``num_experts`` must divide by its expert axis.
      rngs: params init plus the ``router`` and ``dropout`` streams (``router`` falls back to
        ``default`` then ``dropout``).

    Params: ``router`` (``Linear(emb -> N)``), ``wi [N, emb, mlp]``, ``bi [N, mlp]``,
    ``wo [N, mlp, emb]``, ``bo [N, emb]``, and ``omega [emb]`` (SparseMixer routers only).
    """

    def __init__(
        self,
        emb_dim: int,
        mlp_dim: int,
        num_experts: int,
        *,
        router: str = "sparsemixer",
        jitter_eps: float = 0.1,
        top_k: int = 1,
        activation_dropout: float = 0.1,
        dispatch: str = "auto",
        capacity_factor: float = 0.0,
        dtype=jnp.float32,
        mesh: jax.sharding.Mesh | None = None,
        rngs: nnx.Rngs,
    ):
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not 0.0 <= activation_dropout < 1.0:
            raise ValueError(f"activation_dropout must lie in [0, 1), got {activation_dropout}")
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor must be >= 0 (0 = dropless), got {capacity_factor}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}"
            )
        resolve_dispatch(dispatch)  # validates the name
        routing.get_router(router, jitter_eps, top_k)  # validates the name and jitter_eps
        if mesh is not None:
            from sparsemixer_jax.sharding import check_mesh

            check_mesh(mesh, num_experts)

        self.emb_dim, self.mlp_dim, self.num_experts = emb_dim, mlp_dim, num_experts
        # Names, not the router function: a per-instance lambda would make every layer's graph
        # definition distinct and defeat nnx.jit's compilation cache.
        self.router_name = router
        self.jitter_eps = jitter_eps
        self.top_k = top_k
        self.activation_dropout = activation_dropout
        self.dispatch = dispatch
        self.capacity_factor = capacity_factor
        self.dtype = dtype
        self.mesh = mesh

        self.router = nnx.Linear(emb_dim, num_experts, use_bias=True, dtype=jnp.float32,
                                 param_dtype=jnp.float32, rngs=rngs)

        def sharded(value, spec):
            # Expert-stacked params are split over the mesh's "expert" axis.
            if mesh is None:
                return nnx.Param(value)
            return nnx.Param(value, out_sharding=spec, mesh=mesh)

        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        n = num_experts
        self.wi = sharded(init(rngs.params(), (n, emb_dim, mlp_dim), jnp.float32),
                          ("expert", None, None))
        self.bi = sharded(jnp.zeros((n, mlp_dim), jnp.float32), ("expert", None))
        self.wo = sharded(init(rngs.params(), (n, mlp_dim, emb_dim), jnp.float32),
                          ("expert", None, None))
        self.bo = sharded(jnp.zeros((n, emb_dim), jnp.float32), ("expert", None))
        self.omega = nnx.Param(jnp.ones((emb_dim,), jnp.float32)) if routing.uses_omega(
            router) else None
        self.router_rng = _stream(rngs, "router", "dropout").fork()
        self.dropout_rng = _stream(rngs, "dropout", "router").fork() if activation_dropout > 0 \
            else None

    def __call__(
        self,
        x: jax.Array,
        token_mask: jax.Array | None = None,
        *,
        deterministic: bool = False,
        dropless: bool = False,
    ) -> tuple[jax.Array, dict]:
        """x: ``[B, T, emb]``; token_mask: bool ``[B, T]`` (False = padding) or None;
        ``dropless`` ignores ``capacity_factor`` for this call (decoding uses it).

        Returns ``y [B, T, emb]`` (dtype of ``x``) and a dict of float32 metrics:
        ``balance_loss``, ``z_loss``, ``num_unmasked``, ``entropy``, ``dropped_fraction`` (of
        rows) (scalars), ``expert_fraction`` ``[N]`` (share of rows) and the diagnostics of
        :func:`sparsemixer_jax.router_diagnostics.router_diagnostics`. Padding outputs zeros
        and is left out of every metric.
        """
        if x.ndim != 3 or x.shape[-1] != self.emb_dim:
            raise ValueError(f"x must be [B, T, {self.emb_dim}], got shape {x.shape}")
        batch, length, _ = x.shape
        n = self.num_experts
        if self.mesh is not None:
            from sparsemixer_jax.sharding import check_batch

            check_batch(self.mesh, batch)

        # Router in float32, on the full logits, before any sharding: decisions and random
        # draws are the same on every mesh.
        logits = self.router(x.astype(jnp.float32))
        training = not deterministic
        key = self.router_rng() if training else None
        routed = routing.get_router(self.router_name, self.jitter_eps, self.top_k)(
            logits, key, training)
        metrics = routing.routing_metrics(logits, routed, token_mask)
        metrics.update(router_diagnostics.router_diagnostics(
            logits, routed, token_mask, jitter_eps=self.jitter_eps))

        # One row per token and chosen expert: [B, T, k], row id token * k + t.
        k = self.top_k
        expert = routed.expert if k > 1 else routed.expert[..., None]
        gate = routed.gate if k > 1 else routed.gate[..., None]
        active = jnp.ones((batch, length), bool) if token_mask is None else token_mask.astype(bool)
        active = jnp.broadcast_to(active[..., None], (batch, length, k))
        capacity = None
        if self.capacity_factor > 0 and not dropless:
            capacity = expert_capacity(self.capacity_factor, batch * length * k, n)
            # Slot-major order: every token's first choice is served before any second choice.
            kept = jnp.moveaxis(capacity_keep(jnp.moveaxis(expert, -1, 0),
                                              jnp.moveaxis(active, -1, 0), n, capacity), 0, -1)
            num_active = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
            metrics["dropped_fraction"] = jnp.sum(active & ~kept).astype(jnp.float32) / num_active
            active = kept
        else:
            metrics["dropped_fraction"] = jnp.zeros((), jnp.float32)

        group = jnp.where(active, expert, n).astype(jnp.int32)
        row_ids = jnp.arange(batch * length * k, dtype=jnp.int32).reshape(batch, length, k)
        drop_key = None
        if training and self.dropout_rng is not None:
            drop_key = self.dropout_rng()
        params = tuple(p[...].astype(self.dtype) for p in (self.wi, self.bi, self.wo, self.bo))
        dispatch = resolve_dispatch(self.dispatch)
        xc = x.astype(self.dtype)
        xr = jnp.repeat(xc, k, axis=1) if k > 1 else xc  # [B, T * k, emb], row t*k+s = token t

        if self.mesh is None:
            f = expert_ffn(xr.reshape(batch * length * k, -1), group.reshape(-1),
                           row_ids.reshape(-1), params, dispatch=dispatch,
                           dropout_key=drop_key, dropout_rate=self.activation_dropout,
                           capacity=capacity if dispatch == "padded" else None)
        else:
            from sparsemixer_jax.sharding import expert_parallel_ffn

            f = expert_parallel_ffn(xr, group.reshape(batch, length * k),
                                    row_ids.reshape(batch, length * k), params, mesh=self.mesh,
                                    dispatch=dispatch, dropout_key=drop_key,
                                    dropout_rate=self.activation_dropout)
        f = f.reshape(batch, length, k, -1)
        if k == 1:  # drop the k axis: the same ops (and float rounding) as the top-1 layer
            f, gate = f[:, :, 0], gate[..., 0]

        scale = gate[..., None]
        if self.omega is not None:
            scale = scale * self.omega[...]
        y = f.astype(jnp.float32) * scale
        if k > 1:
            y = jnp.sum(y, axis=2)
        return y.astype(x.dtype), {name: v.astype(jnp.float32) for name, v in metrics.items()}
