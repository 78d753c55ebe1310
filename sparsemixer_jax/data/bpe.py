"""A byte-level BPE vocabulary with ChatML special tokens, for language models trained from
scratch (``config.data.tokenizer = "bpe"``), written as a Hugging Face tokenizer.

:func:`train_bpe` trains it with the ``tokenizers`` library on the training text and writes
``tokenizer.json`` and ``tokenizer_config.json`` (special tokens and a ChatML chat template)
into the run's workdir, so the export carries them and a fine-tuning run on chat rows
(``data.format = "chat"``) renders conversations with the template.

The special tokens take the first ids: ``<|endoftext|>`` (0) starts every document and pads,
``<|im_start|>`` (1) opens a turn and ``<|im_end|>`` (2) closes it and is the eos token. Text
is split as GPT-2 splits it (``tokenizers``' byte-level pre-tokenizer: every byte string has
a spelling, no unknown token), and decoding gives the text back exactly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
#: ``config.json``'s token ids of a model with this vocabulary (the ids of the special tokens).
TOKEN_IDS = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}

#: ChatML, as Qwen's and others' checkpoints write it, without a default system message: each
#: turn is ``<|im_start|>{role}\n{content}<|im_end|>\n``; the generation prompt opens the
#: assistant's turn.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": ENDOFTEXT,
                    "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": None,
                    "chat_template": CHATML_TEMPLATE}


def train_bpe(texts: Sequence[str], workdir: str, vocab_size: int) -> None:
    """Trains a ``vocab_size``-token byte-level BPE on ``texts`` (each a document, newlines
    kept) and writes ``{workdir}/tokenizer.json`` and ``tokenizer_config.json`` (module
    docstring). ``tokenizer.json`` is written last, each file whole or not at all, so a
    directory holding it holds both. The vocabulary is smaller than ``vocab_size`` only where
    the text has fewer distinct merges; a ``vocab_size`` below the 256 bytes and the special
    tokens is a one-line ValueError."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    floor = 256 + len(SPECIAL_TOKENS)
    if vocab_size < floor:
        raise ValueError(f"config.data.vocab_size={vocab_size}: a byte-level BPE needs at least "
                         f"{floor} tokens (256 bytes and {len(SPECIAL_TOKENS)} special tokens)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False: a token's offsets keep its leading space, as the chat mask expects.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    os.makedirs(workdir, exist_ok=True)
    partial = os.path.join(workdir, f"tokenizer_config.json.tmp{os.getpid()}")
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(TOKENIZER_CONFIG, f, indent=2, ensure_ascii=False)
    os.replace(partial, os.path.join(workdir, "tokenizer_config.json"))
    partial = os.path.join(workdir, f"tokenizer.json.tmp{os.getpid()}")
    tokenizer.save(partial)
    os.replace(partial, os.path.join(workdir, "tokenizer.json"))
