"""Tiny chat tokenizers and transformers' chat encodings of them, for tests/test_chat.py.

Run under any Python with transformers, jinja2 and tokenizers (not the project's environment;
CI has no transformers). The committed files were made with transformers 5.23.0, tokenizers
0.23.3 and jinja2 3.1.6:

    /tmp/torchenv/bin/python scripts/make_chat_references.py     # writes tests/data/chat/

It trains two byte-level BPE vocabularies (``tokenizers``, about 400 tokens, on a few sentences
written here) and saves them as Hugging Face directories ``tests/data/chat/<name>/``
(``tokenizer.json`` + ``tokenizer_config.json`` with the special tokens and a chat template):

* ``chatml``: ``<|im_start|>role\\ncontent<|im_end|>\\n`` turns, a default system turn, a
  ``raise_exception`` for an unknown role;
* ``llama3``: a ``bos_token``, header tokens, ``<|eot_id|>`` ends, a ``trim`` filter, a
  ``date_string`` default, a ``{% continue %}`` that skips ``ipython`` turns, and a tokenizer
  whose post-processor adds the bos token (apply_chat_template must not: it tokenizes with
  ``add_special_tokens=False``); its ``bos_token`` is written in the older ``AddedToken`` form.

Like most templates on the Hub, neither has ``{% generation %}`` blocks. Each also has a
generation-block variant (the same text, with the assistant's content and end-of-turn token
inside ``{% generation %}``), kept in ``references.json``. For every conversation of
``references.json`` and each template, the file holds transformers'
``apply_chat_template(messages, tokenize=True)`` ids (they are the same for both variants) and
the assistant-token mask of ``return_assistant_tokens_mask=True`` on the generation variant.
"""

from __future__ import annotations

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "chat")

CORPUS = [
    "The city of Harrow lies to the north-west of London.",
    "In 1990, the river flooded the old town; its people moved to the hills.",
    "What is the capital of France? The capital of France is Paris.",
    "Summarise the text in one sentence, please.",
    "You are a helpful assistant. Answer briefly and politely.",
    "Positive or negative: the film was a delight from start to end.",
    "Café au lait, naïve résumé, 日本語のテキスト, and numbers like 42 or 3.14.",
    "def add(a, b):\n    return a + b\n",
]

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'assistant' %}\n"
    "        {{- '<|im_start|>assistant\\n' }}"
    "@@{{- message['content'] + '<|im_end|>' }}@@{{- '\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = '' %}\n"
    "{%- endif %}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- set date_string = '26 Jul 2024' %}\n"
    "{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}\n"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}\n"
    "{{- system_message }}\n"
    "{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'ipython' %}\n"
    "        {%- continue %}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "@@{{- message['content'] | trim + '<|eot_id|>' }}@@"
    "{%- else %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


def variants(template: str) -> tuple[str, str]:
    """``(hub, generation)``: the template without and with ``{% generation %}`` blocks (the
    ``@@`` marks above)."""
    hub = template.replace("@@", "")
    parts = template.split("@@")  # outside, inside, outside, ...
    generation = parts[0]
    for i, part in enumerate(parts[1:]):
        generation += ("{% generation %}" if i % 2 == 0 else "{% endgeneration %}") + part
    return hub, generation


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "Answer briefly.  "},
     {"role": "user", "content": "Summarise: the river flooded the old town."},
     {"role": "assistant", "content": "  The town flooded.\nIts people moved.  "},
     {"role": "user", "content": "Positive or negative: café au lait, 日本語?"},
     {"role": "assistant", "content": "Positive 😀"}],
    [{"role": "user", "content": "Write add(a, b) in Python."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
     {"role": "user", "content": "Thanks<|im_end|> and<|eot_id|> bye"},
     {"role": "assistant", "content": "", "name": "bot"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "No answer yet."}],
]

# ipython turns are skipped by the llama3 template only (chatml refuses them).
LLAMA3_ONLY = [
    [{"role": "user", "content": "Look it up."},
     {"role": "ipython", "content": "42"},
     {"role": "assistant", "content": "It is 42."}],
]


def byte_level_bpe(special: list[str], split: str | None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.pre_tokenizer = byte_level if split is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


def write(name: str, tok: Tokenizer, config: dict) -> str:
    path = os.path.join(OUT, name)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096,
                   **config}, f, indent=2, ensure_ascii=False)
    return path


def main() -> None:
    chatml_hub, chatml_gen = variants(CHATML_TEMPLATE)
    llama_hub, llama_gen = variants(LLAMA3_TEMPLATE)
    chatml = byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None)
    chatml.post_processor = processors.ByteLevel(trim_offsets=False)
    llama = byte_level_bpe(["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                            "<|end_header_id|>", "<|eot_id|>"],
                           r"\s?\p{L}+|\p{N}|\s?[^\s\p{L}\p{N}]+|\n+|\s+")
    llama.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      special_tokens=[("<|begin_of_text|>", 0)])])
    dirs = {
        "chatml": write("chatml", chatml, {"bos_token": None, "eos_token": "<|im_end|>",
                                           "pad_token": "<|endoftext|>",
                                           "chat_template": chatml_hub}),
        "llama3": write("llama3", llama, {
            "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>",
                          "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False},
            "eos_token": "<|eot_id|>", "chat_template": llama_hub}),
    }
    references = {"generation_templates": {"chatml": chatml_gen, "llama3": llama_gen},
                  "conversations": CONVERSATIONS + LLAMA3_ONLY, "encodings": {}}
    for name, path in dirs.items():
        tokenizer = AutoTokenizer.from_pretrained(path)
        generation = references["generation_templates"][name]
        rows = []
        for i, messages in enumerate(references["conversations"]):
            if name == "chatml" and messages in LLAMA3_ONLY:
                continue
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
            marked = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                   chat_template=generation,
                                                   return_assistant_tokens_mask=True)
            assert marked["input_ids"] == ids["input_ids"], (name, i)
            rows.append({"conversation": i, "ids": ids["input_ids"],
                         "assistant_mask": marked["assistant_masks"],
                         "text": tokenizer.apply_chat_template(messages, tokenize=False)})
        references["encodings"][name] = rows
    with open(os.path.join(OUT, "references.json"), "w") as f:
        json.dump(references, f, indent=1, ensure_ascii=False)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
