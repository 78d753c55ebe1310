"""The models, one module per architecture (all Flax NNX):

- :mod:`.encoder_decoder`: the Switch Transformer encoder-decoder for translation
  (:class:`Transformer`; beam search is :mod:`sparsemixer_jax.models.decode`);
- :mod:`.encoder`: the bidirectional encoder for ELECTRA and GLUE (:class:`Encoder`);
- :mod:`.electra`: ELECTRA's generator and discriminator around two encoders (:class:`Electra`);
- :mod:`.causal_lm`: the decoder-only MoE language models (:class:`CausalLM`: Mixtral,
  Qwen2/3-MoE, OLMoE, Phi-3.5-MoE), configured by :mod:`.lm_config` (:class:`LMConfig`), with
  text generation in :mod:`.lm_generate`.

The names below are imported from their modules on first use, so importing one model does not
load the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparsemixer_jax.lazy_names import lazy_names

if TYPE_CHECKING:
    from sparsemixer_jax.layers.rope import RopeConfig
    from sparsemixer_jax.models.causal_lm import CausalLM
    from sparsemixer_jax.models.electra import Electra, GeneratorConfig
    from sparsemixer_jax.models.encoder import Encoder, EncoderConfig
    from sparsemixer_jax.models.encoder_decoder import (
        Encoded,
        Transformer,
        TransformerConfig,
    )
    from sparsemixer_jax.models.lm_config import LMConfig

# Each name, with the module that defines it.
_LAZY = {
    "Transformer": "sparsemixer_jax.models.encoder_decoder",
    "TransformerConfig": "sparsemixer_jax.models.encoder_decoder",
    "Encoded": "sparsemixer_jax.models.encoder_decoder",
    "Encoder": "sparsemixer_jax.models.encoder",
    "EncoderConfig": "sparsemixer_jax.models.encoder",
    "Electra": "sparsemixer_jax.models.electra",
    "GeneratorConfig": "sparsemixer_jax.models.electra",
    "CausalLM": "sparsemixer_jax.models.causal_lm",
    "LMConfig": "sparsemixer_jax.models.lm_config",
    "RopeConfig": "sparsemixer_jax.layers.rope",
}

__all__ = [
    "CausalLM",
    "Electra",
    "Encoded",
    "Encoder",
    "EncoderConfig",
    "GeneratorConfig",
    "LMConfig",
    "RopeConfig",
    "Transformer",
    "TransformerConfig",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
