"""Chat and instruction data: ids and assistant masks equal to transformers' on tiny ChatML and
Llama-3-style tokenizers (``tests/data/chat``, made by ``scripts/make_chat_references.py``),
the sandboxed rendering, bad rows, whole-example packing, and the language-modelling task
reading chat rows from a checkpoint's tokenizer.
"""

import dataclasses
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from sparsemixer_jax import hf
from sparsemixer_jax.data import chat, lm_text
from sparsemixer_jax.tasks.language_model import LMTask, next_token_sums
from tests import kit

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
CHAT = os.path.join(DATA, "chat")

with open(os.path.join(CHAT, "references.json"), encoding="utf-8") as _f:
    REFERENCES = json.load(_f)


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def tokenizer(request):
    return hf.load_tokenizer(os.path.join(CHAT, request.param))


def _name(tokenizer) -> str:
    return os.path.basename(os.path.dirname(tokenizer.path))


# ------------------------------------------------------------------- equal to transformers


@pytest.mark.parametrize("blocks", [False, True], ids=["hub-template", "generation-blocks"])
def test_ids_and_mask_equal_transformers_apply_chat_template(tokenizer, blocks):
    """Without generation blocks (the Hub's usual template), rendering one message at a time
    finds exactly the tokens that transformers' assistant mask marks on the same template with
    {% generation %} around the assistant's text and end-of-turn token."""
    name = _name(tokenizer)
    if blocks:
        tokenizer = dataclasses.replace(
            tokenizer, chat_template=REFERENCES["generation_templates"][name])
    rows = REFERENCES["encodings"][name]
    assert len(rows) >= 4 and any(not any(r["assistant_mask"]) for r in rows)
    for row in rows:
        messages = REFERENCES["conversations"][row["conversation"]]
        ids, mask = chat.encode(tokenizer, messages)
        assert ids.dtype == np.int32 and mask.dtype == bool
        assert ids.tolist() == row["ids"], row["conversation"]
        assert mask.astype(int).tolist() == row["assistant_mask"], row["conversation"]


def test_the_tokenizer_carries_its_special_tokens_and_chat_template(tmp_path):
    llama = hf.load_tokenizer(os.path.join(CHAT, "llama3"))
    # bos_token is written as an AddedToken record, eos_token as a string.
    assert llama.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    assert llama.token_id("bos_token") == 0 and llama.token_id("pad_token") is None
    assert "start_header_id" in llama.chat_template
    # chat_template.jinja wins over tokenizer_config.json; named templates use "default".
    path = tmp_path / "tok"
    shutil.copytree(os.path.join(CHAT, "chatml"), path)
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert hf.load_tokenizer(str(path)).chat_template == "{{ messages[0]['content'] }}"
    os.remove(path / "chat_template.jinja")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "D"}]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert hf.load_tokenizer(str(path)).chat_template == "D"
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: not readable JSON"):
        hf.load_tokenizer(str(path))


# ------------------------------------------------------------------------------- rendering


def _render(template, messages=(), **special):
    return chat.render(template, list(messages), special)[0]


def test_rendering_has_transformers_globals_filters_and_loop_controls():
    assert _render("{{ bos_token }}|{{ eos_token }}", bos_token="<s>", eos_token="</s>") == \
        "<s>|</s>"
    # tojson without HTML escapes or ASCII escapes, with options.
    assert _render("{{ {'a': '<é>'} | tojson }}") == '{"a": "<é>"}'
    assert _render("{{ [1, 2] | tojson(indent=1) }}") == json.dumps([1, 2], indent=1)
    year = _render("{{ strftime_now('%Y') }}")
    assert year.isdigit() and len(year) == 4
    loops = "{% for i in [1, 2, 3, 4] %}{% if i == 2 %}{% continue %}{% endif %}" \
            "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert _render(loops) == "13"
    # trim_blocks and lstrip_blocks: block tags leave no newline or indentation behind.
    assert _render("  {% if true %}\nA\n  {% endif %}\nB") == "A\nB"
    assert _render("{% set ns = namespace(n=0) %}{% set ns.n = 2 %}{{ ns.n }}") == "2"


@pytest.mark.parametrize("template, message", [
    ("{{ raise_exception('roles must alternate') }}", "refused the conversation: roles must"),
    ("{% set ns = namespace(_x=1) %}", "underscore name '_x'"),
    ("{% set x = [] %}{{ x.append(1) }}", "refused the conversation"),  # immutable sandbox
    ("{{ ''.__class__.__mro__[1] }}", "attribute '__class__' of 'str' object is unsafe"),
    ("{% if %}", "does not parse"),
])
def test_template_errors_and_sandbox_escapes_are_one_line_errors(template, message):
    with pytest.raises(ValueError, match=message) as err:
        chat.render(template, [{"role": "user", "content": "x"}], {})
    assert "\n" not in str(err.value).split(": ", 1)[0]


def test_a_sample_prompt_is_a_user_turn_before_the_generation_prompt():
    tok = hf.load_tokenizer(os.path.join(CHAT, "chatml"))
    ids = chat.generation_prompt(tok, "Hi")
    assert tok.tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_refused_without_generation_blocks():
    """Later turns change how an earlier assistant message renders (as templates that drop
    earlier reasoning do): its tokens cannot be found one message at a time."""
    template = ("{% for m in messages %}{{ m['role'] }}:"
                "{% if m['role'] == 'assistant' and not loop.last %}(old){% else %}"
                "{{ m['content'] }}{% endif %};{% endfor %}")
    tok = dataclasses.replace(hf.load_tokenizer(os.path.join(CHAT, "chatml")),
                              chat_template=template)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(ValueError, match="renders message 1 differently"):
        chat.encode(tok, messages)
    # The same conversation is encoded where the template marks the assistant's text.
    marked = ("{% for m in messages %}{{ m['role'] }}:{% if m['role'] == 'assistant' %}"
              "{% generation %}{% if not loop.last %}(old){% else %}{{ m['content'] }}{% endif %}"
              ";{% endgeneration %}{% else %}{{ m['content'] }};{% endif %}{% endfor %}")
    ids, mask = chat.encode(dataclasses.replace(tok, chat_template=marked), messages)
    assert tok.decode(ids) == "user:a;assistant:(old);user:c;assistant:d;"
    assert tok.decode(ids[mask]) == "(old);d;"


# ------------------------------------------------------------------------ rows and packing


def _rows(*lines):
    return [(f"rows.jsonl line {i + 1}", line) for i, line in enumerate(lines)]


GOOD = json.dumps({"messages": [{"role": "user", "content": "What is the capital of France?"},
                                {"role": "assistant", "content": "Paris."}]})


def test_bad_rows_are_counted_and_skipped_or_refused_with_their_line(tokenizer):
    long = json.dumps({"messages": [{"role": "user", "content": "word " * 200},
                                    {"role": "assistant", "content": "ok"}]})
    rows = _rows(GOOD, "{not json", json.dumps({"text": "x"}), json.dumps({"messages": []}),
                 json.dumps({"messages": [{"content": "no role"}]}),
                 json.dumps({"messages": [{"role": "user", "content": "no answer"}]}), long,
                 GOOD)
    examples, bad = chat.read_examples(tokenizer, rows, "chat", 128, "skip")
    assert bad == 6 and len(examples) == 2
    assert examples[0].ids.tolist() == chat.encode(tokenizer, json.loads(GOOD)["messages"])[0]\
        .tolist()
    for line, message in [(2, "not JSON"), (3, "no 'messages' list"), (4, "empty conversation"),
                          (5, "message 0 has no role"), (6, "no assistant tokens"),
                          (7, "longer than config.data.seq_len=128")]:
        with pytest.raises(ValueError, match=f"rows.jsonl line {line}: .*{message}") as err:
            chat.read_examples(tokenizer, [rows[0], rows[line - 1]], "chat", 128, "error")
        assert "\n" not in str(err.value)


def test_packing_keeps_every_example_whole_and_targets_only_its_mask():
    def example(n, first_target):
        mask = np.arange(n) >= first_target
        return chat.Example(np.arange(100, 100 + n, dtype=np.int32), mask, int(mask.sum()))

    examples = [example(5, 2), example(4, 1), example(6, 3), example(8, 4), example(2, 1)]
    tokens, segments, targets = chat.pack_examples(examples, seq_len=10)
    assert tokens.shape == (3, 10)  # [5 + 4], [6], [8 + 2]: a row never splits an example
    for i, e in enumerate(examples):
        rows, cols = np.nonzero(segments == i + 1)
        assert len(set(rows)) == 1 and np.all(np.diff(cols) == 1)
        np.testing.assert_array_equal(tokens[rows, cols], e.ids)
        np.testing.assert_array_equal(targets[rows, cols], e.loss_mask)
    assert not targets[segments == 0].any()
    nbytes = np.asarray([e.nbytes for e in examples])
    per_row = lm_text.row_bytes(targets, segments, nbytes)
    np.testing.assert_array_equal(per_row, [3 + 3, 3, 4 + 1])  # each row its examples' bytes


def test_prompt_completion_learns_the_completion_and_eos():
    tok = hf.load_tokenizer(os.path.join(CHAT, "llama3"))  # its post-processor adds bos
    example = chat.encode_prompt_completion(tok, "The capital of France is", " Paris.")
    prompt = tok.encode("The capital of France is", add_special_tokens=True)
    assert prompt[0] == tok.token_id("bos_token")
    assert example.ids.tolist() == prompt + tok.encode(" Paris.") + [tok.token_id("eos_token")]
    assert tok.decode(example.ids[example.loss_mask]) == " Paris."  # eos decodes to nothing
    assert example.loss_mask[-1] and example.nbytes == len(" Paris.")
    rows = _rows(json.dumps({"prompt": "a", "completion": "b"}), json.dumps({"prompt": "a"}))
    with pytest.raises(ValueError, match="line 2: needs a string 'prompt' and a string"):
        chat.read_examples(tok, rows, "prompt_completion", 64, "error")


def test_text_documents_keep_the_newlines_between_paragraphs():
    """A byte-level tokenizer encodes a document's paragraphs joined as the source has them, so
    the decoded text is the document's (paragraphs used to be glued: "Y13.Location")."""
    tok = lm_text.HFTokenizerLM(hf.load_tokenizer(os.path.join(CHAT, "chatml")), bos_id=0)
    docs = [["The city of Harrow lies to Y13.", "Location. In 1990, the river flooded."],
            ["One paragraph only."]]
    encoded = lm_text.encode_documents(tok, docs)
    assert [e[0] for e in encoded] == [0, 0]
    assert [tok.decode(e[1:]) for e in encoded] == ["\n".join(d) for d in docs]
    assert lm_text.document_bytes(docs).tolist() == [len("\n".join(d).encode()) for d in docs]


# ------------------------------------------------------------------- the language-model task


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Mixtral's config with the ChatML tokenizer (its vocabulary widened to hold it;
    the data path reads no weights)."""
    path = tmp_path_factory.mktemp("ckpt") / "chatml-mixtral"
    shutil.copytree(os.path.join(DATA, "hf", "mixtral"), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(CHAT, "chatml", name), path / name)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "vocab_size": 512}))
    return str(path)


def _chat_config(train, checkpoint, **overrides):
    return kit.tiny_config("lm", **{
        "init_from": checkpoint, "data.train": train, "data.format": "chat",
        "data.valid_articles": 2,
        "data.seq_len": 96, "data.batch_size": 2, "data.eval_batch_size": 2,
        "data.wikitext": "", "sample.tokens": 0, **overrides})


def test_the_task_packs_chat_rows_and_counts_the_assistant_targets(checkpoint, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Say {i}."},
                          {"role": "assistant", "content": f"{i}, as asked."}]}
            for i in range(9)]
    train = tmp_path / "chat.jsonl"
    train.write_text("\n".join([json.dumps(r) for r in rows[:5]] + ["{broken"]
                               + [json.dumps(r) for r in rows[5:]]) + "\n")
    config = _chat_config(str(train), checkpoint)
    task = LMTask.from_config(config)
    data = task.load_data(str(tmp_path / "w"), 1)
    stats = data.stats
    assert stats["train"]["rows"] == 8 and stats["train"]["bad_rows"] == 1
    assert stats["valid"]["rows"] == 2 and stats["valid"]["examples"] == 2  # the last rows
    tokenizer = data.extra["tokenizer"].hf
    valid = data.extra["valid_split"]
    expected = [chat.encode(tokenizer, r["messages"]) for r in rows[-2:]]
    assert valid.targets.sum() == sum(int(m[1:].sum()) for _, m in expected)
    assert tokenizer.tokenizer.decode(valid.tokens[valid.targets].tolist(),
                                      skip_special_tokens=False) == \
        "7, as asked.<|im_end|>8, as asked.<|im_end|>"
    # The validation tokens are the targets the loss is on (uniform logits: nll = ln V each).
    batch = data.valid[0]
    logits = jnp.zeros((*batch["tokens"].shape, 512), jnp.float32)
    sums = next_token_sums(logits, batch["tokens"], batch["targets"], batch["bytes"])
    metrics = task.validation_metrics(sums)
    assert metrics["valid_tokens"] == valid.targets.sum()
    assert metrics["valid_loss"] == pytest.approx(np.log(512), rel=1e-6)  # float32 sums
    assert metrics["valid_bytes"] == len("7, as asked.8, as asked.")
    with pytest.raises(ValueError, match=r"chat.jsonl line 6: not JSON .*on_bad_row='skip'"):
        strict = _chat_config(str(train), checkpoint, **{"data.on_bad_row": "error"})
        LMTask.from_config(strict).load_data(str(tmp_path / "w2"), 1)


def test_the_task_packs_prompt_completion_rows(checkpoint, tmp_path):
    train = tmp_path / "pc.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"Say {i}:", "completion": f" {i}."}) + "\n"
                             for i in range(20)))
    config = _chat_config(str(train), checkpoint, **{"data.format": "prompt_completion",
                                                     "data.seq_len": 16})
    data = LMTask.from_config(config).load_data(str(tmp_path / "w"), 1)
    valid, tokenizer = data.extra["valid_split"], data.extra["tokenizer"].hf
    assert tokenizer.tokenizer.decode(valid.tokens[valid.targets].tolist(),
                                      skip_special_tokens=False) == " 18.<|im_end|> 19.<|im_end|>"
    assert data.stats["valid"]["bytes"] == len(" 18. 19.")


@pytest.mark.parametrize("overrides, message", [
    ({"init_from": ""}, "data.format='chat' needs a checkpoint's tokenizer"),
    ({"data.format": "dialogue"}, "config.data.format='dialogue'; choose one of"),
    ({"data.on_bad_row": "ignore"}, "config.data.on_bad_row='ignore'; choose one of"),
])
def test_chat_config_errors_are_one_line(checkpoint, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        LMTask.from_config(_chat_config(str(tmp_path / "x.jsonl"), checkpoint, **overrides))


def test_a_checkpoint_without_a_template_or_eos_is_refused_before_any_data(checkpoint, tmp_path):
    path = tmp_path / "no-template"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no-template.*has none"):
        LMTask.from_config(_chat_config("x.jsonl", str(path)))
    # prompt_completion rows need no template, but an eos token.
    LMTask.from_config(_chat_config("x.jsonl", str(path), **{"data.format": "prompt_completion"}))
    del config["eos_token"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"no-template.*tokenizer names none .*eos_token"):
        LMTask.from_config(_chat_config("x.jsonl", str(path),
                                        **{"data.format": "prompt_completion"}))


@pytest.mark.slow  # fast counterpart: test_the_task_packs_chat_rows_and_counts_the_assistant_...
def test_a_chat_fine_tuning_run_reports_the_assistant_targets(tmp_path):
    from flax import nnx

    from sparsemixer_jax.models.causal_lm import CausalLM
    from sparsemixer_jax.tasks.language_model import train_lm

    with open(os.path.join(DATA, "hf", "mixtral", "config.json")) as f:
        config = json.load(f)
    lm = hf.from_hf({**config, "vocab_size": 512})
    path = str(tmp_path / "ckpt")
    hf.save_pretrained(CausalLM(lm, rngs=nnx.Rngs(params=0, router=1)), lm, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(CHAT, "chatml", name), path)
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{2 * i}."}]} for i in range(12)]
    train = tmp_path / "chat.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n{}\n")
    results = train_lm(_chat_config(str(train), path, train_steps=2, eval_every=2,
                                    checkpoint_every=2, **{"data.valid_articles": 3}),
                       str(tmp_path / "run"))
    stats = results["data_stats"]
    assert stats["valid"]["bad_rows"] == 1 and stats["valid"]["examples"] == 2
    assert results["valid_tokens"] == stats["valid"]["targets"] > 0
    assert np.isfinite(results["valid_loss"]) and results["steps"] == 2
