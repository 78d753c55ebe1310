"""The LM's token loss with its own backward pass (sparsemixer_jax.models.lm_loss) against
JAX's differentiation of ``-log_softmax(logits)[target]``: same values and gradients up to
float32 rounding, for float32 and bfloat16 logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax.models.lm_loss import token_nll


def _reference(logits, targets):
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_nll_matches_log_softmax_and_its_gradient(dtype):
    k = jax.random.split(jax.random.key(0), 3)
    logits = (4.0 * jax.random.normal(k[0], (3, 7, 50))).astype(dtype)
    targets = jax.random.randint(k[1], (3, 7), 0, 50)
    weights = jax.random.uniform(k[2], (3, 7))  # an upstream cotangent that is not all ones

    def total(fn, x):
        return jnp.sum(weights * fn(x, targets))

    value, grad = jax.value_and_grad(lambda x: total(token_nll, x))(logits)
    want, want_grad = jax.value_and_grad(lambda x: total(_reference, x))(logits)
    # Both compute in float32 from the same logits; log-normaliser and lookup are summed in a
    # different order (lse - x_t against -(x_t - max - log sum)): a few float32 ulps of the
    # loss (~10 here), and of the probabilities (<= 1) in the gradient.
    np.testing.assert_allclose(value, want, rtol=1e-6)
    assert grad.dtype == logits.dtype
    atol = 1e-6 if dtype == jnp.float32 else 2 ** -8  # bfloat16: the gradient's own rounding
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want_grad, np.float32),
                               atol=atol)
    assert float(jnp.abs(want_grad).max()) > 0.1
