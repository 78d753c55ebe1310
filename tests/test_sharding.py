"""Expert parallelism on 8 simulated CPU devices (tests/conftest.py sets the device count):
the sharded MoE layer equals the single-device layer in outputs, metrics and gradients for every
(data, expert) mesh shape, and trains identically."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparsemixer_jax.moe import MoEFeedForward
from sparsemixer_jax.parallel.sharding import batch_sharding, make_mesh, shard_state
from tests import kit

EMB, MLP, N, B, T = 16, 32, 8, 8, 6
MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
# The single-device reference always uses padded dispatch; one mesh runs ragged as a cross-check.
MESH_DISPATCH = {(2, 4): "ragged"}


def make_layer(mesh=None, **kw) -> MoEFeedForward:
    return kit.moe_layer(EMB, MLP, N, mesh, dispatch=kw.pop("dispatch", "padded"), **kw)


def loss_and_grads(layer, x, mask, head):
    """Training mode: SparseMixer sampling, its custom router VJP and activation dropout.

    Returns ``(loss, y, metrics, param grads, input grad)`` (tests/kit.py).
    """
    return kit.loss_and_grads(layer, x, mask, head, input_grad=True)


@pytest.fixture(scope="module")
def data():
    return kit.moe_inputs(7, (B, T, EMB), {2: 3, 5: 1})


@pytest.fixture(scope="module")
def single(data):
    return loss_and_grads(make_layer(), *data)


def test_eight_devices():
    assert jax.device_count() == 8, "tests/conftest.py should force 8 host devices"


@pytest.mark.parametrize("shape", MESHES, ids=[f"{d}x{e}" for d, e in MESHES])
def test_sharded_layer_equals_single_device(shape, data, single):
    mesh = make_mesh(*shape)
    layer = make_layer(mesh, dispatch=MESH_DISPATCH.get(shape, "padded"))
    # Expert weights really are split over the expert axis; the router is replicated.
    assert layer.wi[...].sharding.shard_shape(layer.wi[...].shape) == (N // shape[1], EMB, MLP)
    assert layer.router.kernel[...].sharding.is_fully_replicated
    x, mask, head = (jax.device_put(a, batch_sharding(mesh)) for a in data)
    loss, y, metrics, grads, dx = loss_and_grads(layer, x, mask, head)
    loss0, y0, metrics0, grads0, dx0 = single
    chex.assert_trees_all_close(y, y0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, loss0, rtol=1e-5)
    chex.assert_trees_all_close(metrics, metrics0, rtol=1e-5, atol=1e-7)
    # Router (custom VJP of the SparseMixer gate), omega and expert gradients, summed over the
    # data axis by shard_map's transpose.
    chex.assert_trees_all_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(grads0), rtol=1e-4,
                                atol=1e-6)
    assert float(jnp.abs(grads["router"]["kernel"][...]).sum()) > 0
    # The input gradient (through the router and the all_to_all exchange) feeds earlier layers.
    np.testing.assert_allclose(dx, dx0, rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(dx).sum()) > 0


@nnx.jit
def forward_eval(layer, x, mask):
    return layer(x, mask, deterministic=True)


@pytest.fixture(scope="module")
def single_top2(data):
    return loss_and_grads(make_layer(top_k=2, router="sparsemixer_v2"), *data)


def test_sharded_top2_layer_equals_single_device(data, single_top2):
    """Top-2 (GRIN's v2 router, two rows per token through the all_to_all exchange) on a 2x4
    mesh with ragged dispatch: outputs, metrics, parameter and input gradients equal one
    device (padded dispatch)."""
    shape = (2, 4)
    mesh = make_mesh(*shape)
    layer = make_layer(mesh, top_k=2, router="sparsemixer_v2",
                       dispatch=MESH_DISPATCH.get(shape, "padded"))
    x, mask, head = (jax.device_put(a, batch_sharding(mesh)) for a in data)
    loss, y, metrics, grads, dx = loss_and_grads(layer, x, mask, head)
    loss0, y0, metrics0, grads0, dx0 = single_top2
    chex.assert_trees_all_close(y, y0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loss, loss0, rtol=1e-5)
    chex.assert_trees_all_close(metrics, metrics0, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(grads0), rtol=1e-4,
                                atol=1e-6)
    np.testing.assert_allclose(dx, dx0, rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(grads["router"]["kernel"][...]).sum()) > 0


def test_uneven_chunks():
    """A data shard of 7 tokens does not split evenly over an expert axis of 4: the padded
    chunking still equals one device."""
    mesh = make_mesh(2, 4)
    x = jax.random.normal(jax.random.key(1), (2, 7, EMB))
    mask = jnp.ones((2, 7), bool).at[1, 4:].set(False)
    y, met = forward_eval(make_layer(mesh), x, mask)
    y0, met0 = forward_eval(make_layer(), x, mask)
    chex.assert_trees_all_close(y, y0, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(met, met0, rtol=1e-5, atol=1e-7)


class TinyModel(nnx.Module):
    """MoE layer plus a linear head: enough to train on random data."""

    def __init__(self, mesh, rngs: nnx.Rngs):
        self.moe = MoEFeedForward((EMB, MLP), *kit.moe_sections(N), mesh=mesh, rngs=rngs)
        self.head = nnx.Linear(EMB, 3, rngs=rngs)

    def __call__(self, x, mask):
        h, metrics = self.moe(x, mask)
        return self.head(x + h), metrics


@nnx.jit
def train_step(model, optimizer, x, mask, target):
    def loss_fn(model):
        pred, metrics = model(x, mask)
        err = jnp.where(mask[..., None], pred - target, 0.0)
        return jnp.sum(err**2) / jnp.sum(mask) + 0.01 * metrics["balance_loss"]

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def test_training_on_mesh_matches_single_device(data):
    x, mask, _ = data
    target = jax.random.normal(jax.random.key(11), (B, T, 3))
    losses = {}
    for name, mesh in (("single", None), ("mesh", make_mesh(2, 4))):
        model = TinyModel(mesh, nnx.Rngs(params=0, dropout=1, router=2))
        args = (x, mask, target)
        if mesh is not None:
            shard_state(model, mesh)
            args = tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args)
        optimizer = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
        if mesh is not None:
            shard_state(optimizer, mesh)
        losses[name] = [float(train_step(model, optimizer, *args)) for _ in range(3)]
    assert losses["single"][-1] < losses["single"][0]
    # Each loss sums B x T x 3 squared errors; SGD's update is linear in the gradient, so the
    # parameters carry the gradients' rounding, of the same order, into the next losses.
    np.testing.assert_allclose(losses["mesh"], losses["single"], rtol=kit.sum_rtol(B * T * 3))


def test_mesh_errors():
    with pytest.raises(ValueError, match=r"data=3 x expert=2 = 6 devices, but 8 devices"):
        make_mesh(3, 2)
    with pytest.raises(ValueError, match="8 devices do not divide into expert axis 3"):
        make_mesh(-1, 3)
    assert make_mesh(-1, 2).shape == {"data": 4, "fsdp": 1, "expert": 2}
    assert make_mesh(-1, 2, fsdp=2).shape == {"data": 2, "fsdp": 2, "expert": 2}
    with pytest.raises(ValueError, match=r"data=2 x fsdp=2 x expert=4 = 16 devices, but 8"):
        make_mesh(2, 4, fsdp=2)
    with pytest.raises(ValueError, match=r"8 devices do not divide into fsdp x expert = 6"):
        make_mesh(-1, 2, fsdp=3)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by .* axis \(4\)"):
        MoEFeedForward((EMB, MLP), *kit.moe_sections(6), mesh=make_mesh(2, 4),
                       rngs=nnx.Rngs(0))
    layer = make_layer(make_mesh(4, 2))
    with pytest.raises(ValueError, match=r"batch size 6 is not divisible by .* data axis \(4\)"):
        layer(jnp.zeros((6, T, EMB)))


def test_gelu_experts_on_a_mesh_equal_one_device(data):
    """``activation="gelu"`` reaches the expert-parallel path: a (2, 4) mesh gives the
    single-device GELU layer's output, which differs from the ReLU layer's."""
    x, mask, _ = data
    y, _ = forward_eval(make_layer(make_mesh(2, 4), activation="gelu"), x, mask)
    y0, _ = forward_eval(make_layer(activation="gelu"), x, mask)
    chex.assert_trees_all_close(y, y0, rtol=1e-5, atol=1e-6)
    y_relu, _ = forward_eval(make_layer(activation="relu"), x, mask)
    assert float(jnp.max(jnp.abs(y0 - y_relu))) > 1e-3


def test_the_mesh_is_jax_make_meshs_with_auto_axes():
    """``make_mesh`` lays devices out as ``jax.make_mesh`` does (on CPU: in the order given,
    an explicit list included), with the axes of ``partitioning.MESH_AXES``, all ``Auto``."""
    from jax.sharding import AxisType

    from sparsemixer_jax.parallel.partitioning import MESH_AXES

    devices = jax.devices()[::-1][:4]
    mesh = make_mesh(1, 2, devices, fsdp=2)
    assert mesh.axis_names == MESH_AXES
    assert mesh.axis_types == (AxisType.Auto,) * 3
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]
    assert mesh == jax.make_mesh((1, 2, 2), MESH_AXES, axis_types=mesh.axis_types,
                                 devices=devices)
