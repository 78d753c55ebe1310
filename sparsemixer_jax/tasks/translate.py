"""Translation with a trained run: its saved config, vocabulary and a checkpoint, and the
splitting of raw input into sentences.

``python -m experiments.translate`` reads stdin through :func:`split_lines` and prints what
:func:`translate_lines` returns. The checkpoint is the run's best one (``checkpoint="last"``
for the last); beam size and length penalty default to the run's ``config.decode``.
"""

from __future__ import annotations

import json
import os


def translate_lines(workdir: str, lines: list[str], *, checkpoint: str = "best",
                    beam_size: int | None = None, length_penalty: float | None = None,
                    batch_size: int = 64) -> list[str]:
    """Translations of ``lines`` (in order) with the run in ``workdir``."""
    import numpy as np

    from sparsemixer_jax.data.tokenizer import Tokenizer
    from sparsemixer_jax.models import decode
    from sparsemixer_jax.tasks import run_config, translation
    from sparsemixer_jax.training import build_steps
    from sparsemixer_jax.training import config as config_schema
    from sparsemixer_jax.training.checkpoint import checkpoints_root, list_checkpoints
    from sparsemixer_jax.training.state import restore_checkpoint

    if batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
    if beam_size is not None and beam_size < 1:
        raise ValueError(f"--beam_size must be >= 1, got {beam_size}")
    config_path = os.path.join(workdir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(
            f"{config_path} not found: is {workdir} a workdir of experiments.wmt?"
        )
    vocabulary = os.path.join(workdir, "spm.model")
    if not os.path.exists(vocabulary):
        raise FileNotFoundError(
            f"{vocabulary} not found: the run in {workdir} stopped before it trained its "
            "vocabulary; run experiments.wmt on this workdir first"
        )
    if not list_checkpoints(workdir, checkpoint):
        other = "last" if checkpoint == "best" else "best"
        raise FileNotFoundError(
            f"no {checkpoint} checkpoint in {os.path.join(checkpoints_root(workdir), checkpoint)}: "
            f"try --checkpoint {other}, or train first (python -m experiments.wmt --workdir "
            f"{workdir} ...)"
        )
    with open(config_path) as f:
        config = config_schema.with_defaults(json.load(f))
    if config_schema.task_of(config) != "translation":
        raise ValueError(f"{workdir} holds a {config_schema.task_of(config)} run, not a "
                         "translation run of experiments.wmt")
    tokenizer = Tokenizer(vocabulary)
    task = translation.TranslationTask.from_config(config)
    run = run_config(config, task)
    steps = build_steps(run, tokenizer.vocab_size)
    # The newest readable checkpoint of that kind (an unreadable one is named and skipped);
    # CheckpointError if none is.
    restored = restore_checkpoint(workdir, steps.abstract_state(), checkpoint)
    model = steps.model(restored.state)

    encoded = [[*tokenizer.encode(line.strip()), tokenizer.eos_id] for line in lines]
    order = sorted(range(len(lines)), key=lambda i: len(encoded[i]))  # similar lengths together
    outputs = [""] * len(lines)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        # Pad the length to a multiple of 16 and the batch to batch_size: few compilations.
        length = -(-max(len(encoded[i]) for i in rows) // 16) * 16
        inputs = np.zeros((batch_size, length), np.int32)
        for r, i in enumerate(rows):
            inputs[r, : len(encoded[i])] = encoded[i]
        seqs, _ = decode.beam_search_model(
            model, inputs, eos_id=tokenizer.eos_id,
            beam_size=task.decode.beam_size if beam_size is None else beam_size,
            alpha=task.decode.length_penalty if length_penalty is None else length_penalty,
            max_extra_len=task.decode.max_extra_len,
        )
        best = np.asarray(seqs[:, 0])
        for r, i in enumerate(rows):
            outputs[i] = tokenizer.decode(best[r].tolist())
    return outputs


def split_lines(data: bytes) -> list[str]:
    """UTF-8 input split at ``\n`` (a ``\r\n`` ending counts as one) and nowhere else.

    ``str.splitlines()`` would also split at a stray ``\r``, ``\x0c`` or U+2028 inside a
    sentence and shift every later translation against its source.
    """
    text = data.decode("utf-8")
    if not text:
        return []
    return [line.removesuffix("\r") for line in text.removesuffix("\n").split("\n")]
