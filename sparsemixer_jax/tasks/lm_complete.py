"""Text continued by a language model, from a Hugging Face directory or a run's checkpoint
(``python -m experiments.generate``).

::

    from sparsemixer_jax.tasks import lm_complete
    source = lm_complete.load_source(model_dir="hf_dir")        # or workdir="runs/lm_quickstart"
    print(lm_complete.complete(source, "Hello", 32, chat=True))

A prompt is a document's start, as the model was trained on documents: the tokenizer's
document start (``bos``) then the prompt's tokens. With ``chat=True`` it is one user turn
rendered by the checkpoint's chat template with the generation prompt
(:func:`sparsemixer_jax.data.chat.generation_prompt`). Decoding stops at the end token
(:func:`end_id`) and the text after the prompt is returned.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from sparsemixer_jax.data import chat, lm_text
from sparsemixer_jax.models.causal_lm import CausalLM


@dataclasses.dataclass(frozen=True)
class Source:
    """A model and its tokenizer; ``name`` says where they came from (messages)."""

    model: CausalLM
    tokenizer: lm_text.LMTokenizer
    name: str


def load_source(model_dir: str | None = None, workdir: str | None = None,
                checkpoint: str = "last") -> Source:
    """The model and tokenizer of a Hugging Face directory (``model_dir``:
    ``hf.load_pretrained``, ``hf.load_tokenizer``) or of a language-modelling run's
    ``checkpoint`` (``workdir``: the model as ``experiments.lm_export`` restores it, the
    tokenizer the run trained with). Exactly one of the two; one-line errors (ValueError,
    FileNotFoundError) for a missing directory or tokenizer, or a tokenizer larger than the
    model's vocabulary."""
    from sparsemixer_jax import hf

    if (model_dir is None) == (workdir is None):
        raise ValueError("give exactly one of --model (a Hugging Face directory) and "
                         "--workdir (a run of experiments.lm)")
    where = model_dir if workdir is None else workdir
    if not os.path.isdir(where):
        raise FileNotFoundError(f"{where}: no such directory")
    if model_dir is not None:
        tokenizer = hf.load_tokenizer(model_dir)  # before the weights: the cheap check first
        model, config = hf.load_pretrained(model_dir)
        lm_tokenizer = lm_text.HFTokenizerLM(tokenizer, lm_text.hf_bos_id(config.hf))
    else:
        from sparsemixer_jax.tasks.lm_export import open_run, restore_model

        config, task = open_run(workdir, checkpoint)
        if not task.init_from and task.data.tokenizer != "bpe" \
                and not os.path.isfile(os.path.join(workdir, "spm.model")):
            raise FileNotFoundError(f"{workdir} has no spm.model: the run's tokenizer is gone")
        lm_tokenizer = task.tokenizer(workdir)
        model, _ = restore_model(workdir, config, task, checkpoint)
    if lm_tokenizer.vocab_size > model.config.arch.vocab_size:
        raise ValueError(f"{where}: the tokenizer has {lm_tokenizer.vocab_size} tokens but the "
                         f"model's vocabulary {model.config.arch.vocab_size}")
    model.eval()
    return Source(model, lm_tokenizer, where)


def end_id(tokenizer: lm_text.LMTokenizer) -> int | None:
    """The token that ends a continuation: a checkpoint tokenizer's ``eos_token``, else (and for
    the project's SentencePiece vocabulary) the document start, which begins the next document;
    None when the tokenizer names neither."""
    hf_tokenizer = getattr(tokenizer, "hf", None)
    if hf_tokenizer is not None and hf_tokenizer.token_id("eos_token") is not None:
        return hf_tokenizer.token_id("eos_token")
    return tokenizer.bos_id


def prompt_ids(source: Source, prompt: str, chat_turn: bool = False) -> list[int]:
    """The prompt's ids (module docstring); ``chat_turn`` needs a tokenizer with a chat
    template (else a one-line ValueError)."""
    hf_tokenizer = getattr(source.tokenizer, "hf", None)
    if not chat_turn:
        return [source.tokenizer.bos_id, *(source.tokenizer.encode_batch([prompt])[0]
                                           if prompt else [])]
    if hf_tokenizer is None or hf_tokenizer.chat_template is None:
        raise ValueError(f"{source.name}: --chat needs a chat template and this tokenizer has "
                         "none (tokenizer_config.json's chat_template or chat_template.jinja)")
    return chat.generation_prompt(hf_tokenizer, prompt)


def complete(source: Source, prompt: str, max_new_tokens: int, *, chat_turn: bool = False,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0) -> str:
    """The text the model writes after ``prompt`` (:func:`prompt_ids`): at most
    ``max_new_tokens`` tokens, up to and without the end token (:func:`end_id`); greedy when
    ``temperature`` is 0, else sampled with ``top_k`` and ``top_p`` from ``seed``
    (:func:`sparsemixer_jax.models.lm_generate.generate`)."""
    from sparsemixer_jax.models.lm_generate import generate

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    ids = prompt_ids(source, prompt, chat_turn)
    stop = end_id(source.tokenizer)
    out = generate(source.model, jnp.asarray([ids], jnp.int32), max_new_tokens,
                   temperature=temperature, top_k=top_k, top_p=top_p,
                   key=jax.random.key(seed) if temperature > 0 else None, eos_id=stop)
    continuation = [int(t) for t in np.asarray(out[0, len(ids):])]
    if stop in continuation:
        continuation = continuation[: continuation.index(stop)]
    return source.tokenizer.decode(continuation)
