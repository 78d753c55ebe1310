"""The language-modelling task: packing, the metrics, every guarantee of the loop (exact resume,
SIGTERM, one run per workdir, corrupt-checkpoint fallback), fine-tuning a converted checkpoint,
the export to a Hugging Face directory, one-line errors.

The from-scratch runs use ``tests/tiny_lm_config.py`` on a generated corpus (one row shape:
each step function compiles once and the module's runs share it); fine-tuning uses the tiny
Mixtral of ``tests/data/hf/mixtral`` with a word-level ``tokenizer.json`` made here.
"""

import dataclasses
import functools
import json
import math
import os
import pathlib
import shutil
import signal

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import hf, training
from sparsemixer_jax.data import lm_text, text
from sparsemixer_jax.tasks import language_model, lm_export, lm_sections, run_config
from sparsemixer_jax.tasks.language_model import LMTask, train_lm
from sparsemixer_jax.training.preemption import Stopped
from sparsemixer_jax.training.state import restore_checkpoint
from sparsemixer_jax.training.workdir_lock import WorkdirInUse, WorkdirLock
from tests import kit, tiny_lm_config
from tests.test_preemption import SignalOnFetch

# The tiny lm config with overrides (dotted paths): the kit's, for this module's corpus.
tiny = functools.partial(kit.tiny_config, "lm")


@nnx.jit
def logits_of(model, ids):
    return model(ids)


HF_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf")

# The resume test every training task runs, here with this module's ``task`` and ``task_steps``.
test_extending_a_run_equals_the_uninterrupted_run = (
    kit.test_extending_a_run_equals_the_uninterrupted_run)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return tiny_lm_config.write_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def task(corpus):
    """The LM task for the shared ``straight_run`` fixture and resume test (tests/kit)."""
    return kit.Task("lm", lambda workdir, **o: train_lm(tiny(corpus, **o), workdir))


@pytest.fixture(scope="module")
def task_steps(corpus, straight_run):
    """The steps of the tiny model: the template checkpoints are read into."""
    config = tiny(corpus)
    return training.build_steps(run_config(config), config.data.vocab_size)


# ------------------------------------------------------------------------------------ packing


def test_rows_over_cudnns_segment_limit_are_refused_before_a_run(corpus, tmp_path):
    """cuDNN's packed layout (model.cudnn_document_mask="offsets") holds max_segments_per_row
    segments a row: the packed data is checked against it, in one line naming the row."""
    config = tiny(corpus, **{"model.attention_impl": "cudnn", "model.compute_dtype": "bfloat16",
                             "model.cudnn_document_mask": "offsets",
                             "model.max_segments_per_row": 1})
    with pytest.raises(ValueError, match=r"^config\.data: the train split: row \d+ holds \d+ "
                                         r"segments .*max_segments_per_row=1 "):
        LMTask.from_config(config).load_data(str(tmp_path / "w"), 1)


def test_packing_predicts_every_document_token_once_within_its_document():
    docs = [np.arange(10, 10 + n, dtype=np.int32) for n in (1, 7, 3, 12)]
    encoded = [np.concatenate([[1], d]) for d in docs]
    tokens, segments = lm_text.pack_documents(encoded, seq_len=6)
    targets = lm_text.target_mask(segments)
    # Rows overlap by one token: row r starts where row r - 1 ended.
    np.testing.assert_array_equal(tokens[1:, 0], tokens[:-1, -1][: len(tokens) - 1])
    predicted = tokens[:, 1:][targets]
    np.testing.assert_array_equal(predicted, np.concatenate(docs))  # each once, in order
    # A target's previous token is of its own document.
    assert np.all(segments[:, :-1][targets] == segments[:, 1:][targets])
    nbytes = np.asarray([5, 70, 30, 120])
    per_row = lm_text.row_bytes(lm_text.text_targets(segments), segments, nbytes)
    assert per_row.sum() == pytest.approx(nbytes.sum())


def test_split_documents_holds_out_the_last_articles_and_caps_the_training_ones(corpus):
    documents = text.read_documents(os.path.join(corpus, "wiki.txt"))
    data = lm_text.LMDataConfig.from_config(tiny(corpus, **{"data.train_articles": 10}))
    train, valid = lm_text.split_documents(data, documents)
    assert valid == documents[-6:] and train == documents[:10]
    with pytest.raises(ValueError, match="valid_articles=60 leaves none to train on"):
        lm_text.split_documents(dataclasses.replace(data, valid_articles=60), documents)


def test_packed_documents_do_not_see_each_other(task_steps):
    """The task's loss on two documents packed in one row equals their losses each alone (the
    run's compiled evaluation step, on the fresh model)."""
    a, b = [1, 7, 8, 9, 10, 11], [1, 20, 21, 22, 23, 24, 25, 26, 27]

    def rows(*docs):
        tokens, segments = np.zeros((4, 16), np.int32), np.zeros((4, 16), np.int32)
        for r, doc in enumerate(docs):
            ids = [t for d in doc for t in d]
            tokens[r, :len(ids)] = ids
            segments[r, :len(ids)] = np.repeat(np.arange(1, len(doc) + 1), [len(d) for d in doc])
        return {"tokens": jnp.asarray(tokens), "segments": jnp.asarray(segments),
                "targets": jnp.asarray(lm_text.text_targets(segments)),
                "bytes": jnp.zeros((4,), jnp.float32)}

    state, key = task_steps.init_state(), jax.random.key(0)
    together = task_steps.evaluate(state, rows([a, b]), key)
    alone = task_steps.evaluate(state, rows([a], [b]), key)
    assert float(together["tokens"]) == float(alone["tokens"]) == len(a) + len(b) - 2
    np.testing.assert_allclose(together["nll"], alone["nll"], rtol=1e-6)
    # Without segment ids the second document would see the first: a different loss.
    mixed = rows([a + b])
    mixed["segments"] = jnp.where(mixed["segments"] > 0, 1, 0)
    mixed_nll = task_steps.evaluate(state, mixed, key)["nll"]
    assert abs(float(mixed_nll) - float(together["nll"])) > 1e-3


# ------------------------------------------------------------------------------- a whole run


def test_a_run_reports_perplexity_bits_per_byte_the_unigram_baseline_and_a_sample(
        corpus, straight_run):
    workdir, results = straight_run
    assert results["steps"] == 6
    steps = [r for r in kit.read_metrics(workdir) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:
        assert r["ppl"] == pytest.approx(math.exp(r["loss"]), rel=1e-5)
        assert np.isfinite(r["balance_loss"]) and r["balance_loss"] > 0
    # Every log_every (2) steps, each MoE layer's loads and router diagnostics, as translation
    # logs them: the study summary reads the load imbalance from them.
    logged = [r for r in steps if "moe" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    for r in logged:
        assert sorted(r["moe"]) == ["layer_0", "layer_1"]
        for layer in r["moe"].values():
            assert sum(layer["expert_fraction"]) == pytest.approx(1.0, rel=1e-5)
            assert layer["load_max"] == pytest.approx(max(layer["expert_fraction"]), rel=1e-5)
    # The held-out bytes are the last 6 articles' text, counted independently here.
    held_out = text.read_documents(os.path.join(corpus, "wiki.txt"))[-6:]
    assert results["valid_bytes"] == pytest.approx(
        sum(len("\n".join(doc).encode()) for doc in held_out), rel=1e-6)
    assert results["valid_ppl"] == pytest.approx(math.exp(results["valid_loss"]))
    assert results["valid_bits_per_byte"] == pytest.approx(
        results["valid_loss"] * results["valid_tokens"] / (math.log(2) * results["valid_bytes"]))
    # The unigram baseline, recomputed from the packed training rows.
    tokenizer = lm_text.SentencePieceLM(text.Tokenizer(os.path.join(workdir, "spm.model")))
    train_docs = text.read_documents(os.path.join(corpus, "wiki.txt"))[:-6]
    ids = np.concatenate([e[1:] for e in lm_text.encode_documents(tokenizer, train_docs)])
    counts = np.bincount(ids, minlength=120) + 1.0
    valid_ids = np.concatenate([e[1:] for e in lm_text.encode_documents(tokenizer, held_out)])
    expected = math.exp(-np.mean(np.log(counts / counts.sum())[valid_ids]))
    assert results["unigram_ppl"] == pytest.approx(expected, rel=1e-9)
    for key in ("wikitext_test_ppl", "wikitext_test_bits_per_byte", "wikitext_test_unigram_ppl"):
        assert np.isfinite(results[key]) and results[key] > 0, key
    with open(os.path.join(workdir, "sample.txt")) as f:
        assert f.read().startswith("The river")
    assert results["samples"][0].startswith("The river")


def test_sigterm_checkpoints_the_step_and_the_rerun_ends_like_the_straight_run(
        corpus, straight_run, tmp_path, task_steps, last_checkpoint, monkeypatch):
    load_data = LMTask.load_data

    def signalled(self, workdir, batch_multiple):  # SIGTERM at step 4's first batch
        data = load_data(self, workdir, batch_multiple)
        return dataclasses.replace(data, train=SignalOnFetch(data.train, 4, signal.SIGTERM))

    # Patched on the class: the task stays equal to the straight run's, so is its compiled step.
    config, workdir = tiny(corpus), str(tmp_path / "stopped")
    monkeypatch.setattr(LMTask, "load_data", signalled)
    with pytest.raises(Stopped) as stop:
        train_lm(config, workdir)
    monkeypatch.undo()
    assert stop.value.step == 4
    assert last_checkpoint(workdir, task_steps)[1]["step"] == 4
    resumed = train_lm(config, workdir)
    assert resumed["valid_loss"] == straight_run[1]["valid_loss"]
    params, _ = last_checkpoint(workdir, task_steps)
    expected, _ = last_checkpoint(straight_run[0], task_steps)
    jax.tree.map(np.testing.assert_array_equal, params, expected)


def test_corrupt_newest_checkpoints_fall_back_and_end_like_the_straight_run(
        corpus, straight_run, tmp_path, task_steps, last_checkpoint):
    copy = str(tmp_path / "copy")
    shutil.copytree(straight_run[0], copy)
    for kind in ("last", "best"):
        os.remove(os.path.join(copy, "checkpoints", kind, "6", "state", "_METADATA"))
    results = train_lm(tiny(corpus), copy)
    assert results["valid_loss"] == straight_run[1]["valid_loss"]
    assert sorted(os.listdir(os.path.join(copy, "checkpoints", "unreadable"))) == [
        "best-6", "last-6"]
    params, _ = last_checkpoint(copy, task_steps)
    expected, _ = last_checkpoint(straight_run[0], task_steps)
    jax.tree.map(np.testing.assert_array_equal, params, expected)


def test_one_run_per_workdir(corpus, tmp_path):
    workdir = str(tmp_path / "held")
    os.makedirs(workdir)
    lock = WorkdirLock(workdir)
    try:
        with pytest.raises(WorkdirInUse):
            train_lm(tiny(corpus), workdir)
    finally:
        lock.release()
    assert not os.path.exists(os.path.join(workdir, "config.json"))


def test_export_then_load_pretrained_gives_the_trained_models_logits(
        corpus, straight_run, tmp_path, task_steps, last_checkpoint):
    """The SparseMixer run's export loads, with no arguments, as the trained model; the
    routing transformers computes (mixtral's top-2 softmax) is stated with its measured logit
    difference; --routing=type writes the type's routing; a non-empty --out needs --force."""
    out = str(tmp_path / "hf")
    written = lm_export.export_run(straight_run[0], out)
    assert written["step"] == 6 and {"config.json", "model.safetensors",
                                     "spm.model"} <= set(written["files"])
    saved = hf.read_config(out)
    params, _ = last_checkpoint(straight_run[0], task_steps)
    trained = task_steps.model(training.TrainState(0, params, {}, None))
    trained.eval()
    assert saved["model_type"] == "mixtral"
    assert saved[hf.ROUTING_KEY]["router"] == trained.config.router == "sparsemixer_v2star"
    assert hf.from_hf(saved).replace(hf_config="") == trained.config.replace(hf_config="")
    exported, _ = hf.load_pretrained(out)
    ids = jnp.asarray([[1, 9, 30, 31, 60, 7, 8, 99]])
    # Float32 tensors as trained; omega folded into w_down changes the last bits only.
    np.testing.assert_allclose(logits_of(exported, ids), logits_of(trained, ids), rtol=1e-5,
                               atol=1e-6)
    note = written["routing_note"]
    assert note.startswith("transformers computes mixtral's own routing, switch (top-2, "
                           "norm_topk_prob), not the trained sparsemixer_v2star (top-2, "
                           "jitter_eps=")
    gap = float(note.split("by up to ")[1].split(" ")[0])
    # SparseMixer's gates differ from the renormalised top-2's (float32 rounding alone: ~1e-6).
    assert gap > 1e-4 and "\n" not in note
    # Written as the type routes: our loader computes then what transformers does.
    with pytest.raises(ValueError, match=r"hf is not empty \(\d+ entries\); --force"):
        lm_export.export_run(straight_run[0], out, routing="type")
    again = lm_export.export_run(straight_run[0], out, routing="type", force=True)
    assert again["routing_note"].startswith("--routing=type: the export routes as mixtral does")
    assert f"by up to {gap:.3g} " in again["routing_note"]  # the same two forwards
    as_type = hf.from_hf(hf.read_config(out))  # what the note measured against
    assert (as_type.router, as_type.jitter_eps) == ("switch", 0.0)


# ------------------------------------------------------------------------------- fine-tuning


def _word_tokenizer(corpus: str, vocab_limit: int):
    """A lower-cased word-level ``tokenizers.Tokenizer`` of the corpus' words (ids below
    ``vocab_limit``)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    documents = text.read_documents(os.path.join(corpus, "wiki.txt"))
    words = sorted({w for doc in documents for p in doc
                    for w in p.lower().replace(".", " .").split()})
    vocab = {"<s>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    assert len(vocab) <= vocab_limit
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory):
    """``tests/data/hf/mixtral`` with a word-level ``tokenizer.json``."""
    path = str(tmp_path_factory.mktemp("ckpt") / "mixtral")
    shutil.copytree(os.path.join(HF_DATA, "mixtral"), path)
    _word_tokenizer(corpus, 97).save(os.path.join(path, "tokenizer.json"))
    return path


def _finetune_config(corpus, checkpoint, **overrides):
    return tiny(corpus, init_from=checkpoint, train_steps=2, eval_every=2, checkpoint_every=2,
                **{"data.wikitext": "", "sample.tokens": 0, **overrides})


def test_fine_tuning_starts_from_the_checkpoint_with_its_tokenizer(corpus, checkpoint, tmp_path):
    """The fast counterpart of the fine-tuning run below: the model and data a fine-tuning run
    starts from (nothing compiled)."""
    config = _finetune_config(corpus, checkpoint)
    task = LMTask.from_config(config)
    assert task.lm.arch.model_type == "mixtral" and task.lm.router == "switch"  # the checkpoint's
    original, _ = hf.load_pretrained(checkpoint)
    start = task.build_model(run_config(config, task), task.lm.arch.vocab_size, None)
    assert start.deterministic is False  # training mode
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(start, nnx.Param)),
                 nnx.to_pure_dict(nnx.state(original, nnx.Param)))
    data = task.load_data(str(tmp_path / "w"), 1)
    tokenizer = data.extra["tokenizer"]
    assert isinstance(tokenizer, lm_text.HFTokenizerLM) and tokenizer.bos_id == 0
    assert not os.path.exists(tmp_path / "w" / "spm.model")
    # The held-out rows hold the last documents' words, each document after a bos (id 0).
    valid = data.extra["valid_split"]
    first = valid.tokens[0][valid.segments[0] == 1]
    held_out = text.read_documents(os.path.join(corpus, "wiki.txt"))[-6]
    assert first[0] == 0 and tokenizer.decode(first[1:]) == \
        " ".join(held_out).lower().replace(".", " .")[: len(tokenizer.decode(first[1:]))]
    # The router section replaces the checkpoint's routing when asked to.
    rerouted = LMTask.from_config(_finetune_config(corpus, checkpoint, init_router="config"))
    assert (rerouted.lm.router, rerouted.lm.top_k) == ("sparsemixer_v2star", 2)


def test_the_router_section_is_checked_and_honoured_as_far_as_the_run_routes_by_it(
        corpus, checkpoint, tmp_path):
    """Keeping the checkpoint's routing, only the section's auxiliary losses are used and
    checked; a routing field given on the command line is refused in one line naming
    init_router, before anything is written. Routing by the section checks all of it."""
    # A field that is wrong for the section's own router, which this run does not use.
    unused = {"router.default_decay": 1.5, "router.score": "sigmoid"}
    task = LMTask.from_config(_finetune_config(corpus, checkpoint, **unused))
    assert (task.lm.router, task.lm.router_options) == ("switch", ())  # the checkpoint's
    with pytest.raises(ValueError, match=r"config\.router\.default_decay must lie in"):
        LMTask.from_config(_finetune_config(corpus, checkpoint, init_router="config", **unused))
    with pytest.raises(ValueError, match=r"config\.router\.balance_normalization='x'; choose"):
        LMTask.from_config(_finetune_config(corpus, checkpoint,
                                            **{"router.balance_normalization": "x"}))
    workdir = str(tmp_path / "w")
    with pytest.raises(ValueError) as error:
        train_lm(_finetune_config(corpus, checkpoint, **unused), workdir,
                 given=("init_from", "router.score", "router.name", "router.balance_weight"))
    message = str(error.value)
    assert message.startswith("--config.router.name, --config.router.score: config.init_router="
                              "'checkpoint' routes as the checkpoint does") and "\n" not in message
    assert not os.path.exists(workdir)
    # The fields honoured whatever routes, and any field where the section routes, pass.
    lm_sections.refuse_unused_router_fields(checkpoint, "checkpoint",
                                            ("router.balance_weight", "router.trainable"))
    lm_sections.refuse_unused_router_fields(checkpoint, "config", ("router.score",))
    lm_sections.refuse_unused_router_fields("", "checkpoint", ("router.score",))


def test_an_export_needs_the_fine_tuning_runs_workdir_alone(corpus, checkpoint, tmp_path):
    """A fine-tuning run keeps its checkpoint's config and tokenizer files when it starts (here:
    a workdir with its step-0 state saved as a checkpoint, nothing compiled for training); the
    export reads them once the checkpoint is gone, makes the tokenizer files it lacked."""
    from safetensors.numpy import load_file

    from sparsemixer_jax.training.checkpoint import RunCheckpoints

    start = str(tmp_path / "start")
    shutil.copytree(checkpoint, start)
    with open(os.path.join(start, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "unk_token": "<unk>", "model_max_length": 16}, f)
    config = _finetune_config(corpus, start)
    task = LMTask.from_config(config)
    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json())
    task.load_data(workdir, 1)
    assert sorted(os.listdir(os.path.join(workdir, language_model.KEPT_DIR))) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    steps = training.build_steps(run_config(config, task), task.lm.arch.vocab_size)
    checkpoints = RunCheckpoints(workdir)
    checkpoints.save_last(0, steps.init_state(), {"step": 0})
    checkpoints.close()
    original = load_file(os.path.join(start, "model.safetensors"))
    shutil.rmtree(start)
    out = str(tmp_path / "hf")
    written = lm_export.export_run(workdir, out)
    assert written["step"] == 0 and written["routing_note"] is None  # the checkpoint's routing
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json"} <= set(written["files"])
    with open(os.path.join(out, "special_tokens_map.json")) as f:
        assert json.load(f) == {"bos_token": "<s>", "unk_token": "<unk>"}  # made
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)["model_max_length"] == 16  # the checkpoint's own
    assert hf.load_tokenizer(out).token_id("bos_token") == 0
    exported = load_file(os.path.join(out, "model.safetensors"))  # the step-0 state: the start
    assert exported.keys() == original.keys()
    for name, value in original.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)


@pytest.mark.slow  # fast counterpart: the two tests above (the start and the export)
def test_fine_tuning_a_converted_checkpoint_then_exporting_it(corpus, checkpoint, tmp_path):
    config = _finetune_config(corpus, checkpoint)
    task = LMTask.from_config(config)
    original, _ = hf.load_pretrained(checkpoint)
    workdir = str(tmp_path / "finetune")
    results = train_lm(config, workdir)
    assert results["steps"] == 2 and np.isfinite(results["valid_bits_per_byte"])
    assert 1 < results["unigram_ppl"] < 97  # the word-level tokenizer's unigram model
    out = str(tmp_path / "hf")
    written = lm_export.export_run(workdir, out)
    assert "tokenizer.json" in written["files"]
    exported, _ = hf.load_pretrained(out)
    steps = training.build_steps(run_config(config, task), task.lm.arch.vocab_size)
    trained = steps.model(restore_checkpoint(workdir, steps.abstract_state(), "last").state)
    trained.eval()
    ids = jnp.asarray([[0, 5, 6, 7, 8, 9]])
    np.testing.assert_allclose(logits_of(exported, ids), logits_of(trained, ids), rtol=1e-5,
                               atol=1e-6)
    assert not np.allclose(logits_of(exported, ids), logits_of(original, ids))  # trained


# ------------------------------------------------------------------------------------ errors


def _broken(checkpoint, tmp_path, name, change):
    path = str(tmp_path / name)
    shutil.copytree(checkpoint, path)
    change(path)
    return path


def _edit_config(path, **changes):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def _missing_shard(path):
    os.rename(os.path.join(path, "model.safetensors"), os.path.join(path, "part-1.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}, f)


def _changed_tensor(name, value):
    """Replaces tensor ``name`` of the checkpoint by ``value`` (None: removes it)."""
    def change(path):
        from safetensors.numpy import load_file, save_file

        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        tensors[name] = value
        if value is None:
            del tensors[name]
        save_file(tensors, file, metadata={"format": "pt"})
    return change


def _truncated(path):
    file = os.path.join(path, "model.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)


def _garbled(path):
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        f.seek(12)
        f.write(b"not json at all")


def _without_hidden_size(path):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    del cfg["hidden_size"]
    with open(file, "w") as f:
        json.dump(cfg, f)


def test_bad_checkpoints_are_one_line_errors_before_anything_is_written(
        corpus, checkpoint, tmp_path):
    weights = os.path.join("{path}", "model.safetensors")
    cases = [
        (str(tmp_path / "nowhere"), "is not a Hugging Face model directory"),
        (_broken(checkpoint, tmp_path, "llama", lambda p: _edit_config(p, model_type="llama")),
         "model_type 'llama' is not supported; supported: mixtral, qwen3_moe, olmoe"),
        (_broken(checkpoint, tmp_path, "shard", _missing_shard),
         "shard 'part-2.safetensors' named in model.safetensors.index.json is missing"),
        (_broken(checkpoint, tmp_path, "notok",
                 lambda p: os.remove(os.path.join(p, "tokenizer.json"))), "no tokenizer.json"),
        (_broken(checkpoint, tmp_path, "badtok", lambda p: os.truncate(
            os.path.join(p, "tokenizer.json"), 10)), "tokenizer.json: not a tokenizers file ("),
        (_broken(checkpoint, tmp_path, "nosize", _without_hidden_size),
         "config.json (mixtral): required key 'hidden_size' is missing"),
        (_broken(checkpoint, tmp_path, "cut", _truncated), "the file is truncated"),
        (_broken(checkpoint, tmp_path, "garbled", _garbled),
         f"{weights}: not a safetensors file (its header does not parse)"),
        (_broken(checkpoint, tmp_path, "shape",
                 _changed_tensor("model.norm.weight", np.ones((5,), np.float32))),
         f"{weights}: tensor 'model.norm.weight' has shape [5], expected [16]"),
        (_broken(checkpoint, tmp_path, "dtype",
                 _changed_tensor("model.norm.weight", np.ones((16,), np.int64))),
         f"{weights}: tensor 'model.norm.weight' is int64; model weights are floating point"),
        (_broken(checkpoint, tmp_path, "lacking", _changed_tensor(
            "model.layers.1.block_sparse_moe.experts.0.w2.weight", None)),
         "tensor 'model.layers.1.block_sparse_moe.experts.0.w2.weight' is missing"),
    ]
    _assert_refused_before_writing(corpus, tmp_path, cases)


def _assert_refused_before_writing(corpus, tmp_path, cases, *, names_path: bool = False):
    """Each ``(checkpoint, message)`` of ``cases``: training from it raises one line holding
    ``message`` (``{path}`` filled in; the checkpoint's path too where ``names_path``) and
    the workdir is never made."""
    for path, message in cases:
        workdir = str(tmp_path / "w")
        with pytest.raises(ValueError) as error:
            train_lm(tiny(corpus, init_from=path), workdir)
        assert message.format(path=path) in str(error.value), str(error.value)
        assert "\n" not in str(error.value)
        assert not names_path or path in str(error.value)
        assert not os.path.exists(workdir)


def _family(checkpoint, tmp_path, model_type, name, change):
    """``tests/data/hf/<model_type>`` with ``checkpoint``'s tokenizer, changed by ``change``."""
    path = str(tmp_path / name)
    shutil.copytree(os.path.join(HF_DATA, model_type), path)
    shutil.copy(os.path.join(checkpoint, "tokenizer.json"), path)
    change(path)
    return path


def test_router_flags_given_with_init_router_config_route_the_run_and_its_export(
        corpus, checkpoint, tmp_path):
    """glm4_moe routes by sigmoid scores summed over groups' top two; with
    ``init_router="config"`` the section's ``score=softmax`` and ``group_score=max`` (the
    first the schema's default) reach the model, stay in the run's ``config.json`` and, read
    back from it as an export reads it, are the routing the export records."""
    from sparsemixer_jax.training.config import as_json

    path = _family(checkpoint, tmp_path, "glm4_moe", "glm", lambda path: None)
    assert hf.from_hf(hf.read_config(path)).router_option_dict()["score"] == "sigmoid"
    config = _finetune_config(corpus, path, init_router="config", **{
        "router.name": "switch", "router.jitter_eps": 0.0, "router.score": "softmax",
        "router.group_score": "max"})
    trained = LMTask.from_config(config).lm
    assert {k: trained.router_option_dict()[k] for k in ("score", "group_score")} == \
        {"score": "softmax", "group_score": "max"}
    saved = ml_collections.ConfigDict(json.loads(as_json(config)))  # the run's config.json
    assert (saved.router.score, saved.router.group_score) == ("softmax", "max")
    exported = hf.to_hf(LMTask.from_config(saved).lm)[hf.ROUTING_KEY]
    assert {k: exported["options"].get(k) for k in ("score", "group_score")} == \
        {"score": "softmax", "group_score": "max"}
    # From scratch the type's own routing stays the base of a section at its defaults, and a
    # default given on the command line that it overrules is refused in one line.
    scratch = tiny(corpus, **{"model.hf_type": "glm4_moe", "router.name": "switch",
                              "router.jitter_eps": 0.0, "router.score": "softmax"})
    glm = LMTask.from_config(scratch)
    assert glm.lm.router_option_dict()["score"] == "sigmoid"
    lm_sections.refuse_overruled_router_fields(glm.lm, glm.router, ("router.name",))
    workdir = str(tmp_path / "w")
    with pytest.raises(ValueError, match=r"^--config\.router\.score='softmax' \(the model "
                                         r"routes by 'sigmoid'\): a glm4_moe model from scratch"):
        train_lm(scratch, workdir, given=("router.score", "router.name"))
    assert not os.path.exists(workdir)


def test_bad_quantized_checkpoints_are_one_line_errors_before_anything_is_written(
        corpus, checkpoint, tmp_path):
    """gpt-oss's MXFP4 and DeepSeek-V3's block-FP8 checkpoints as the Hub ships them: an
    unsupported quantization method, a missing or misshaped scale tensor and an unknown
    ``layer_types`` entry are each one line naming the checkpoint's file and the tensor (or
    key), found from ``config.json`` and the safetensors headers before the workdir is made."""
    from tests.test_hf_deepseek import SCALE, _rewrite

    mx_scales = "model.layers.1.mlp.experts.down_proj_scales"
    weights = os.path.join("{path}", "model.safetensors")
    cases = [
        (_family(checkpoint, tmp_path, "gpt_oss_mxfp4", "awq", lambda p: _edit_config(
            p, quantization_config={"quant_method": "awq"})),
         "config.json (gpt_oss): quantization_config.quant_method='awq' is not supported for "
         "this type (supported: mxfp4)"),
        (_family(checkpoint, tmp_path, "gpt_oss_mxfp4", "noscales",
                 _changed_tensor(mx_scales, None)),
         f"{weights}: tensor 'model.layers.1.mlp.experts.down_proj_blocks' has no "
         f"'{mx_scales}' in the checkpoint"),
        (_family(checkpoint, tmp_path, "deepseek_v3_fp8", "fp8shape", lambda p: _rewrite(
            pathlib.Path(p), replace={SCALE: np.ones((1, 2), np.float32)})),
         f"{weights}: tensor '{SCALE}' is float32 [1, 2], expected float [2, 2]"),
        (_family(checkpoint, tmp_path, "deepseek_v3_fp8", "fp8none", lambda p: _rewrite(
            pathlib.Path(p), drop=(SCALE,))),
         f"{weights}: tensor '{SCALE.removesuffix('_scale_inv')}' is float8 but the checkpoint "
         f"has no '{SCALE}'"),
        (_family(checkpoint, tmp_path, "gpt_oss", "layers", lambda p: _edit_config(
            p, layer_types=["sliding_attention", "chunked_attention", "full_attention",
                            "full_attention"])),
         "config.json (gpt_oss): layer_types[1]='chunked_attention' is not implemented"),
    ]
    _assert_refused_before_writing(corpus, tmp_path, cases, names_path=True)


@pytest.mark.parametrize("override, message", [
    ({"model.hf_type": "llama"}, "config.model.hf_type='llama' is not supported; supported:"),
    ({"model.hf_type": "deepseek_v3"}, "config.model.hf_type='deepseek_v3': its latent "),
    ({"model.dropout": 0.1}, "config.model.dropout=0.1: the language model has no dropout"),
    ({"model.moe_every": 2}, "config.model.moe_every=2: mixtral routes every layer"),
    ({"router.name": "switch"}, "config.router.normalize_top_k=False: mixtral renormalises"),
    ({"data.seq_len": 2}, "config.data.seq_len must be >= 4"),
    ({"init_router": "mine"}, "config.init_router='mine'; choose one of"),
    ({"model.num_shared_experts": 1}, "the language model's shared expert is its type's own"),
])
def test_config_errors_are_one_line(corpus, override, message):
    with pytest.raises(ValueError) as error:
        LMTask.from_config(tiny(corpus, **override))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_routing_options_reach_every_moe_layer_of_the_model(corpus):
    """Scores, bias balancing, the balance scope and groups go from the router section to the
    model's MoE layers (scanned: one bias per layer), with the Mixtral type's renormalised
    gates implied by sigmoid scores."""
    config = tiny(corpus, **{"router.name": "switch", "router.jitter_eps": 0.0,
                             "router.score": "sigmoid", "router.bias_update_rate": 1e-3,
                             "router.balance_scope": "global_batch", "router.num_groups": 2})
    lm = LMTask.from_config(config).lm
    options = lm.router_option_dict()
    assert options == {"score": "sigmoid", "bias_update_rate": 1e-3,
                       "balance_scope": "global_batch", "num_groups": 2}
    model = nnx.eval_shape(lambda: language_model.CausalLM(lm, rngs=nnx.Rngs(0)))
    biases = [v for path, v in nnx.iter_graph(model)
              if path and path[-1] == "expert_bias" and isinstance(v, nnx.Variable)]
    assert [b.shape for b in biases] == [(lm.arch.num_layers, lm.num_experts)]


def test_a_micro_batch_that_does_not_split_over_the_mesh_is_one_line(corpus, tmp_path):
    config = tiny(corpus, **{"mesh.data": 8, "data.batch_size": 4})
    with pytest.raises(ValueError) as error:
        train_lm(config, str(tmp_path / "run"))
    assert "micro-batch of 4 rows does not split over the mesh's 8 devices" in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_run_on_a_data_fsdp_expert_mesh_equals_one_device(corpus, tmp_path, last_checkpoint):
    """The whole task on a 2 x 2 x 2 mesh (batches split over all 8 devices, parameters over
    fsdp, experts over expert; evaluation batches padded to the mesh, samples decoded as a batch
    of 8 copies), under XLA's other elementwise math (a child process), ends where the one-device
    run does, both with Adam in its linear regime, to the float32 rounding
    :func:`tests.kit.assert_same_training` derives: 128 tokens an update, fewer than 2 layers x
    the vocab (120)."""
    reference, workdir = str(tmp_path / "one"), str(tmp_path / "mesh")
    results = train_lm(tiny(corpus, **kit.LINEAR_ADAM), reference)
    mesh = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.expert": 2, "data.eval_batch_size": 4}
    kit.train_with_other_math("experiments.lm", f"tests/tiny_lm_config.py:{corpus}", workdir,
                              {**kit.LINEAR_ADAM, **mesh})
    config = tiny(corpus)
    steps = training.build_steps(run_config(config), config.data.vocab_size)
    kit.assert_same_training(workdir, reference, 240, lambda w: last_checkpoint(w, steps))
    with open(os.path.join(workdir, "results.json")) as f:
        mesh_results = json.load(f)
    assert mesh_results["wikitext_test_loss"] == pytest.approx(
        results["wikitext_test_loss"], rel=kit.sum_rtol(240))


def test_the_command_reports_a_bad_checkpoint_on_one_line(corpus, tmp_path, capsys):
    from absl import flags

    from sparsemixer_jax.training import cli

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    with pytest.raises(SystemExit) as exit_:
        cli.train_or_exit(train_lm, tiny(corpus, init_from=str(tmp_path)), str(tmp_path / "w"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a Hugging Face model directory" in err


def test_export_refuses_a_workdir_that_is_not_a_language_modelling_run(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is .* a run of experiments\.lm\?"):
        lm_export.export_run(str(tmp_path), str(tmp_path / "out"))
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"task": "translation"}, f)
    with pytest.raises(ValueError, match="holds a translation run, not a language-modelling"):
        lm_export.export_run(str(tmp_path), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_export_refuses_an_out_it_cannot_write_before_reading_the_run(tmp_path):
    """A file, a non-empty directory and a file above a missing directory are each refused in
    one line naming the path, before the run is read (this workdir is not even a run) and
    with nothing written; missing directories are created as ``mkdir -p`` would."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    refused = {str(tmp_path / "file"): "file exists and is not a directory: an export writes",
               str(tmp_path / "full"): r"full is not empty \(1 entries\); --force",
               str(tmp_path / "file" / "hf"): "cannot create .*file/hf: .*file is not a dir"}
    for out, message in refused.items():
        with pytest.raises(ValueError, match=message) as err:
            lm_export.export_run(str(tmp_path / "no_run"), out)
        assert "\n" not in str(err.value)
    assert (tmp_path / "file").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["file", "full"]
    lm_export.check_out_dir(str(tmp_path / "full"), force=True)
    lm_export.check_out_dir(str(tmp_path / "new" / "deeper" / "hf"))  # created when written
    with pytest.raises(FileNotFoundError, match=r"no_run/config\.json not found"):
        lm_export.export_run(str(tmp_path / "no_run"), str(tmp_path / "new" / "hf"))


def test_an_export_refuses_a_routing_its_checkpoint_cannot_hold():
    """A learned selection bias is written as e_score_correction_bias (glm4_moe) or refused in
    one line (mixtral) unless the type's routing is written; so are Default MoE's vectors."""
    mixtral = hf.from_hf(hf.read_config(os.path.join(HF_DATA, "mixtral")))
    glm = hf.from_hf(hf.read_config(os.path.join(HF_DATA, "glm4_moe")))
    own = hf.from_hf(hf.without_routing_record(hf.to_hf(mixtral)))
    biased = mixtral.replace(router_options=(("bias_update_rate", 0.01),))
    with pytest.raises(ValueError, match=r"learned a selection bias \(router\.bias_update_rate="
                                         r"0\.01\) and mixtral checkpoints have no place for one "
                                         r"\(types with e_score_correction_bias: glm4_moe"):
        lm_export._written_config(biased, own, "trained")
    assert lm_export._written_config(biased, own, "type") == mixtral
    glm_biased = glm.replace(router_options=(*glm.router_options, ("bias_update_rate", 0.01)))
    assert lm_export._written_config(glm_biased, glm, "trained") == glm_biased
    defaults = mixtral.replace(router="default_moe_forward")
    with pytest.raises(ValueError, match="default_moe_forward adds its experts' default vectors"):
        lm_export._written_config(defaults, own, "trained")
    # A type's config spells out the option defaults a router section leaves out: the same.
    spelled = glm.replace(router_options=(("group_score", "top2_sum"), ("num_groups", 1),
                                          ("routed_scaling_factor", 1.0), ("score", "sigmoid"),
                                          ("top_groups", 1)))
    section = glm.replace(router_options=(("group_score", "top2_sum"), ("score", "sigmoid")))
    assert lm_export._routing_in_effect(spelled) == lm_export._routing_in_effect(section)
    assert lm_export._routing_in_effect(glm) != lm_export._routing_in_effect(section)  # 4 groups
