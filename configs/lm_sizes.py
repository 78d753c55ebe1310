"""The real models' shapes as language-modelling configs: ``configs/lm_quickstart.py``'s schema
with a model section of a published checkpoint's sizes, sequences of 4096 tokens, bfloat16
compute, and per target platform the mesh, the batch and its micro-batches, the MoE dispatch
and the rematerialisation (:func:`real_size_config`). Used by ``configs/mixtral_8x7b.py``,
``configs/phi35_moe.py``, ``configs/qwen3_30b_a3b.py``, ``configs/olmoe_1b_7b.py``,
``configs/gpt_oss_20b.py``, ``configs/gpt_oss_120b.py``, ``configs/moonlight_16b_a3b.py`` and
``configs/glm45_air.py``.

The variant after ``:`` in ``--config configs/<model>.py:<variant>`` picks the layout (``tpu``,
the default, or ``h100``). One sequence per device per micro-batch, full rematerialisation of
each layer, the ``ragged`` dispatch on a TPU and the ``grouped`` dispatch (Mosaic GPU grouped
matmuls) on H100s, which needs less memory per GPU than ``padded`` (docs/gpu.md has both). The
64-chip TPU layout attends with splash attention (jax's Pallas flash attention), where the
model's attention has no sinks; the others with the einsum attention.
Fine-tune the real checkpoint with ``--config.init_from=<Hugging Face dir>``: the shapes then
come from its ``config.json`` and its tokenizer is used; the model section still sets the
dispatch, compute dtype and rematerialisation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from configs import lm_quickstart
from sparsemixer_jax.training.config import mesh_config

SEQ_LEN = 4096


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one target platform runs a model: ``fsdp`` x ``expert`` devices (``data`` takes the
    rest), ``batch_size`` sequences per update in micro-batches of ``micro_batch_size``, the
    MoE ``dispatch``, ``remat`` (what the scanned layers' backward pass recomputes) and the
    ``attention`` implementation (``model.attention_impl``)."""

    fsdp: int
    expert: int
    batch_size: int
    micro_batch_size: int
    dispatch: str
    remat: str = "full"
    attention: str = "einsum"


#: The layouts of the models compiled for 64 devices (Mixtral-8x7B, Phi-3.5-MoE,
#: Qwen3-30B-A3B, gpt-oss-120b, GLM-4.5-Air): experts split 8 ways and the model width 8 ways.
POD_LAYOUTS = {
    # TPU v5p 4x4x4 (64 chips): 256 sequences per update.
    "tpu": Layout(fsdp=8, expert=8, batch_size=256, micro_batch_size=64, dispatch="ragged",
                  attention="splash"),
    # 8 hosts of 8 H100s: the same mesh; 128 sequences per update.
    "h100": Layout(fsdp=8, expert=8, batch_size=128, micro_batch_size=64, dispatch="grouped"),
}

#: The layouts of the models compiled for 8 devices (gpt-oss-20b, Moonlight-16B-A3B): experts
#: split 8 ways, every other matrix's model width too; 128 sequences per update, one per device
#: per micro-batch.
HOST_LAYOUTS = {
    # TPU v5p 2x2x2 (8 chips of 95 GiB).
    "tpu": Layout(fsdp=1, expert=8, batch_size=128, micro_batch_size=8, dispatch="ragged"),
    # One host of 8 H100s.
    "h100": Layout(fsdp=1, expert=8, batch_size=128, micro_batch_size=8, dispatch="grouped"),
}


def real_size_config(model: dict[str, Any], router: ml_collections.ConfigDict,
                     layouts: dict[str, Layout], variant: str | None,
                     attention: str | None = None) -> ml_collections.ConfigDict:
    """``lm_quickstart``'s config with ``model`` fields, ``router``, and the layout of
    ``variant`` (a key of ``layouts``; None or "" = the first); ``attention`` in place of the
    layout's (a model whose attention only the einsum computes)."""
    variant = variant or next(iter(layouts))
    if variant not in layouts:
        raise ValueError(f"config variant {variant!r}: choose one of {', '.join(layouts)}")
    layout = layouts[variant]
    c = lm_quickstart.get_config()
    model = dict(model)
    c.data.vocab_size = model.pop("vocab_size")  # from scratch, SentencePiece's size
    c.model.update(model)
    c.model.compute_dtype = "bfloat16"
    c.model.dispatch = layout.dispatch
    c.model.remat = layout.remat
    c.model.attention_impl = attention or layout.attention
    c.router = router
    c.data.seq_len = SEQ_LEN
    c.data.batch_size = layout.batch_size
    c.data.micro_batch_size = layout.micro_batch_size
    c.data.eval_batch_size = layout.micro_batch_size
    # Parameters, gradients and Adam state split over every device: expert weights over the
    # experts (expert axis) and the model width (fsdp axis); every other matrix's model width
    # over both axes (ZeRO-3 / FSDP over the whole mesh).
    c.mesh = mesh_config(data=-1, fsdp=layout.fsdp, expert=layout.expert,
                         embed=["fsdp", "expert"])
    c.sample.tokens = 0
    return c
