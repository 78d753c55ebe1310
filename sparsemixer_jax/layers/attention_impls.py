"""The attention implementations a model may name (``attention_impl``) and the checks of that
choice, apart from :mod:`sparsemixer_jax.layers.attention` so that a model's config checks it
without loading Flax."""

from __future__ import annotations

# attention_impl -> jax.nn.dot_product_attention's ``implementation``. "einsum" is
# :class:`~sparsemixer_jax.layers.attention.Attention`'s own attention, the only one with dropout
# on the attention weights and sink logits: the paper's setting. "xla" and "auto" (jax picks; XLA
# in jax 0.10) take the boolean mask as it is. "cudnn" is cuDNN's fused flash attention (NVIDIA
# GPUs, bf16); how it takes the masks is
# :attr:`~sparsemixer_jax.layers.attention.AttentionOptions.masks_are_lengths`'s, or a
# :class:`~sparsemixer_jax.layers.attention.FusedMask`'s. "splash" is jax's Pallas TPU flash
# attention (:mod:`sparsemixer_jax.kernels.splash_attention`) for the causal full passes a
# ``FusedMask`` describes; every other pass takes the einsum attention.
ATTENTION_IMPLS = {"einsum": None, "xla": "xla", "cudnn": "cudnn", "auto": None, "splash": None}


def check_attention_impl(implementation: str, attention_dropout: float) -> None:
    """Raises ValueError if ``implementation`` is unknown or cannot apply ``attention_dropout``."""
    if implementation not in ATTENTION_IMPLS:
        raise ValueError(f"attention implementation {implementation!r}; expected one of "
                         f"{sorted(ATTENTION_IMPLS)}")
    if implementation != "einsum" and attention_dropout > 0:
        raise ValueError(
            f"attention implementation {implementation!r} has no dropout on the attention "
            f"weights, but attention_dropout={attention_dropout}: set it to 0 or use 'einsum'"
        )


def check_attention_dtype(implementation: str, compute_dtype: str, where: str = "") -> None:
    """Raises ValueError unless ``implementation`` runs in ``compute_dtype``: cuDNN's fused
    (flash) attention takes 16-bit inputs, so ``"cudnn"`` needs ``"bfloat16"``. ``where``
    prefixes both field names (``"config.model."``)."""
    if implementation == "cudnn" and compute_dtype != "bfloat16":
        raise ValueError(f"{where}attention_impl='cudnn' needs {where}compute_dtype='bfloat16' "
                         f"(cuDNN's fused attention takes 16-bit inputs), got {compute_dtype!r}")
