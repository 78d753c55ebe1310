"""The byte-level BPE vocabulary of runs from scratch (``data.tokenizer = "bpe"``): its files,
the exact round trip, the ChatML template's assistant mask, and a tiny run whose export
carries the tokenizer and names its special tokens' ids.
"""

import json
import os

import numpy as np
import pytest

from sparsemixer_jax import hf
from sparsemixer_jax.data import bpe, chat, lm_text
from sparsemixer_jax.tasks import lm_export
from sparsemixer_jax.tasks.language_model import LMTask, train_lm
from tests import kit, tiny_lm_config

TEXTS = ["The river runs to the harbour.\nIts banks are green in spring.",
         "In 1990, the city built a bridge over the river.",
         "Café owners — and their guests — walk along the banks."] * 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("bpe"))
    bpe.train_bpe(TEXTS, workdir, vocab_size=300)
    return workdir


def test_the_vocabulary_is_written_as_a_hugging_face_tokenizer(trained):
    assert sorted(os.listdir(trained)) == ["tokenizer.json", "tokenizer_config.json"]
    tokenizer = hf.load_tokenizer(trained)
    # 256 bytes, 3 special tokens and the merges the text has, up to the size asked for.
    assert 259 < tokenizer.vocab_size <= 300
    assert [tokenizer.tokenizer.token_to_id(t) for t in bpe.SPECIAL_TOKENS] == [0, 1, 2]
    assert {name: tokenizer.token_id(name) for name in ("bos_token", "eos_token", "pad_token")
            } == {"bos_token": 0, "eos_token": 2, "pad_token": 0}
    assert tokenizer.chat_template == bpe.CHATML_TEMPLATE


@pytest.mark.parametrize("text", ["The river runs to the harbour.\n\nIn 1990,  it froze.",
                                  "Unseen: Zürich ☃ 日本 \t tabs", " leading and trailing "])
def test_decoding_gives_the_text_back_exactly(trained, text):
    """Byte-level: text never seen in training (other scripts, an emoji) still has a spelling."""
    tokenizer = hf.load_tokenizer(trained)
    ids = tokenizer.encode(text)
    assert ids and max(ids) < tokenizer.vocab_size and 0 not in ids
    assert tokenizer.decode(ids) == text
    # Merges shorten the trained text: fewer tokens than bytes.
    assert len(tokenizer.encode(TEXTS[0])) < len(TEXTS[0].encode())


def test_the_chatml_template_marks_the_answer_and_its_end_of_turn(trained):
    tokenizer = hf.load_tokenizer(trained)
    messages = [{"role": "user", "content": "Is it green?"},
                {"role": "assistant", "content": "yes"}]
    ids, mask = chat.encode(tokenizer, messages)
    assert tokenizer.tokenizer.decode(ids.tolist(), skip_special_tokens=False) == (
        "<|im_start|>user\nIs it green?<|im_end|>\n"
        "<|im_start|>assistant\nyes<|im_end|>\n")
    answer = [*tokenizer.encode("yes"), 2]
    assert ids[mask].tolist() == answer
    assert np.flatnonzero(mask)[-1] == len(ids) - 2  # the final newline is not a target
    prompt = chat.generation_prompt(tokenizer, "Is it green?")
    assert ids[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any()


def test_a_vocabulary_smaller_than_the_bytes_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"vocab_size=200: a byte-level BPE needs at least 259"):
        bpe.train_bpe(TEXTS, str(tmp_path), vocab_size=200)
    assert not os.listdir(tmp_path)


def _bpe_config(corpus, **overrides):
    return kit.tiny_config("lm", corpus, **{"data.tokenizer": "bpe", "data.vocab_size": 300,
                                            **overrides})


def test_a_bpe_run_trains_its_vocabulary_in_the_workdir_and_starts_documents_with_it(
        tmp_path):
    corpus = tiny_lm_config.write_corpus(str(tmp_path / "corpus"))
    task = LMTask.from_config(_bpe_config(corpus))
    assert {k: task.lm.hf[k] for k in bpe.TOKEN_IDS} == bpe.TOKEN_IDS  # config.json's
    workdir = str(tmp_path / "run")
    tokenizer = task.tokenizer(workdir, documents=lambda: [TEXTS[0].split("\n")])
    assert sorted(os.listdir(workdir)) == ["tokenizer.json", "tokenizer_config.json"]
    assert tokenizer.bos_id == 0 and tokenizer.keeps_newlines
    encoded = lm_text.encode_documents(tokenizer, [TEXTS[0].split("\n")])[0]
    assert encoded[0] == 0 and tokenizer.decode(encoded[1:]) == TEXTS[0]
    # Trained once: a second call (a resumed run) reads the files.
    again = task.tokenizer(workdir, documents=lambda: pytest.fail("trained twice"))
    assert again.encode_batch([TEXTS[1]]) == tokenizer.encode_batch([TEXTS[1]])


@pytest.mark.slow  # fast counterpart: the test above and the template's test
def test_a_bpe_run_from_scratch_exports_its_tokenizer(tmp_path):
    """The run trains the vocabulary in its workdir, documents start with <|endoftext|>, and
    the export carries tokenizer.json, the template and config.json's token ids, so a
    fine-tuning run on chat rows can start from it."""
    corpus = tiny_lm_config.write_corpus(str(tmp_path / "corpus"))
    config = _bpe_config(corpus, train_steps=2, eval_every=2, checkpoint_every=2,
                         **{"data.wikitext": "", "sample.tokens": 0})
    workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
    train_lm(config, workdir)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(workdir))
    written = lm_export.export_run(workdir, out)
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json"} <= set(written["files"]) and "spm.model" not in \
        written["files"]
    saved = hf.read_config(out)
    assert {k: saved[k] for k in bpe.TOKEN_IDS} == bpe.TOKEN_IDS
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f) == bpe.TOKEN_IDS
    exported = hf.load_tokenizer(out)
    assert exported.chat_template == bpe.CHATML_TEMPLATE
    with open(os.path.join(workdir, "tokenizer.json")) as f, open(exported.path) as g:
        assert f.read() == g.read()
    # A fine-tuning run on chat rows accepts the export's tokenizer and template.
    finetune = _bpe_config(corpus, init_from=out, **{"data.tokenizer": "spm",
                                                     "data.format": "chat"})
    assert LMTask.from_config(finetune).lm.arch.vocab_size == 300


@pytest.mark.parametrize("override, message", [
    ({"data.tokenizer": "wordpiece"}, r"config.data.tokenizer='wordpiece'; choose one of"),
    ({"init_from": "x", "data.tokenizer": "bpe"},
     r"config.data.tokenizer='bpe': a run from a checkpoint .* leave it at 'spm'"),
])
def test_tokenizer_errors_are_one_line(override, message):
    config = kit.tiny_config("lm", "corpus", **override)
    with pytest.raises(ValueError, match=message):
        LMTask.from_config(config)
