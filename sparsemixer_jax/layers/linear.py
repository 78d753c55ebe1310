"""The projections of the language models (:class:`~sparsemixer_jax.models.causal_lm.CausalLM`
and its latent attention): float32 parameters drawn as the Hugging Face types draw them, matmuls
in the compute dtype."""

from __future__ import annotations

from typing import Protocol

import jax.numpy as jnp
from flax import nnx

from sparsemixer_jax.moe.shared import MakeLinear


class ComputeSettings(Protocol):
    """The execution section's dtype
    (:class:`~sparsemixer_jax.models.lm_config.LMExecution`)."""

    @property
    def compute_dtype(self) -> str: ...


class InitSettings(Protocol):
    """The architecture section's initialisation
    (:class:`~sparsemixer_jax.models.lm_config.LMArchitecture`)."""

    @property
    def initializer_range(self) -> float: ...


class LinearSettings(Protocol):
    """What :func:`linear` reads of a model's config
    (:class:`~sparsemixer_jax.models.lm_config.LMConfig` has both sections)."""

    @property
    def execution(self) -> ComputeSettings: ...

    @property
    def arch(self) -> InitSettings: ...


def projection(din: int, dout: int, bias: bool, compute_dtype: str, initializer_range: float,
               rngs: nnx.Rngs) -> nnx.Linear:
    """A projection ``[din] -> [dout]`` computing in ``compute_dtype`` with float32 params."""
    # Initialised as the Hugging Face types are: normal(initializer_range), zero bias.
    return nnx.Linear(din, dout, use_bias=bias, dtype=jnp.dtype(compute_dtype),
                      param_dtype=jnp.float32,
                      kernel_init=nnx.initializers.normal(initializer_range), rngs=rngs)


def linear(din: int, dout: int, bias: bool, config: LinearSettings, rngs: nnx.Rngs) -> nnx.Linear:
    """A :func:`projection` ``[din] -> [dout]`` with a language model's dtype and init."""
    return projection(din, dout, bias, config.execution.compute_dtype,
                      config.arch.initializer_range, rngs)


def linear_maker(config: LinearSettings, rngs: nnx.Rngs) -> MakeLinear:
    """:func:`linear` of ``config`` as a :class:`~sparsemixer_jax.moe.shared.MakeLinear`."""
    def make(in_features: int, out_features: int, *, use_bias: bool) -> nnx.Linear:
        return linear(in_features, out_features, use_bias, config, rngs)

    return make
