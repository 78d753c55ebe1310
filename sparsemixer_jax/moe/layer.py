"""The routed feed-forward layer: ``y = omega * sum_t gate_t * f_{D_t}(x)`` over ``top_k`` experts.

The router (:mod:`sparsemixer_jax.routers`) runs in float32 on the full logits; the chosen rows go
through the expert FFN of :mod:`sparsemixer_jax.moe.dispatch` on one device, or through
:mod:`sparsemixer_jax.moe.expert_parallel` when the layer holds a mesh; their outputs are
combined by :func:`sparsemixer_jax.moe.combine.gated_sum`.

Randomness: the router key and the dropout key come from the module's own ``router`` and
``dropout`` RNG streams; dropout masks are drawn per row
(:func:`sparsemixer_jax.moe.dispatch.row_dropout`), so every dispatch and mesh gives the same
result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax import routers
from sparsemixer_jax.initializers import expert_init, router_init
from sparsemixer_jax.kernels.mosaic_grouped_matmul import check_grouped_supported
from sparsemixer_jax.moe.combine import gated_sum
from sparsemixer_jax.moe.config import NORMAL_INIT, MoEConfig
from sparsemixer_jax.moe.diagnostics import router_diagnostics
from sparsemixer_jax.moe.dispatch import (
    capacity_keep,
    expert_capacity,
    expert_ffn,
    resolve_dispatch,
)
from sparsemixer_jax.moe.expert_parallel import buffer_overflow, expert_parallel_ffn
from sparsemixer_jax.moe.shared import SharedExperts
from sparsemixer_jax.moe.unchosen import all_expert_outputs, update_expert_defaults
from sparsemixer_jax.parallel import sharding


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


def _checked_sections(dims: tuple[int, int], moe: MoEConfig, router: routers.RouterConfig
                      ) -> tuple[int, int]:
    """``dims`` as ``(emb_dim, mlp_dim)`` once the sections and what joins them are checked:
    the layer's settings first, then the router's ``top_k`` and groups against the experts."""
    if not isinstance(moe, MoEConfig) or not isinstance(router, routers.RouterConfig):
        raise TypeError("MoEFeedForward takes a MoEConfig and a RouterConfig, got "
                        f"{type(moe).__name__} and {type(router).__name__}")
    if len(dims) != 2 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1
                             for d in dims):
        raise ValueError(f"dims must be (emb_dim, mlp_dim), two ints >= 1, got {dims!r}")
    if moe.num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {moe.num_experts}")
    moe.check()
    router.check("", moe.num_experts)
    return dims[0], dims[1]


class MoEFeedForward(nnx.Module):
    """MoE feed-forward block: ``y = omega * sum_t gate_t * f_{D_t}(x)`` over ``top_k`` experts.

    ``MoEFeedForward((emb_dim, mlp_dim), moe, router, rngs=...)``: the layer of the config
    sections ``moe`` (:class:`~sparsemixer_jax.moe.MoEConfig`: experts, dispatch, capacity,
    activation, initialisation, shared experts, gated experts and their biases, ...) and
    ``router`` (:class:`~sparsemixer_jax.routers.RouterConfig`: the router, its ``top_k``,
    jitter and options), each checked here with what joins them. The layer draws its own
    params and state; nothing is set on it from outside.

    Args:
      dims: ``(emb_dim, mlp_dim)``, the model and expert hidden widths.
      moe: the layer's section; ``moe.num_experts >= 1``. Under ``moe.init="normal"`` (the
        language model's types) the router's kernel and the experts' weights are
        ``normal(moe.init_std)`` and every bias zero, drawn after the ``"flax"`` scheme's draws
        so that models built before draw the same params.
      router: the router's section.
      dtype: compute dtype of the experts (params stay float32; the router runs in float32).
      mesh: optional mesh with axes ``("data", "fsdp", "expert")`` for expert parallelism
        (:mod:`sparsemixer_jax.moe.expert_parallel`); ``num_experts`` must divide by its
        expert axis. ``moe.grouped_impl="mosaic"`` is checked against its device (or the
        default one).
      rngs: params init plus the ``router`` and ``dropout`` streams (``router`` falls back to
        ``default`` then ``dropout``).

    Capacity (``moe.capacity_factor > 0``) caps every expert at
    ``ceil(capacity_factor * rows / N)`` rows (rows = ``B * T * top_k``). Rows are served first
    choices first (all tokens' first expert, in token order, then all second experts, ...), as
    in GShard; a dropped row outputs zeros, the token's other experts still count.

    Params: ``router`` (``Linear(emb -> N)``), ``wi [N, emb, mlp]``, ``bi [N, mlp]``,
    ``wo [N, mlp, emb]``, ``bo [N, emb]`` (gated: ``w_gate [N, emb, mlp]``,
    ``w_up [N, emb, mlp]``, ``w_down [N, mlp, emb]`` instead, and with ``expert_biases``
    ``b_gate``, ``b_up [N, mlp]``, ``b_down [N, emb]``), and ``omega [emb]`` (SparseMixer
    routers only).
    State (``nnx.BatchStat``, updated by every training call, not by the optimizer):
    ``expert_defaults [N, emb]`` (``default_moe`` routers only, zeros at init);
    ``expert_load [N]`` (bias balancing and the global-batch balance loss: the routed rows per
    expert since the last update) and ``expert_bias [N]`` (bias balancing, or the
    ``selection_bias`` of a checkpoint: the selection bias, moved after each update by
    :func:`sparsemixer_jax.moe.balancing.end_of_update` where ``bias_update_rate > 0``).
    Shared experts (``moe.num_shared_experts``): ``shared_experts``
    (:class:`sparsemixer_jax.moe.shared.SharedExperts`), added to the routed output.

    Routers with an entry in :data:`sparsemixer_jax.routers.UNCHOSEN_EXPERT_RULES` also give
    the router a gradient for the experts a token did not choose: DenseMixer from every
    expert's output (a dense pass over all ``N`` experts in training), Default MoE from the
    default vectors.
    """

    def __init__(self, dims: tuple[int, int], moe: MoEConfig, router: routers.RouterConfig, *,
                 dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None, rngs: nnx.Rngs):
        emb_dim, mlp_dim = _checked_sections(dims, moe, router)
        if moe.dispatch == "grouped" and moe.grouped_impl == "mosaic":
            check_grouped_supported(mesh=mesh)  # one line naming the target if it is no Hopper
        if mesh is not None:
            sharding.check_mesh(mesh, moe.num_experts)

        # Hashable sections: static metadata of the layer's graph, so that every layer built
        # alike shares nnx.jit's compilation cache.
        self.moe, self.router_config = moe, router
        self.unchosen = router.unchosen
        self.emb_dim, self.mlp_dim, self.num_experts = emb_dim, mlp_dim, moe.num_experts
        self.dtype = dtype
        self.mesh = mesh
        # "normal" first draws as "flax" does, then redraws (see the class docstring).
        scheme = "flax" if moe.init == NORMAL_INIT else moe.init
        # Keys are drawn in this order: router, experts, the RNG streams, shared experts.
        self.router = router_init(scheme, emb_dim, router.init_scale).linear(
            emb_dim, moe.num_experts, dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs,
            use_bias=moe.router_bias)
        self._init_experts(rngs, scheme)
        self._init_state()
        # Static: :func:`report_choices` turns it on in a copy of the model for diagnostics.
        self.report_choices = False
        self.router_rng = _stream(rngs, "router", "dropout").fork()
        self.dropout_rng = _stream(rngs, "dropout", "router").fork() \
            if moe.activation_dropout > 0 else None
        self.jitter_rng = _stream(rngs, "router", "dropout").fork() \
            if moe.input_jitter > 0 else None
        if moe.init == NORMAL_INIT:
            normal = nnx.initializers.normal(moe.init_std)
            for param in (self.router.kernel, *self.expert_params()[:3]):
                param[...] = normal(rngs.params(), param.shape, jnp.float32)
        # Drawn last, so that a layer without them draws every other param as before.
        self.shared_experts = SharedExperts.from_scheme(
            emb_dim, moe.num_shared_experts * mlp_dim, gated=moe.gated,
            activation=moe.activation, use_gate=moe.shared_expert_gate, init=moe.init,
            std=moe.init_std, dtype=dtype, rngs=rngs) if moe.num_shared_experts else None

    @property
    def gated(self) -> bool:
        return self.moe.gated

    @property
    def gated_biases(self) -> bool:
        return self.moe.gated and self.moe.expert_biases

    def _init_experts(self, rngs: nnx.Rngs, scheme: str) -> None:
        """The expert weights ``[N, ...]`` drawn by ``scheme``, split over the mesh's
        ``"expert"`` axis if any."""
        n, emb_dim, mlp_dim, mesh = self.num_experts, self.emb_dim, self.mlp_dim, self.mesh

        def sharded(value, spec):
            if mesh is None:
                return nnx.Param(value)
            return nnx.Param(value, out_sharding=spec, mesh=mesh)

        fc1, fc2 = expert_init(scheme, emb_dim), expert_init(scheme, mlp_dim)
        if self.gated:
            # Drawn in the order w_gate, w_up, w_down.
            self.w_gate, self.w_up = (
                sharded(fc1.kernel(rngs.params(), (n, emb_dim, mlp_dim), jnp.float32),
                        ("expert", None, None)) for _ in range(2))
            self.w_down = sharded(fc2.kernel(rngs.params(), (n, mlp_dim, emb_dim), jnp.float32),
                                  ("expert", None, None))
            if self.gated_biases:  # zeros: no key drawn
                self.b_gate, self.b_up = (sharded(jnp.zeros((n, mlp_dim), jnp.float32),
                                                  ("expert", None)) for _ in range(2))
                self.b_down = sharded(jnp.zeros((n, emb_dim), jnp.float32), ("expert", None))
        else:
            # Drawn in the order wi, bi, wo, bo; a zero bias draws no key.
            self.wi = sharded(fc1.kernel(rngs.params(), (n, emb_dim, mlp_dim), jnp.float32),
                              ("expert", None, None))
            self.bi = sharded(fc1.draw_bias(rngs, (n, mlp_dim)), ("expert", None))
            self.wo = sharded(fc2.kernel(rngs.params(), (n, mlp_dim, emb_dim), jnp.float32),
                              ("expert", None, None))
            self.bo = sharded(fc2.draw_bias(rngs, (n, emb_dim)), ("expert", None))

    def _init_state(self) -> None:
        """``omega`` and the router's state (none of it draws a key): the default vectors, the
        bias balancing's selection bias, and the per-expert loads of the update so far (read
        by the bias step after the update and by the global-batch balance loss)."""
        n, router_config = self.num_experts, self.router_config
        self.omega = nnx.Param(jnp.ones((self.emb_dim,), jnp.float32)) if routers.uses_omega(
            router_config.name) else None
        keeps_defaults = self.unchosen is not None and self.unchosen.values == "defaults"
        self.expert_defaults = nnx.BatchStat(
            jnp.zeros((n, self.emb_dim), jnp.float32)) if keeps_defaults else None
        # The selection bias: bias balancing's, or a checkpoint's own (moved only by a
        # bias_update_rate > 0).
        self.expert_bias = nnx.BatchStat(jnp.zeros((n,), jnp.float32)) \
            if router_config.bias_update_rate > 0 or self.moe.selection_bias else None
        self.expert_load = nnx.BatchStat(jnp.zeros((n,), jnp.float32)) \
            if router_config.counts_load else None

    def __call__(
        self,
        x: jax.Array,
        token_mask: jax.Array | None = None,
        *,
        deterministic: bool = False,
        dropless: bool = False,
        routes: jax.Array | None = None,
        record_routes: bool = False,
    ) -> tuple[jax.Array, dict]:
        """x: ``[B, T, emb]``; token_mask: bool ``[B, T]`` (False = padding) or None;
        ``dropless`` ignores ``capacity_factor`` for this call (decoding uses it). In
        training the input is first jittered by ``moe.input_jitter`` where it is set.
        ``routes`` int ``[B, T, top_k]`` replays given experts (a row of ``-1``: the router's
        own choice) with the live router's gates (:meth:`_replayed`); ``record_routes`` adds
        the selection made to the metrics, int32 ``routes`` ``[B, T, top_k]``, -1 on padding.

        Returns ``y [B, T, emb]`` (dtype of ``x``) and a dict of float32 metrics:
        ``balance_loss``, ``z_loss``, ``num_unmasked``, ``entropy``, ``dropped_fraction`` (of
        rows) (scalars), ``expert_fraction`` ``[N]`` (share of rows) and the diagnostics of
        :func:`sparsemixer_jax.moe.diagnostics.router_diagnostics`; at evaluation, with
        :func:`report_choices`, ``choices [B, T, k]``. Padding outputs zeros and is left out of
        every metric.
        """
        if x.ndim != 3 or x.shape[-1] != self.emb_dim:
            raise ValueError(f"x must be [B, T, {self.emb_dim}], got shape {x.shape}")
        batch = x.shape[0]
        n = self.num_experts
        if self.mesh is not None:
            sharding.check_batch(self.mesh, batch)

        training = not deterministic
        if training and self.jitter_rng is not None:
            e = self.moe.input_jitter
            x = x * jax.random.uniform(self.jitter_rng(), x.shape, x.dtype, 1.0 - e, 1.0 + e)
        # Router in float32, on the full logits, before any sharding: decisions and random
        # draws are the same on every mesh.
        logits = self.router(x.astype(jnp.float32))
        key = self.router_rng() if training else None
        bias = None if self.expert_bias is None else self.expert_bias[...]
        routed = routers.router_fn(self.router_config)(logits, key, training, bias)
        routed = self._replayed(routed, routes, x.shape[:2])
        metrics = routers.routing_metrics(logits, routed, token_mask)
        metrics["balance_loss"] = self._balance_loss(routed, token_mask, training)
        metrics.update(router_diagnostics(
            logits, routed, token_mask, jitter_eps=self.router_config.jitter_eps,
            selection_bias=bias, score=self.router_config.score))

        # One row per token and chosen expert: [B, T, k], row id token * k + t.
        k = self.router_config.top_k
        expert = routed.expert if k > 1 else routed.expert[..., None]
        gate = routed.gate if k > 1 else routed.gate[..., None]
        if self.report_choices and deterministic:  # each token's chosen set, as a set: sorted
            metrics["choices"] = jnp.sort(expert, axis=-1)
        active, capacity, metrics["dropped_fraction"] = self._served_rows(expert, token_mask,
                                                                          dropless)
        group = jnp.where(active, expert, n).astype(jnp.int32)
        drop_key = None
        if training and self.dropout_rng is not None:
            drop_key = self.dropout_rng()
        params = tuple(p[...].astype(self.dtype) for p in self.expert_params())
        xc = x.astype(self.dtype)
        xr, gate = self._expert_rows(xc, logits, expert, gate)
        f = self._expert_outputs(xr, group, params, drop_key, capacity, dropless)
        if k == 1:  # drop the k axis: the same ops (and float rounding) as the top-1 layer
            f, gate = f[:, :, 0], gate[..., 0]

        y = gated_sum(f, gate, None if self.omega is None else self.omega[...])
        if self.unchosen is not None:
            y = y + self._unchosen_contribution(xc, routed, params, token_mask, f, gate, group,
                                                training)
        if self.shared_experts is not None:
            shared = self.shared_experts(xc)
            if token_mask is not None:
                shared = shared * token_mask[..., None].astype(shared.dtype)
            y = y + shared
        metrics = {name: v.astype(jnp.float32) for name, v in metrics.items()}
        if record_routes:  # int32 ids, not a float metric
            metrics["routes"] = _recorded_routes(expert, token_mask)
        return y.astype(x.dtype), metrics

    def _expert_rows(self, x: jax.Array, logits: jax.Array, expert: jax.Array,
                     gate: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The rows the experts take, ``[B, T * k, emb]`` (row ``t * k + s``: token ``t`` of
        ``x [B, T, emb]``; ``x`` itself for top-1), and the gates of their outputs: ``gate``,
        or under ``input_gates`` (Llama 4) the rows scaled by the sigmoids of their experts'
        logits (``logits [B, T, N]``, ``expert [B, T, k]``) and gates of 1."""
        k = expert.shape[-1]
        rows = jnp.repeat(x, k, axis=1) if k > 1 else x
        if not self.moe.input_gates:
            return rows, gate
        scale = jax.nn.sigmoid(jnp.take_along_axis(logits, expert, axis=-1))
        return (rows * scale.reshape(*rows.shape[:2], 1)).astype(self.dtype), jnp.ones_like(gate)

    def _replayed(self, routed: routers.RouterOutput, routes: jax.Array | None,
                  tokens: tuple[int, int]) -> routers.RouterOutput:
        """``routed`` through the given experts ``routes [B, T, top_k]`` (checked here: its
        shape, dtype and, where concrete, its ids) by
        :func:`sparsemixer_jax.routers.replayed_route`; ``routed`` itself when None."""
        if routes is None:
            return routed
        config = self.router_config
        routers.check_replay_router(config)
        if routes.shape != (*tokens, config.top_k):
            raise ValueError(f"routes must be [B, T, top_k] = {[*tokens, config.top_k]} for this "
                             f"MoE layer, got shape {list(routes.shape)}")
        routers.check_given_experts(routes, self.num_experts)
        return routers.replayed_route(config, routed, routes)

    def _served_rows(self, expert: jax.Array, token_mask: jax.Array | None, dropless: bool
                     ) -> tuple[jax.Array, int | None, jax.Array]:
        """``(active, capacity, dropped_fraction)`` of the rows ``expert [B, T, k]``: whether
        an expert serves each row (padding, rows over capacity and, on an expert mesh with
        ``expert_buffer_factor > 0``, rows past their exchange slots are not served), the
        capacity per expert (None when dropless) and the share of real rows dropped."""
        batch, length, k = expert.shape
        n, moe = self.num_experts, self.moe
        active = jnp.ones((batch, length), bool) if token_mask is None else token_mask.astype(bool)
        active = jnp.broadcast_to(active[..., None], (batch, length, k))
        capped = moe.capacity_factor > 0 and not dropless
        buffered = self.mesh is not None and moe.expert_buffer_factor > 0 and not dropless
        if not (capped or buffered):
            return active, None, jnp.zeros((), jnp.float32)
        capacity, kept = None, active
        if capped:
            capacity = expert_capacity(moe.capacity_factor, batch * length * k, n)
            # Slot-major order: every token's first choice is served before any second choice.
            kept = jnp.moveaxis(capacity_keep(jnp.moveaxis(expert, -1, 0),
                                              jnp.moveaxis(active, -1, 0), n, capacity), 0, -1)
        if buffered:
            group = jnp.where(kept, expert, n).astype(jnp.int32).reshape(batch, length * k)
            kept = kept & ~buffer_overflow(group, mesh=self.mesh, num_experts=n,
                                           buffer_factor=moe.expert_buffer_factor
                                           ).reshape(batch, length, k)
        num_active = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
        return kept, capacity, jnp.sum(active & ~kept).astype(jnp.float32) / num_active

    def _expert_outputs(self, xr: jax.Array, group: jax.Array, params: tuple,
                        drop_key: jax.Array | None, capacity: int | None,
                        dropless: bool) -> jax.Array:
        """``f [B, T, k, emb]``: each row's expert output for rows ``xr [B, T * k, emb]`` sent
        to experts ``group [B, T, k]`` (``N`` = not served), on one device or over the mesh
        (with exchange buffers of ``expert_buffer_factor`` unless ``dropless``)."""
        batch, length, k = group.shape
        moe = self.moe
        row_ids = jnp.arange(batch * length * k, dtype=jnp.int32).reshape(batch, length, k)
        dispatch = resolve_dispatch(moe.dispatch)
        if self.mesh is None:
            f = expert_ffn(xr.reshape(batch * length * k, -1), group.reshape(-1),
                           row_ids.reshape(-1), params, dispatch=dispatch,
                           dropout_key=drop_key, dropout_rate=moe.activation_dropout,
                           capacity=capacity if dispatch == "padded" else None,
                           grouped_impl=moe.grouped_impl,
                           activation=moe.activation)
        else:
            f = expert_parallel_ffn(xr, group.reshape(batch, length * k),
                                    row_ids.reshape(batch, length * k), params, mesh=self.mesh,
                                    dispatch=dispatch, dropout_key=drop_key,
                                    dropout_rate=moe.activation_dropout,
                                    grouped_impl=moe.grouped_impl,
                                    activation=moe.activation,
                                    buffer_factor=0.0 if dropless
                                    else moe.expert_buffer_factor)
        return f.reshape(batch, length, k, -1)

    def _balance_loss(self, routed, token_mask, training: bool) -> jax.Array:
        """The balance loss over the router's ``balance_scope``; in training, also adds this
        call's per-expert loads to the update's (``expert_load``)."""
        config, n = self.router_config, self.num_experts
        load = None
        if self.expert_load is not None:
            load = routers.expert_load(routed.expert, n, token_mask)
            if training:
                load = self.expert_load[...] + load
                self.expert_load[...] = load
        if config.balance_scope == "sequence":
            return routers.sequence_balancing_loss(routed.probs, routed.expert, token_mask)
        if config.balance_scope == "global_batch":
            return routers.global_balancing_loss(routed.probs, load, token_mask)
        return routers.load_balancing_loss(routed.probs, routed.expert, token_mask)

    def expert_params(self) -> tuple[nnx.Param, ...]:
        """The experts' params in the order :func:`sparsemixer_jax.moe.expert_ffn` takes them:
        ``(wi, bi, wo, bo)``, or ``(w_gate, w_up, w_down)`` when ``gated`` (and then
        ``b_gate, b_up, b_down`` with ``gated_biases``)."""
        return tuple(getattr(self, name) for name in self.expert_param_names())

    def expert_param_names(self) -> tuple[str, ...]:
        """The attribute names of :meth:`expert_params`, in its order."""
        if self.gated_biases:
            return ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
        if self.gated:
            return ("w_gate", "w_up", "w_down")
        return ("wi", "bi", "wo", "bo")

    def _unchosen_contribution(self, xc, routed, params, token_mask, f, gate, group,
                               training: bool) -> jax.Array:
        """``[B, T, emb]`` float32 added to the output for the experts a token did not choose
        (zero where the router has no such term at this call), and, for Default MoE in training,
        the EMA step of the default vectors (before or after the term reads them)."""
        opts = self.router_config
        in_eval = self.unchosen.in_forward and opts.default_at_eval
        if not (training or in_eval):
            return jnp.zeros(xc.shape, jnp.float32)
        update = training and self.expert_defaults is not None
        if update:
            rows = f.astype(jnp.float32)
            if opts.default_mean == "gated":
                rows = rows * gate[..., None]
            updated = update_expert_defaults(
                self.expert_defaults[...], rows.reshape(-1, self.emb_dim), group.reshape(-1),
                opts.default_decay)
            if opts.default_update == "before":
                self.expert_defaults[...] = updated
        term = self._unchosen_term(xc, routed, params, token_mask)
        if update and opts.default_update == "after":
            self.expert_defaults[...] = updated
        return term

    def _unchosen_term(self, xc, routed, params, token_mask) -> jax.Array:
        """``[B, T, emb]`` float32: :func:`sparsemixer_jax.routers.unchosen_expert_term` with
        every expert's output (DenseMixer) or the default vectors (Default MoE); zero on
        padding."""
        batch, length, _ = xc.shape
        if self.unchosen.values == "outputs":
            values = all_expert_outputs(xc.reshape(batch * length, -1), params,
                                        self.moe.activation)
            values = values.reshape(batch, length, self.num_experts, -1)
        else:
            values = self.expert_defaults[...]
        # Under sigmoid scores the dense weights are the scores over the chosen ones' sum, as
        # the gates are, times the gates' scale.
        config = self.router_config
        weights = routed.probs if routed.scores is None else routed.scores
        term = routers.unchosen_expert_term(weights, routed.expert, values, self.unchosen,
                                            normalize_top_k=config.renormalises)
        if config.score == "sigmoid":
            term = term * config.routed_scaling_factor
        if token_mask is not None:
            term = term * token_mask[..., None].astype(term.dtype)
        return term


def _recorded_routes(expert: jax.Array, token_mask: jax.Array | None) -> jax.Array:
    """int32 ``[B, T, k]``: the chosen experts ``expert [B, T, k]``, -1 on padding."""
    if token_mask is not None:
        expert = jnp.where(token_mask[..., None].astype(bool), expert, -1)
    return expert.astype(jnp.int32)


def routing_param_paths(model: nnx.Module) -> tuple[tuple[tuple[str, ...], ...],
                                                     tuple[tuple[str, ...], ...]]:
    """``(routers, experts)``: the paths (keys as strings) of every :class:`MoEFeedForward`'s
    router in ``model`` and of its routed experts' params (:meth:`MoEFeedForward.expert_params`:
    weights and biases, gpt-oss's ``b_gate``, ``b_up``, ``b_down`` too, and ``omega``, which
    scales their output); the labels :class:`sparsemixer_jax.training.optim.ParamRoles` gives
    the optimizer. Shared experts are left out (always on: a dense feed-forward in effect)."""
    routers, experts = [], []
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, MoEFeedForward):
            continue
        path = tuple(str(key) for key in path)
        routers.append((*path, "router"))
        experts.extend((*path, name) for name in (*module.expert_param_names(), "omega")
                       if getattr(module, name) is not None)
    return tuple(routers), tuple(experts)


def report_choices(model: nnx.Module) -> int:
    """Makes every :class:`MoEFeedForward` of ``model`` add, at evaluation (deterministic
    calls), each token's chosen experts to its metrics: ``choices [B, T, k]`` (sorted, float32;
    exact integers), in place. A flag of the graph, not of the state: apply it to a copy
    (:meth:`sparsemixer_jax.training.steps.Steps.routing`). Returns the most experts of a
    layer (0: no MoE layer)."""
    experts = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, MoEFeedForward):
            module.report_choices = True
            experts = max(experts, module.num_experts)
    return experts


def fold_omega(model: nnx.Module) -> int:
    """Folds SparseMixer's ``omega`` into the experts' output projections of every
    :class:`MoEFeedForward` in ``model``, in place.

    The layer's output is ``omega * gate * (h @ wo + bo)`` for the chosen expert, so scaling every
    expert's ``wo [N, mlp, emb]`` and ``bo [N, emb]`` (gated experts: ``w_down``, and
    ``b_down`` where they have biases) by
    ``omega [emb]`` and then setting ``omega`` to ones leaves the function unchanged and saves one
    multiply at inference.

    Returns the number of layers folded (0 for a dense model or routers without ``omega``).
    """
    folded = 0
    for _, module in nnx.iter_modules(model):
        if not isinstance(module, MoEFeedForward) or module.omega is None:
            continue
        scale = module.omega[...]
        outputs = (module.wo, module.bo) if not module.gated else \
            (module.w_down, module.b_down) if module.gated_biases else (module.w_down,)
        for param in outputs:
            param[...] = param[...] * scale.astype(param[...].dtype)
        module.omega[...] = jnp.ones_like(scale)
        folded += 1
    return folded
