"""Chat and instruction data for fine-tuning: conversations rendered with a checkpoint's chat
template, the assistant-token loss mask, JSON-lines rows and their packing.

::

    from sparsemixer_jax import hf
    from sparsemixer_jax.data import chat
    tokenizer = hf.load_tokenizer(path)
    ids, loss_mask = chat.encode(tokenizer, [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello!"}])

Rendering follows transformers' ``apply_chat_template``: the template runs in jinja2's immutable
sandbox with ``trim_blocks`` and ``lstrip_blocks``, the loop controls (``{% break %}``,
``{% continue %}``), the globals ``raise_exception``, ``strftime_now`` and ``namespace`` (which
refuses underscore names), a ``tojson`` filter that writes JSON without HTML escapes, and the
variables ``messages``, ``tools`` and ``documents`` (None), ``add_generation_prompt`` and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...). Message keys whose value is None
are dropped, and a message's reasoning given as ``thinking`` or ``reasoning`` is also given as
``reasoning_content`` (and as ``thinking``), as transformers does. The text is tokenized
without adding special tokens (the template writes them).

The loss mask marks the assistant's tokens. A template with ``{% generation %}`` blocks marks
them itself: the mask is transformers' assistant-token mask (the tokens from the one holding a
block's first character to the one holding its last). Most templates have none; then each
assistant message's span is found by rendering the conversation one message at a time: it
starts where the conversation before it, rendered with the generation prompt, ends (so the
assistant header is not a target) and ends where the conversation up to it ends, less trailing
whitespace (the end-of-turn token is a target, the newline some templates put after it is not).
A template that renders an earlier message differently once later ones follow (some drop
earlier reasoning) cannot be split this way: such a row is refused, and the template needs
``{% generation %}`` blocks.

Rows (:func:`read_examples`) are JSON lines: ``{"messages": [{"role", "content"}, ...]}``
(``chat``) or ``{"prompt": str, "completion": str}`` (``prompt_completion``: the prompt
tokenized with the tokenizer's special tokens, the completion after it, then the eos token; the
loss is on the completion and the eos token). Packing (:func:`pack_examples`) puts whole
examples into rows of ``seq_len`` tokens, in order, a new row when the next does not fit:
segment ``i + 1`` is example ``i``, 0 is padding, and a position is a target where the example's
loss mask marks it. An example is never split across rows.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import numpy as np

from sparsemixer_jax.data.sources import iter_lines

logger = logging.getLogger(__name__)

FORMATS = ("text", "chat", "prompt_completion")
BAD_ROW_POLICIES = ("skip", "error")

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

# ------------------------------------------------------------------------------- rendering


class _Tracking:
    """The characters rendered so far and the ``{% generation %}`` spans seen (one render)."""

    def __init__(self):
        self.length, self.spans = 0, []


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """The chat template ``source`` compiled in the sandboxed environment of the module
    docstring (a ``jinja2.Template``; cached by source)."""
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("chat templates need jinja2: pip install 'sparsemixer-jax[hf]'") \
            from err

    class GenerationBlocks(Extension):
        """``{% generation %}...{% endgeneration %}``: records where its output lies."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_record"), [], [], body).set_lineno(lineno)

        def _record(self, caller):
            out = caller()
            tracking = self.environment.chat_tracking
            if tracking is not None:
                tracking.spans.append((tracking.length, tracking.length + len(out)))
            return out

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names (no reach into Python internals)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set the underscore name {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, "jinja2.ext.loopcontrols"])
    env.chat_tracking = None
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *args, **kwargs: dict(*args, **kwargs))
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template does not parse: {err} (line {err.lineno})") \
            from None


def template_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them: keys with None values dropped, reasoning under
    ``reasoning_content`` and ``thinking`` too."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(template: str, messages: Sequence[Mapping[str, Any]],
           special_tokens: Mapping[str, str], *, add_generation_prompt: bool = False
           ) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: the conversation rendered by ``template`` (``messages`` as given: see
    :func:`template_messages`) and the character spans of its ``{% generation %}`` blocks.
    A template error (``raise_exception``, an undefined value) is a one-line ValueError."""
    import jinja2

    compiled = compile_template(template)
    tracking = compiled.environment.chat_tracking = _Tracking()
    blocks = []
    try:
        for block in compiled.generate(messages=list(messages), tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt,
                                       **special_tokens):
            blocks.append(block)
            tracking.length += len(block)
    except jinja2.TemplateError as err:
        raise ValueError(f"the chat template refused the conversation: {err}") from None
    finally:
        compiled.environment.chat_tracking = None
    return "".join(blocks), tracking.spans


def _message_spans(template: str, messages: list[dict[str, Any]],
                   special_tokens: Mapping[str, str], text: str) -> list[tuple[int, int]]:
    """The assistant messages' character spans in ``text``, one message rendered at a time
    (module docstring)."""
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, _ = render(template, messages[:k], special_tokens, add_generation_prompt=True)
        upto, _ = render(template, messages[: k + 1], special_tokens)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ValueError(
                f"the chat template renders message {k} differently once later messages "
                "follow, so its tokens cannot be found; give the template {% generation %} "
                "blocks around the assistant's text")
        spans.append((len(before), max(len(before), len(upto.rstrip()))))
    return spans


def _token_mask(encoding: Any, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """bool ``[T]``: the tokens of each span, as transformers maps a ``{% generation %}``
    block to tokens (from the token holding its first character to the one holding its last;
    a span whose first character no token holds ends the marking)."""
    mask = np.zeros(len(encoding.ids), bool)
    for start, end in spans:
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        if first is None:
            break
        mask[first: last + 1 if last else len(mask)] = True
    return mask


# -------------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class Example:
    """One encoded row: ``ids`` int32 ``[T]``, ``loss_mask`` bool ``[T]`` (the targets), and
    ``nbytes``: the UTF-8 bytes of the text the targets spell (special tokens not counted)."""

    ids: np.ndarray
    loss_mask: np.ndarray
    nbytes: int


def _target_bytes(text: str, encoding: Any, mask: np.ndarray, special: set[int]) -> int:
    covered = np.zeros(len(text) + 1, bool)
    for t in np.flatnonzero(mask):
        if encoding.ids[t] not in special:
            start, end = encoding.offsets[t]
            covered[start:end] = True
    return len("".join(c for c, on in zip(text, covered, strict=False) if on).encode("utf-8"))


def _special_ids(tokenizer: Any) -> set[int]:
    return {i for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special}


def encode_example(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> Example:
    """:func:`encode` with the bytes of the targets' text."""
    template = tokenizer.chat_template
    if template is None:
        raise ValueError(f"{tokenizer.path}: the tokenizer has no chat template "
                         "(tokenizer_config.json's chat_template or chat_template.jinja)")
    messages = template_messages(messages)
    text, spans = render(template, messages, tokenizer.special_tokens)
    if not _GENERATION_TAG.search(template):
        spans = _message_spans(template, messages, tokenizer.special_tokens, text)
    encoding = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    mask = _token_mask(encoding, spans)
    return Example(np.asarray(encoding.ids, np.int32), mask,
                   _target_bytes(text, encoding, mask, _special_ids(tokenizer)))


def encode(tokenizer: Any, messages: Sequence[Mapping[str, Any]]
           ) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, loss_mask)``: int32 ``[T]``, the ids of transformers'
    ``apply_chat_template(messages, tokenize=True)``, and bool ``[T]``, the assistant's tokens
    (module docstring). ``tokenizer``: :func:`sparsemixer_jax.hf.load_tokenizer`'s."""
    example = encode_example(tokenizer, messages)
    return example.ids, example.loss_mask


def generation_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """The ids of one user turn ``prompt`` followed by the template's generation prompt (what
    precedes an assistant's answer)."""
    text, _ = render(tokenizer.chat_template, [{"role": "user", "content": prompt}],
                     tokenizer.special_tokens, add_generation_prompt=True)
    return tokenizer.encode(text)


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str) -> Example:
    """The prompt with the tokenizer's special tokens, the completion and the eos token; the
    targets are the completion's tokens and the eos token."""
    eos = tokenizer.token_id("eos_token")
    if eos is None:
        raise ValueError(f"{tokenizer.path}: prompt_completion rows end with the eos token, "
                         "and the tokenizer names none (tokenizer_config.json's eos_token)")
    first = tokenizer.encode(prompt, add_special_tokens=True)
    second = tokenizer.encode(completion)
    ids = np.asarray(first + second + [eos], np.int32)
    mask = np.arange(len(ids)) >= len(first)
    return Example(ids, mask, len(completion.encode("utf-8")))


def _row_example(tokenizer: Any, line: str, fmt: str) -> Example:
    """One JSON line as an :class:`Example`; ValueError naming what is wrong with it."""
    try:
        row = json.loads(line)
    except ValueError as err:
        raise ValueError(f"not JSON ({err})") from None
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object but {type(row).__name__}")
    if fmt == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("needs a string 'prompt' and a string 'completion' (a conversation "
                             "belongs in data.format=chat)")
        return encode_prompt_completion(tokenizer, prompt, completion)
    messages = row.get("messages")
    if not isinstance(messages, list):
        raise ValueError("has no 'messages' list")
    if not messages:
        raise ValueError("empty conversation")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} has no role")
    example = encode_example(tokenizer, messages)
    if not example.loss_mask[1:].any():
        raise ValueError("has no assistant tokens to learn")
    return example


def read_rows(files: Sequence[str]) -> list[tuple[str, str]]:
    """``(where, line)`` for every non-blank line of ``files``; ``where`` is ``"FILE line N"``."""
    return [(f"{file} line {n}", line) for file in files
            for n, line in enumerate(iter_lines(file), start=1) if line.strip()]


def read_examples(tokenizer: Any, rows: Sequence[tuple[str, str]], fmt: str, seq_len: int,
                  on_bad_row: str) -> tuple[list[Example], int]:
    """``(examples, bad)``: the rows encoded, and how many were bad (not JSON, no messages, an
    empty conversation, a message without a role, no assistant tokens, a template error, or
    longer than ``seq_len`` tokens). A bad row is skipped (``on_bad_row="skip"``, the count
    logged with the first few) or refused (``"error"``: a one-line ValueError naming its
    file and line)."""
    examples, bad = [], []
    for where, line in rows:
        try:
            example = _row_example(tokenizer, line, fmt)
            if len(example.ids) > seq_len:
                raise ValueError(f"{len(example.ids)} tokens, longer than config.data.seq_len="
                                 f"{seq_len} (rows are never cut)")
        except ValueError as err:
            if on_bad_row == "error":
                raise ValueError(f"{where}: {err} (config.data.on_bad_row='skip' skips such "
                                 "rows)") from None
            bad.append(f"{where}: {err}")
            continue
        examples.append(example)
    if bad:
        logger.warning("%d bad rows skipped (config.data.on_bad_row='skip'), the first: %s",
                       len(bad), "; ".join(bad[:3]))
    return examples, len(bad)


def pack_examples(examples: Sequence[Example], seq_len: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, segments, targets)`` ``[N, seq_len]`` (int32, int32, bool): whole examples in
    order, a new row when the next does not fit (module docstring). Each example must fit."""
    rows: list[list[int]] = []
    used = seq_len
    for i, example in enumerate(examples):
        if used + len(example.ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += len(example.ids)
    tokens = np.zeros((len(rows), seq_len), np.int32)
    segments = np.zeros((len(rows), seq_len), np.int32)
    targets = np.zeros((len(rows), seq_len), bool)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            e = examples[i]
            n = len(e.ids)
            tokens[r, at: at + n], segments[r, at: at + n] = e.ids, i + 1
            targets[r, at + 1: at + n] = e.loss_mask[1:]  # a row's first token has no context
            at += n
    return tokens, segments, targets
