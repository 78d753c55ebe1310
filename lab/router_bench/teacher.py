"""The teacher: a fixed hard-routed MoE (one layer or a residual stack) that labels inputs.

Every layer has ``K`` experts, fixed random ReLU MLPs ``d -> h -> d`` that differ (independent
weights and biases), and a fixed linear router; an input goes to the argmax of the router's
logits (gate 1, no sampling), so the teacher is the student's family with a perfectly confident
router. A stack is residual: ``h_l = h_{l-1} + f_{D_l}(h_{l-1})`` and the label is
``h_L - x`` (for one layer, ``f_D(x)``).

Scales are fixed at construction, on a sample of inputs: each layer's logits have unit standard
deviation (so the margin below is in units of it), each expert's output unit RMS.

The margin: inputs are drawn ``x ~ N(0, I_d)`` and kept only where, at every layer, the gap
between the largest and the second-largest teacher logit is at least ``margin``. Margin 0 packs
data right up to the routing boundaries (the router must place them exactly); a positive margin
leaves empty bands between the regions, so an approximate router costs nothing there.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class TeacherConfig(NamedTuple):
    """Teacher and data sizes. ``noise`` is the std of the Gaussian label noise added to every
    training label (the noise floor of the training MSE is ``noise ** 2``). ``activation``:
    ``"relu"``, experts ``relu(x w1 + b1) w2 + b2`` scaled to unit output RMS, or ``"tanh"``,
    experts ``tanh(x w1)`` with ``w1 [d, d] ~ N(0, 1 / d)`` (``hidden`` is then ``d``; ``w2``
    is the identity and the biases zero, so the expert is exactly ``tanh(x W)``)."""

    dim: int = 16
    num_experts: int = 8
    hidden: int = 8
    depth: int = 1
    margin: float = 0.5
    noise: float = 0.1
    train_size: int = 16384
    eval_size: int = 2048
    gate_scale: float = 0.0
    activation: str = "relu"


class Teacher(NamedTuple):
    """Teacher weights, stacked over layers ``L`` and experts ``K``.

    ``router_w [L, d, K]``, ``router_b [L, K]``, ``w1 [L, K, d, h]``, ``b1 [L, K, h]``,
    ``w2 [L, K, h, d]``, ``b2 [L, K, d]``.
    """

    router_w: jax.Array
    router_b: jax.Array
    w1: jax.Array
    b1: jax.Array
    w2: jax.Array
    b2: jax.Array


class Data(NamedTuple):
    """One teacher's data. ``train_x [P, d]``, ``train_y [P, d]`` (clean labels; noise is added
    per step), ``eval_x [E, d]``, ``eval_y [E, d]``, ``eval_experts`` int32 ``[L, E]`` (the
    teacher's expert per layer), ``acceptance``: share of drawn inputs the margin kept."""

    train_x: np.ndarray
    train_y: np.ndarray
    eval_x: np.ndarray
    eval_y: np.ndarray
    eval_experts: np.ndarray
    acceptance: float


def _experts_all(teacher: Teacher, layer: int, h: jax.Array, activation: str = "relu"
                 ) -> jax.Array:
    """Every expert of ``layer`` on ``h [B, d]``: ``[K, B, d]``."""
    act = jnp.tanh if activation == "tanh" else jax.nn.relu
    hidden = act(jnp.einsum("bd,kdh->kbh", h, teacher.w1[layer])
                         + teacher.b1[layer][:, None])
    return jnp.einsum("kbh,khd->kbd", hidden, teacher.w2[layer]) + teacher.b2[layer][:, None]


def _top_two_gap(logits: jax.Array) -> jax.Array:
    top2 = jax.lax.top_k(logits, 2)[0] if logits.shape[-1] > 1 else None
    if top2 is None:  # one expert: no boundary anywhere
        return jnp.full(logits.shape[:-1], jnp.inf, logits.dtype)
    return top2[..., 0] - top2[..., 1]


def teacher_forward(teacher: Teacher, x: jax.Array, gate_scale: float = 0.0,
                    activation: str = "relu") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Label ``x [B, d]``: ``(y [B, d], experts int32 [L, B], gaps [L, B])``.

    ``gaps`` is the top-1 minus top-2 logit per layer (inf with one expert). ``gate_scale``:
    0 for gate 1, else the gate is ``softmax(gate_scale * logits)`` at the chosen expert.
    ``activation``: the experts' (:class:`TeacherConfig`).
    """
    h = x
    experts, gaps = [], []
    for layer in range(teacher.router_w.shape[0]):
        logits = h @ teacher.router_w[layer] + teacher.router_b[layer]
        chosen = jnp.argmax(logits, axis=-1)
        outputs = _experts_all(teacher, layer, h, activation)
        gate = 1.0
        if gate_scale > 0:
            gate = jnp.max(jax.nn.softmax(gate_scale * logits, axis=-1), axis=-1)[:, None]
        h = h + gate * jnp.take_along_axis(outputs, chosen[None, :, None], axis=0)[0]
        experts.append(chosen.astype(jnp.int32))
        gaps.append(_top_two_gap(logits))
    return h - x, jnp.stack(experts), jnp.stack(gaps)


def make_teacher(key: jax.Array, cfg: TeacherConfig) -> Teacher:
    """Random teacher, scaled on 4096 ``N(0, I)`` inputs (module docstring)."""
    if cfg.activation not in ("relu", "tanh"):
        raise ValueError(f"teacher activation must be 'relu' or 'tanh', got {cfg.activation!r}")
    d, k, hid, depth = cfg.dim, cfg.num_experts, cfg.hidden, cfg.depth
    if cfg.activation == "tanh":
        hid = d
    keys = jax.random.split(key, 7)
    shape = (depth, k)
    teacher = Teacher(
        router_w=jax.random.normal(keys[0], (depth, d, k)),
        router_b=jnp.zeros((depth, k)),
        w1=jax.random.normal(keys[1], (*shape, d, hid)) / np.sqrt(d),
        b1=0.5 * jax.random.normal(keys[2], (*shape, hid)),
        w2=jax.random.normal(keys[3], (*shape, hid, d)) / np.sqrt(hid),
        b2=0.5 * jax.random.normal(keys[4], (*shape, d)),
    )
    if cfg.activation == "tanh":
        eye = jnp.broadcast_to(jnp.eye(d), (*shape, d, d))
        zeros = jnp.zeros((*shape, d))
        teacher = teacher._replace(b1=zeros, w2=eye, b2=zeros)
    h = jax.random.normal(keys[5], (4096, d))
    router_w, w2, b2 = [], [], []
    for layer in range(depth):
        logits = h @ teacher.router_w[layer]
        rw = teacher.router_w[layer] / jnp.std(logits)
        outputs = _experts_all(teacher, layer, h, cfg.activation)  # [K, B, d]
        rms = jnp.sqrt(jnp.mean(outputs**2, axis=(1, 2)))  # [K]
        if cfg.activation == "tanh":  # exactly tanh(x W): no output scale
            rms = jnp.ones_like(rms)
        w2.append(teacher.w2[layer] / rms[:, None, None])
        b2.append(teacher.b2[layer] / rms[:, None])
        router_w.append(rw)
        chosen = jnp.argmax(h @ rw, axis=-1)
        h = h + jnp.take_along_axis(outputs / rms[:, None, None], chosen[None, :, None],
                                    axis=0)[0]
    return teacher._replace(router_w=jnp.stack(router_w), w2=jnp.stack(w2), b2=jnp.stack(b2))


_forward_jit = jax.jit(teacher_forward, static_argnums=(2, 3))


def make_data(teacher: Teacher, key: jax.Array, cfg: TeacherConfig,
              chunk: int = 65536, max_chunks: int = 400) -> Data:
    """Draw inputs, keep those with every layer's gap ``>= cfg.margin``, label them.

    Raises ValueError when fewer than ``train_size + eval_size`` survive ``max_chunks`` chunks.
    """
    need = cfg.train_size + cfg.eval_size
    xs, ys, es, drawn, kept = [], [], [], 0, 0
    for i in range(max_chunks):
        x = jax.random.normal(jax.random.fold_in(key, i), (chunk, cfg.dim))
        y, experts, gaps = _forward_jit(teacher, x, cfg.gate_scale, cfg.activation)
        keep = np.asarray(jnp.all(gaps >= cfg.margin, axis=0))
        drawn += chunk
        kept += int(keep.sum())
        xs.append(np.asarray(x)[keep])
        ys.append(np.asarray(y)[keep])
        es.append(np.asarray(experts)[:, keep])
        if kept >= need:
            break
    else:
        raise ValueError(f"margin {cfg.margin} at depth {cfg.depth} kept {kept} of {drawn} "
                         f"inputs; need {need}")
    x, y, e = np.concatenate(xs)[:need], np.concatenate(ys)[:need], np.concatenate(es, 1)[:, :need]
    p = cfg.train_size
    return Data(train_x=x[:p], train_y=y[:p], eval_x=x[p:], eval_y=y[p:],
                eval_experts=e[:, p:].astype(np.int32), acceptance=kept / drawn)
