"""End-to-end tests of ELECTRA pretraining: metrics, exact resume (extended and interrupted),
config and data errors, loading the discriminator, the README command. The loop itself (SIGKILL,
the non-finite stop) is tested once with a fake task in ``test_loop.py``.

All runs use ``tests/tiny_electra_config.py`` on a generated corpus (one sequence shape, so each
step function compiles once and the in-process runs share the compilations). The straight run and
its corpus are the test run's one pretraining of that config (tests/conftest.py's
``electra_run``, which ``test_glue.py`` fine-tunes too).
"""

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import training
from sparsemixer_jax.data import text
from sparsemixer_jax.models.encoder import Encoder
from sparsemixer_jax.tasks import pretraining, run_config
from sparsemixer_jax.training.optim import OptimSettings, learning_rate_schedule, weight_decay_mask
from tests import kit, tiny_electra_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The resume test every training task runs, here with this module's ``task`` and ``task_steps``.
test_extending_a_run_equals_the_uninterrupted_run = (
    kit.test_extending_a_run_equals_the_uninterrupted_run)

# The tiny pretraining config with overrides (dotted paths): the kit's, for this module's corpus.
tiny = functools.partial(kit.tiny_config, "pretraining")


@pytest.fixture(scope="module")
def corpus(electra_run):
    """The generated corpus of the shared pretraining run (tests/conftest.py's ``electra_run``)."""
    return electra_run.corpus


@pytest.fixture(scope="module")
def straight_run(electra_run):
    """The uninterrupted run with the module's tiny config: the test run's one pretraining of it
    (``electra_run``, which ``test_glue.py`` fine-tunes too), in place of the module's own."""
    return electra_run.workdir, electra_run.results


@pytest.fixture(scope="module")
def task(corpus):
    """ELECTRA pretraining for the shared ``straight_run`` fixture and resume test (tests/kit)."""
    return kit.Task("pretraining", lambda workdir, **o: pretraining.pretrain(tiny(corpus, **o),
                                                                             workdir))


@pytest.fixture(scope="module")
def task_steps(corpus, straight_run):
    """The steps of the tiny model (the straight run's vocabulary): the template checkpoints are
    read into."""
    vocab = text.Tokenizer(os.path.join(straight_run[0], "spm.model")).vocab_size
    return training.build_steps(run_config(tiny(corpus)), vocab)


def test_straight_run_logs_the_electra_metrics(straight_run):
    workdir, results = straight_run
    assert results["steps"] == 6
    with open(os.path.join(workdir, "results.json")) as f:
        assert json.load(f)["valid_loss"] == results["valid_loss"]
    records = kit.read_metrics(workdir)
    steps = [r for r in records if "loss" in r and "error" not in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for key in ("mlm_loss", "mlm_accuracy", "disc_loss", "disc_accuracy", "replaced_fraction",
                "balance_loss", "lr", "grad_norm"):
        assert all(np.isfinite(r[key]) for r in steps), key
    # The objective is the generator's loss plus 50 times the discriminator's (+ balance).
    for r in steps:
        assert r["loss"] == pytest.approx(r["mlm_loss"] + 50 * r["disc_loss"]
                                          + 0.01 * r["balance_loss"], rel=2e-3)
    assert steps[-1]["loss"] < steps[0]["loss"]
    moe = [r["moe"] for r in steps if "moe" in r]
    assert moe and set(moe[0]) == {"discriminator"}  # the generator is dense here
    assert len(moe[0]["discriminator"]["layer_0"]["expert_fraction"]) == 2
    valid = [r for r in records if "valid_loss" in r]
    assert [r["step"] for r in valid] == [3, 6]
    for key in ("valid_mlm_loss", "valid_mlm_accuracy", "valid_disc_loss", "valid_disc_accuracy"):
        assert 0 <= valid[-1][key] < 10
    assert results["num_params_discriminator"] < results["num_params"]


class Interrupted(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_uninterrupted_result(
    corpus, straight_run, tmp_path, monkeypatch, task_steps, last_checkpoint):
    """A run that dies in step 5 (after the checkpoint of step 4, the best of step 3, and log
    lines of step 4) and is started again ends where the straight run does."""
    workdir = str(tmp_path / "interrupted")
    config = tiny(corpus, checkpoint_every=2)
    calls = {"n": 0}
    original_next = text.PretrainBatches.__next__

    def dying_next(self):
        calls["n"] += 1
        if calls["n"] == 9:  # two micro-batches per step: the first one of step 5
            raise Interrupted
        return original_next(self)

    monkeypatch.setattr(text.PretrainBatches, "__next__", dying_next)
    with pytest.raises(Interrupted):
        pretraining.pretrain(config, workdir)
    monkeypatch.undo()
    _, meta = last_checkpoint(workdir, task_steps)
    assert meta["step"] == 4
    pretraining.pretrain(config, workdir)
    params, meta = last_checkpoint(workdir, task_steps)
    expected, _ = last_checkpoint(straight_run[0], task_steps)
    assert meta["step"] == 6
    jax.tree.map(np.testing.assert_array_equal, params, expected)
    assert [r["step"] for r in kit.read_metrics(workdir) if "loss" in r] == list(range(1, 7))


@pytest.mark.slow  # fast counterpart: the GLUE tests load the pretrained encoder the same way
def test_load_discriminator_returns_the_trained_encoder(straight_run, task_steps,
                                                       last_checkpoint):
    workdir, _ = straight_run
    encoder, tokenizer, config = pretraining.load_discriminator(workdir, "last")
    assert isinstance(encoder, Encoder)
    assert tokenizer.vocab_size == config.data.vocab_size == encoder.vocab_size
    params, _ = last_checkpoint(workdir, task_steps)
    loaded = nnx.to_pure_dict(nnx.state(encoder, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, loaded, params["discriminator"])
    ids = [text.CLS_ID, *tokenizer.encode("the king walked"), text.SEP_ID]
    hidden, aux = encoder(np.array([ids], np.int32))
    assert hidden.shape == (1, len(ids), config.model.emb_dim)
    assert "layer_0" in aux["moe"]
    best, _, _ = pretraining.load_discriminator(workdir)  # the best checkpoint by validation loss
    assert isinstance(best, Encoder)
    with pytest.raises(ValueError, match="'best' or 'last'"):
        pretraining.load_discriminator(workdir, "first")
    with pytest.raises(FileNotFoundError, match="pretraining workdir"):
        pretraining.load_discriminator(os.path.dirname(workdir))


def test_load_pretrained_skips_a_corrupt_newest_checkpoint_and_says_so(straight_run, tmp_path,
                                                                       task_steps, caplog):
    """The pretrained model comes through the one restore path: a corrupt newest ``last``
    checkpoint is named on one warning line and the one before it is loaded (it used to be the
    newest or an error), and a reader moves no file of the pretraining run."""
    import logging
    import shutil

    from sparsemixer_jax.training.checkpoint import checkpoint_digest, read_checkpoint

    workdir = str(tmp_path / "copy")
    shutil.copytree(straight_run[0], workdir)
    bad = os.path.join(workdir, "checkpoints", "last", "6")
    os.remove(os.path.join(bad, "state", "_METADATA"))
    with caplog.at_level(logging.WARNING):
        pretrained = pretraining.load_pretrained(workdir, "last")
    named = [r.getMessage() for r in caplog.records if bad in r.getMessage()]
    assert len(named) == 1 and "state/_METADATA is missing" in named[0], named
    assert pretrained.step == 3
    older = os.path.join(workdir, "checkpoints", "last", "3")
    assert pretrained.digest == checkpoint_digest(older)
    saved, _ = read_checkpoint(older, task_steps.abstract_state(), 3)
    loaded = nnx.to_pure_dict(nnx.state(pretrained.encoder, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, loaded, saved.params["discriminator"])
    assert os.path.isdir(bad) and not os.path.exists(
        os.path.join(workdir, "checkpoints", "unreadable"))


@pytest.mark.parametrize(("override", "message"), [
    ({"router.name": "top2"}, "router.name"),
    ({"model.emb_dim": 17}, "not divisible by num_heads"),
    ({"data.micro_batch_size": 3}, "micro_batch_size"),
    ({"data.mask_prob": 0.0}, "mask_prob"),
    ({"optim.warmup_steps": 6}, "warmup_steps"),
    ({"data.seq_len": 4}, "seq_len"),
    ({"data.train": "/nonexistent/text"}, "/nonexistent/text"),
    ({"data.batch_size": 4096, "data.micro_batch_size": 0}, "fewer than one batch"),
    ({"model.activation": "swish"}, r"model\.activation='swish'"),
    ({"model.absolute_positions": 8}, "absolute_positions=8 is shorter than .*seq_len=16"),
    ({"model.absolute_positions": -1}, "absolute_positions must be an int >= 0"),
])
def test_config_and_data_errors_are_clear(corpus, tmp_path, override, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        pretraining.pretrain(tiny(corpus, **override), str(tmp_path / "bad"))


def test_a_bad_validation_text_stops_the_run_before_anything_is_written(corpus, tmp_path):
    """Found only after the vocabulary was trained before: now the workdir is never made."""
    bad = tmp_path / "valid.txt"
    bad.write_bytes("A first paragraph.\n\nGrüße aus K\xf6ln.\n".encode("latin-1"))
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=rf"^{bad}, line 3, byte 3: 0xfc is not UTF-8"):
        pretraining.pretrain(tiny(corpus, **{"data.valid": str(bad)}), str(workdir))
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        pretraining.pretrain(tiny(corpus, **{"data.valid": str(tmp_path / "none")}), str(workdir))
    assert not workdir.exists()


def test_generator_fields_are_checked(corpus, tmp_path):
    config = tiny(corpus)
    config.generator.emb_dim = 8
    with pytest.raises(ValueError, match="emb_dim is tied"):
        pretraining.pretrain(config, str(tmp_path / "bad"))


def test_learning_rate_warms_up_then_decays_linearly():
    optim = OptimSettings(schedule="linear", peak_lr=1.0, warmup_steps=4, decay_steps=12,
                          b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.01, clip_norm=1.0)
    schedule = learning_rate_schedule(optim)
    # Update u (counted from 1) has lr u/4 up to 4, then (12 - u) / 8.
    got = [float(schedule(count)) for count in range(13)]
    np.testing.assert_allclose(got, [0.25, 0.5, 0.75, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8,
                                     2 / 8, 1 / 8, 0.0, 0.0])


def test_weight_decay_spares_vectors():
    params = {"w": np.ones((2, 2)), "b": np.ones(2), "wi": np.ones((2, 2, 2)),
              "bi": np.ones((2, 2)), "omega": np.ones(())}
    assert weight_decay_mask(params) == {"w": True, "b": False, "wi": True, "bi": False,
                                                  "omega": False}


def test_readme_command_runs_a_few_steps(corpus, tmp_path):
    """``python -m experiments.pretrain --config configs/electra_smoke.py`` from the README, on the
    generated corpus and tiny shapes."""
    workdir = str(tmp_path / "cli")
    overrides = [
        f"--config.data.train={corpus}/train.txt", f"--config.data.valid={corpus}/valid.txt",
        "--config.data.vocab_size=120", "--config.data.seq_len=16", "--config.data.batch_size=4",
        "--config.data.valid_sequences=4", "--config.model.emb_dim=16",
        "--config.model.mlp_dim=32", "--config.train_steps=2", "--config.eval_every=2",
        "--config.optim.warmup_steps=1", "--config.optim.decay_steps=10",
    ]
    command = [sys.executable, "-m", "experiments.pretrain", "--config",
               "configs/electra_smoke.py", "--workdir", workdir, *overrides]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "results:" in run.stdout
    with open(os.path.join(workdir, "results.json")) as f:
        results = json.load(f)
    assert results["steps"] == 2 and np.isfinite(results["valid_loss"])
    assert os.path.exists(os.path.join(workdir, "spm.model"))


@pytest.mark.slow  # its own compilation of every step: minutes on 2 shared cores
def test_pretraining_on_an_expert_mesh_matches_one_device(corpus, tmp_path, task_steps,
                                                         last_checkpoint):
    """Two simulated devices, experts split over them, under XLA's other elementwise math (a
    child process): the same run as on one device, both with Adam in its linear regime, to the
    float32 rounding :func:`tests.kit.assert_same_training` derives. 128 tokens an update,
    fewer than 3 layers (generator and discriminator) x the vocab (120)."""
    reference, workdir = str(tmp_path / "one"), str(tmp_path / "mesh")
    pretraining.pretrain(tiny(corpus, **kit.ELECTRA_LINEAR_ADAM), reference)
    kit.train_with_other_math("experiments.pretrain", f"tests/tiny_electra_config.py:{corpus}",
                              workdir,
                              {**kit.ELECTRA_LINEAR_ADAM, "mesh.expert": 2, "mesh.data": 1})
    kit.assert_same_training(workdir, reference, 360, lambda w: last_checkpoint(w, task_steps))


def test_packed_data_is_cached_by_text_vocabulary_and_settings(straight_run, tmp_path,
                                                               monkeypatch):
    """A second ``load_data`` on the same workdir reads the packed arrays back without reading or
    tokenizing the text; another ``seq_len`` packs again (and replaces the stale file); the key
    changes with the text's and the vocabulary's contents."""
    import shutil

    workdir = str(tmp_path / "run")
    shutil.copytree(straight_run[0], workdir)
    config = tiny(os.path.dirname(read_config(workdir)["data"]["train"]))
    first = sorted(os.listdir(os.path.join(workdir, pretraining.PACKED_DIR)))
    assert [n.split("-")[0] for n in first] == ["train", "valid"]
    tokenizer = text.Tokenizer(os.path.join(workdir, "spm.model"))
    paragraphs = [p for doc in text.read_documents(config.data.train) for p in doc]
    fresh_tokens, fresh_segments = pretraining._packed(text.TextDataConfig.from_config(config),
                                                       tokenizer, paragraphs)

    calls = []
    real_pack = text.tokenize_and_pack

    def counting_pack(*args, **kwargs):
        calls.append(args[2])  # seq_len
        return real_pack(*args, **kwargs)

    def no_reading(path):
        raise AssertionError(f"{path} was read again")

    monkeypatch.setattr(text, "tokenize_and_pack", counting_pack)
    with monkeypatch.context() as m:
        m.setattr(text, "read_documents", no_reading)
        data = pretraining.PretrainingTask.from_config(config).load_data(workdir, 1)
    assert calls == []
    np.testing.assert_array_equal(data.train.tokens, fresh_tokens)
    np.testing.assert_array_equal(data.train.segments, fresh_segments)
    assert data.stats["train"]["sequences"] == len(fresh_tokens)

    config.data.seq_len = 12
    data = pretraining.PretrainingTask.from_config(config).load_data(workdir, 1)
    assert calls == [12, 12] and data.train.tokens.shape[1] == 12  # train and valid again
    second = sorted(os.listdir(os.path.join(workdir, pretraining.PACKED_DIR)))
    assert len(second) == 2 and not set(second) & set(first)

    files = text.text_files(config.data.train)
    vocab = os.path.join(workdir, "spm.model")
    key = text.packing_key(files, vocab, seq_len=16, pair_prob=0.5, seed=0)
    other_vocab = str(tmp_path / "other.model")
    shutil.copy(vocab, other_vocab)
    with open(other_vocab, "ab") as f:
        f.write(b"\0")
    other_text = str(tmp_path / "train.txt")
    shutil.copy(files[0], other_text)
    with open(other_text, "a") as f:
        f.write("One more line.\n")
    assert key == text.packing_key(files, vocab, seq_len=16, pair_prob=0.5, seed=0)
    assert key != text.packing_key(files, other_vocab, seq_len=16, pair_prob=0.5, seed=0)
    assert key != text.packing_key([other_text], vocab, seq_len=16, pair_prob=0.5, seed=0)
    assert key != text.packing_key(files, vocab, seq_len=16, pair_prob=0.4, seed=0)


def read_config(workdir):
    with open(os.path.join(workdir, "config.json")) as f:
        return json.load(f)


def test_electra_flops_per_token_by_hand():
    """The tiny config counted by hand: width 16, FFN 32, 16 tokens, 120 pieces; discriminator
    2 layers both MoE (N = 2, moe_every 1), generator 1 dense layer, 3 predicted positions."""
    from lab.benchmarks.flops import electra_flops_per_token

    layer = 8 * 16 * 16 + 4 * 16 * 32 + 4 * 16 * 16  # projections, FFN, attention (L = 16)
    disc = 2 * layer + 2 * (2 * 16 * 2)  # plus two routers
    gen = layer
    heads = (2 * 16 * 16 + 2 * 16) + 3 / 16 * (2 * 16 * 16 + 2 * 16 * 120)
    flops = electra_flops_per_token(tiny_electra_config.get_config())
    assert flops["total"] == pytest.approx(3 * (disc + gen + heads))
    assert flops["attention"] == pytest.approx(3 * 3 * 4 * 16 * 16)
    assert flops["generator"] == pytest.approx(3 * gen)
    # DenseMixer: every MoE layer also runs both experts forward (4 e m each) and the
    # unchosen-expert term (2 N e forward, 2 N e backward); the generator has no MoE layer.
    config = tiny_electra_config.get_config()
    config.router.name = "densemixer"
    dense = electra_flops_per_token(config)
    extra = 2 * (2 * 4 * 16 * 32 + 4 * 2 * 16)
    assert dense["discriminator"] == pytest.approx(flops["discriminator"] + extra)
    assert dense["total"] == pytest.approx(flops["total"] + extra)


def test_bad_inputs_are_one_line_errors(corpus, straight_run, tmp_path):
    """An empty corpus, an all-short corpus, a vocabulary without ``[CLS] [SEP] [MASK]``, a
    pretrained directory without a checkpoint, and a translation command on a pretraining
    workdir: each a ValueError / FileNotFoundError naming the problem, nothing deleted."""
    import shutil

    from sparsemixer_jax.tasks import translate

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "train.txt").write_text("\n\n  \n")
    (tmp_path / "empty" / "valid.txt").write_text("\n")
    with pytest.raises(ValueError, match="holds no text"):
        pretraining.pretrain(tiny(str(tmp_path / "empty")), str(tmp_path / "run_empty"))
    (tmp_path / "short").mkdir()
    for name in ("train.txt", "valid.txt"):
        (tmp_path / "short" / name).write_text("Hi.\nOk.\n\nNo.\n")
    with pytest.raises(ValueError, match=r"vocab_size=120 is too large for the training text"):
        pretraining.pretrain(tiny(str(tmp_path / "short")), str(tmp_path / "run_short"))

    workdir = tmp_path / "foreign_vocab"
    workdir.mkdir()
    paragraphs = [p for doc in text.read_documents(f"{corpus}/train.txt") for p in doc]
    text.train_tokenizer(paragraphs, str(workdir / "spm.model"), 120, seed=0)  # no specials
    with pytest.raises(ValueError, match=r"\[MASK\]'\) have ids .*not a pretraining vocabulary"):
        pretraining.pretrain(tiny(corpus), str(workdir))
    assert os.path.exists(workdir / "spm.model")  # reported, not replaced

    untrained = tmp_path / "untrained"
    untrained.mkdir()
    for name in ("config.json", "spm.model"):
        shutil.copy(os.path.join(straight_run[0], name), untrained)
    with pytest.raises(FileNotFoundError, match=r"checkpoints/last holds no checkpoint"):
        pretraining.load_pretrained(str(untrained))
    assert sorted(os.listdir(untrained)) == ["config.json", "spm.model"]  # orbax made nothing
    with pytest.raises(FileNotFoundError, match=r"config\.json not found"):
        pretraining.load_pretrained(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="holds a pretraining run, not a translation run"):
        translate.translate_lines(straight_run[0], ["a b c"])


def test_configs_saved_before_activation_and_positions_read_as_relu_without_positions():
    """A pretraining or translation config saved before ``model.activation`` and
    ``model.absolute_positions`` existed reads as the model those runs had: ReLU, no learned
    absolute positions; the ELECTRA configs state GELU and 512 positions."""
    from configs import electra, wmt
    from sparsemixer_jax.training import config as config_schema

    for get in (electra.get_config, wmt.get_config):
        saved = get().to_dict()
        for field in ("activation", "absolute_positions"):
            saved["model"].pop(field, None)
        restored = config_schema.with_defaults(saved)
        assert restored.model.activation == "relu"
        if restored.task == "pretraining":
            assert restored.model.absolute_positions == 0
        else:
            assert "absolute_positions" not in restored.model
    assert (electra.get_config().model.activation, wmt.get_config().model.activation) == (
        "gelu", "relu")
    assert electra.get_config().model.absolute_positions == 512


def test_admin_profiling_sets_the_residual_scales_before_training(corpus, tmp_path):
    """The ELECTRA configs' model.init='admin': the first training micro-batch, peeked without
    moving the stream, sets every sublayer's scale of both encoders before the steps exist."""
    config = tiny(corpus)
    assert config.model.init == "admin"
    task = pretraining.PretrainingTask.from_config(config)
    data = task.load_data(str(tmp_path), 1)
    position, first = data.train.state(), data.train.peek()
    steps = training.build_steps(run_config(config, task), data.vocab_size,
                                 init_model=data.init_model)
    assert data.train.state() == position
    jax.tree.map(np.testing.assert_array_equal, next(data.train), first)  # peek is next's
    scales = {}
    for path, value in jax.tree_util.tree_flatten_with_path(steps.init_state().params)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "residual_scale" in name:
            scales[name] = np.asarray(value)
    # Generator 1 layer, discriminator 2: two sublayers each.
    assert len(scales) == 2 * (1 + 2)
    firsts = [v for n, v in scales.items() if "layers/0/attn" in n]
    assert len(firsts) == 2 and all(np.all(v == 1.0) for v in firsts)  # omega_1 = 1
    rest = [v for n, v in scales.items() if "layers/0/attn" not in n]
    assert all(np.all(v > 1.0) and np.all(v == v[0]) for v in rest)
    # Without the scheme there is nothing to profile and no scale.
    plain = tiny(corpus, **{"model.init": "fairseq"})
    assert pretraining.PretrainingTask.from_config(plain).load_data(
        str(tmp_path), 1).init_model is None
