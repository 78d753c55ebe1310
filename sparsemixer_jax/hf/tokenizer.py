"""A Hugging Face directory's tokenizer: ``tokenizer.json`` (the ``tokenizers`` library) with the
special tokens and the chat template of ``tokenizer_config.json``.

::

    tokenizer = hf.load_tokenizer(path)
    tokenizer.encode("Hello")                     # ids, no special tokens added
    tokenizer.special_tokens["eos_token"]         # "<|im_end|>"
    tokenizer.chat_template                       # the Jinja source, or None

The chat template is read as transformers reads it: ``chat_template.jinja`` when the directory
has one, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named
templates of which the one named ``default`` is used). Special tokens are the named ones
(``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``,
``mask_token``) of ``tokenizer_config.json``, strings or ``{"content": ...}`` records, with
``special_tokens_map.json`` filling the names it lacks.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class HFTokenizer:
    """A directory's tokenizer.

    Attributes:
      tokenizer: the ``tokenizers.Tokenizer`` of ``tokenizer.json``.
      path: the ``tokenizer.json`` file (its content keys caches of tokenized data).
      special_tokens: the named special tokens the directory declares, as text
        (``{"eos_token": "<|im_end|>", ...}``).
      chat_template: the Jinja chat template, or None.
      config_text: the raw text of ``tokenizer_config.json``, ``special_tokens_map.json`` and
        ``chat_template.jinja`` (what, with ``tokenizer.json``, decides how chats are encoded).
    """

    tokenizer: Any
    path: str
    special_tokens: dict[str, str]
    chat_template: str | None
    config_text: str = ""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def token_id(self, name: str) -> int | None:
        """The id of the special token ``name`` (``"eos_token"``, ...), or None when the
        directory names no such token or the vocabulary lacks it."""
        token = self.special_tokens.get(name)
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, no special tokens added."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])


def read_json_object(file: str) -> dict[str, Any]:
    """The JSON object in ``file``, or a one-line ValueError naming the file."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{file}: not readable JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(config: dict[str, Any], file: str) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{file}: chat_template must be a string or a list of named "
                         f"templates, got {type(template).__name__}")
    return template


def load_tokenizer(path: str) -> HFTokenizer:
    """The tokenizer of the Hugging Face directory ``path`` (module docstring): one-line
    ValueErrors for a missing ``tokenizer.json`` or an unreadable config file."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} has no tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("the tokenizer needs the tokenizers package: pip install "
                          "'sparsemixer-jax[hf]'") from err
    try:
        tokenizer = Tokenizer.from_file(file)
    except Exception as err:  # the Rust library's errors have no common Python base class
        raise ValueError(f"{file}: not a tokenizers file ({str(err).splitlines()[0]})") from None
    texts = []
    special: dict[str, str] = {}
    template = None
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        config_file = os.path.join(path, name)
        if not os.path.isfile(config_file):
            continue
        config = read_json_object(config_file)
        with open(config_file, encoding="utf-8") as f:
            texts.append(f.read())
        # tokenizer_config.json, read second, overrides the map's names.
        special.update({k: t for k in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(k)))})
        if name == "tokenizer_config.json":
            template = _chat_template(config, config_file)
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
        texts.append(template)
    return HFTokenizer(tokenizer, file, special, template, "\0".join(texts))
