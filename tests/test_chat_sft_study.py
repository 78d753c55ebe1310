"""The chat fine-tuning study (lab/studies/chat_sft.py): GLUE rows as conversations, the
label-likelihood scorer (on log-probabilities set here, and on a tiny model packed and alone),
the table's paired statistics, and the commands' configs; and ``configs/lm_sft.py``, the chat
fine-tuning config with the study's learning rate, whose schedule follows ``train_steps``.
"""

import gzip
import json
import os
import shutil
import sys

import numpy as np
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from lab.studies import chat_sft
from lab.studies.runner import make_config
from sparsemixer_jax.data import chat
from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.tasks import check_config
from sparsemixer_jax.training.optim import learning_rate_schedule
from tests import kit

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = "x" * chat_sft.MAX_PROMPT_CHARS


def _write_tsv(path, lines):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    """Three rows per split of SST-2, MRPC and RTE in GLUE's layout; the last row of each
    split is too long to keep."""
    root = str(tmp_path_factory.mktemp("glue"))
    for split in ("train", "dev"):
        _write_tsv(f"{root}/SST-2/{split}.tsv.gz", [
            "sentence\tlabel", f"a gripping {split} film \t1", "dull and long \t0",
            f"{LONG}\t1"])
        _write_tsv(f"{root}/MRPC/{split}.tsv.gz", [
            "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",
            f"1\t1\t2\tHe left {split} .\tHe went away .", "0\t3\t4\tIt rained .\tIt was dry .",
            f"1\t5\t6\t{LONG}\tx"])
        _write_tsv(f"{root}/RTE/{split}.tsv.gz", [
            "index\tsentence1\tsentence2\tlabel",
            f"0\tA cat sat on the {split} mat.\tA cat sat.\tentailment",
            "1\tIt is dark.\tIt is noon.\tnot_entailment", f"2\t{LONG}\tx\tentailment"])
    return root


TINY_TASKS = tuple(chat_sft.ChatTask(t.name, t.prompt, t.answers, 2, 2) for t in chat_sft.TASKS)


def test_glue_rows_become_conversations_with_the_labels_answer(glue_dir):
    train, held_out = chat_sft.study_rows(glue_dir, TINY_TASKS)
    assert [r["task"] for r in held_out] == ["SST-2"] * 2 + ["MRPC"] * 2 + ["RTE"] * 2
    assert held_out[0] == {
        "task": "SST-2", "label": 1, "answers": ["negative", "positive"],
        "messages": [{"role": "user", "content": "Review: a gripping dev film\nIs the sentiment "
                                                 "of this review positive or negative?"},
                     {"role": "assistant", "content": "positive"}]}
    mrpc, rte = held_out[3], held_out[5]
    assert mrpc["messages"][0]["content"] == ("Sentence 1: It rained .\nSentence 2: It was dry ."
                                              "\nDo the two sentences mean the same thing? "
                                              "Answer yes or no.")
    assert (mrpc["label"], mrpc["messages"][1]["content"]) == (0, "no")
    assert rte["messages"][0]["content"].startswith("Premise: It is dark.\nHypothesis: It is "
                                                    "noon.\n")
    assert (rte["label"], rte["messages"][1]["content"]) == (1, "no")
    assert held_out[4]["messages"][1]["content"] == "yes"  # RTE's entailment
    # The long rows are left out; the training rows are the train splits', shuffled together.
    assert all(len(r["messages"][0]["content"]) <= chat_sft.MAX_PROMPT_CHARS
               for r in train + held_out)
    assert sorted(r["messages"][0]["content"] for r in train) == sorted(
        r["messages"][0]["content"].replace("dev", "train") for r in held_out)
    with pytest.raises(ValueError, match=r"SST-2/train.tsv.gz: 2 rows of at most 500 "
                                         r"characters, fewer than the 3"):
        chat_sft.study_rows(glue_dir, (chat_sft.ChatTask("SST-2", "Review: {a}", ("n", "p"), 3,
                                                         1),))


def test_the_fine_tuning_file_ends_with_the_held_out_rows(glue_dir, tmp_path):
    train_file, held_out_file = chat_sft.write_chat_data(glue_dir, str(tmp_path), TINY_TASKS)
    train, held_out = chat_sft.study_rows(glue_dir, TINY_TASKS)
    assert _lines(train_file) == [{"messages": r["messages"]} for r in train + held_out]
    assert _lines(held_out_file) == held_out


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------- scoring


def _example(ids, answer):
    """An example whose last ``answer`` tokens are its targets."""
    mask = np.zeros(len(ids), bool)
    mask[-answer:] = True
    return chat.Example(np.asarray(ids, np.int32), mask, 0)


def test_answer_log_likelihoods_sum_the_targets_log_probabilities():
    """With log p(token) = -token / 10 whatever came before, an example's score is minus a
    tenth of the sum of its target ids, however the examples are packed."""
    examples = [_example([5, 6, 7, 8], 2), _example([5, 6, 9], 1), _example([4, 3, 2, 1, 3], 3),
                _example([7, 7], 1)]

    shapes = set()

    def target_log_probs(tokens, segments):
        shapes.add(tokens.shape)
        return -tokens[:, 1:] / 10.0

    expected = [-(7 + 8) / 10, -9 / 10, -(2 + 1 + 3) / 10, -7 / 10]
    # One example per row, two per row, and every row in one batch padded with empty rows.
    for seq_len, batch_rows in ((6, 2), (9, 2), (10, 4)):
        scores = chat_sft.answer_log_likelihoods(target_log_probs, examples, seq_len,
                                                 batch_rows)
        # Sums of at most three tenths: exact to float64 rounding.
        np.testing.assert_allclose(scores, expected, rtol=1e-12)
    assert shapes == {(2, 6), (2, 9), (4, 10)}  # every call of a packing one shape


def test_packed_scores_equal_each_example_scored_alone_on_a_tiny_model():
    """The segment ids keep packed examples apart: scores of examples packed several to a row
    equal their scores one per row (float32 logits: same sums up to rounding)."""
    from sparsemixer_jax.tasks.language_model import LMTask

    lm = LMTask.from_config(kit.tiny_config("lm", "corpus")).lm
    model = CausalLM(lm, rngs=nnx.Rngs(params=0, router=2))
    model.eval()
    rng = np.random.default_rng(0)
    examples = [_example(rng.integers(3, lm.arch.vocab_size, n), k)
                for n, k in ((5, 2), (7, 3), (4, 1), (6, 2))]
    score = chat_sft.model_log_probs(model)
    packed = chat_sft.answer_log_likelihoods(score, examples, 16, 2)
    # One example at a time, in the same shape of batch (one compilation).
    alone = [chat_sft.answer_log_likelihoods(score, [e], 16, 2)[0] for e in examples]
    assert np.all(packed < 0)
    np.testing.assert_allclose(packed, alone, rtol=1e-5)
    # Not the same numbers by accident: another context changes an answer's score.
    changed = [_example(np.r_[examples[0].ids[:2] + 1, examples[0].ids[2:]], 2)]
    assert abs(chat_sft.answer_log_likelihoods(score, changed, 16, 2)[0] - packed[0]) > 1e-4


def test_accuracy_takes_the_best_scoring_answer_and_counts_ties_as_wrong():
    rows = [{"task": "SST-2", "label": 1, "answers": ["negative", "positive"]},
            {"task": "SST-2", "label": 0, "answers": ["negative", "positive"]},
            {"task": "RTE", "label": 0, "answers": ["yes", "no"]}]
    scores = np.array([-3.0, -1.0, -2.0, -0.5, -1.0, -1.0])
    assert chat_sft.accuracy_by_task(rows, scores) == {"SST-2": 0.5, "RTE": 0.0, "all": 1 / 3}


def test_candidate_examples_differ_in_the_answer_alone():
    from sparsemixer_jax import hf

    tokenizer = hf.load_tokenizer(os.path.join(DATA, "chat", "chatml"))
    row = {"task": "RTE", "label": 0, "answers": ["yes", "no"],
           "messages": [{"role": "user", "content": "Is it?"},
                        {"role": "assistant", "content": "yes"}]}
    yes, no = chat_sft.candidate_examples(tokenizer, [row])
    assert yes.ids.tolist() == chat.encode(tokenizer, row["messages"])[0].tolist()
    end = [tokenizer.token_id("eos_token")]
    assert yes.ids[yes.loss_mask].tolist() == tokenizer.encode("yes") + end
    assert no.ids[no.loss_mask].tolist() == tokenizer.encode("no") + end
    first = int(np.flatnonzero(yes.loss_mask)[0])
    assert yes.ids[:first].tolist() == no.ids[:first].tolist()


# ------------------------------------------------------------------------------- the table


def _summary(values):
    return {"versus": chat_sft.VERSUS, "arms": {
        arm: {str(s): {"valid_loss": v, "accuracy_all": 0.5, "churn": 0.1, "max_share": 0.3,
                       "load_entropy": 0.9}
              for s, v in enumerate(vs)} for arm, vs in values.items()}}


def test_a_difference_separates_at_two_standard_errors_with_five_seeds():
    base = [1.0, 1.1, 1.2, 1.3, 1.4]
    # Differences -0.1 +- 0.01: far beyond 2 SE on 5 seeds; on 4 seeds only preliminary.
    lower = [b - 0.1 + e for b, e in zip(base, (0.01, -0.01, 0.02, -0.02, 0.0), strict=True)]
    stat = chat_sft.paired_difference(*(
        {str(i): v for i, v in enumerate(vs)} for vs in (lower, base)), lower_is_better=True)
    assert (stat.n, stat.better) == (5, 5) and stat.separates
    assert abs(stat.mean + 0.1) < 1e-12
    four = chat_sft.paired_difference({str(i): lower[i] for i in range(4)},
                                      {str(i): base[i] for i in range(4)}, lower_is_better=True)
    assert abs(four.mean) > 2 * four.se and not four.separates
    noisy = chat_sft.paired_difference({"0": 1.0, "1": 2.0, "2": 1.0, "3": 2.0, "4": 1.0},
                                       {s: 1.5 for s in "01234"}, lower_is_better=True)
    assert not noisy.separates and noisy.better == 3
    table = chat_sft.study_table(_summary({chat_sft.VERSUS: base,
                                           "sparsemixer_v2_n8": lower}))
    assert "| **-0.1000 ± 0.0071 (5/5)** |" in table
    short = chat_sft.study_table(_summary({chat_sft.VERSUS: base[:4],
                                           "sparsemixer_v2_n8": lower[:4]}))
    assert "preliminary" in short and "**" not in short


def test_the_counts_are_the_seeds_where_the_arm_is_better():
    """docs/science.md's count: the seeds where the arm is better, a lower loss or a higher
    accuracy, whatever the mean's sign; a mean of exactly zero still counts them."""
    base = {str(i): 1.0 for i in range(5)}
    arm = {s: 1.0 + d for s, d in zip(base, (0.5, -0.25, -0.25, 0.0, 0.0), strict=True)}
    as_loss = chat_sft.paired_difference(arm, base, lower_is_better=True)
    as_accuracy = chat_sft.paired_difference(arm, base, lower_is_better=False)
    assert as_loss.mean == 0.0 and (as_loss.better, as_accuracy.better) == (2, 1)
    summary = _summary({chat_sft.VERSUS: [1.0] * 5, "sparsemixer_v2_n8": [1.1, 1.1, 1.1, 1.1,
                                                                          0.9]})
    for seed, accuracy in zip("01234", (0.6, 0.6, 0.6, 0.6, 0.4), strict=True):
        summary["arms"]["sparsemixer_v2_n8"][seed]["accuracy_all"] = accuracy
    row = next(line for line in chat_sft.study_table(summary).splitlines()
               if line.startswith("| SparseMixer-v2 |"))
    # Loss +0.06 (lower on seed 4 only), accuracy +0.06 (higher on seeds 0-3).
    assert "| +0.0600 ± 0.0400 (1/5) |" in row and "| +0.060 ± 0.040 (4/5) |" in row


# ---------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A stand-in for the base's export: the tiny Mixtral with the ChatML tokenizer."""
    path = tmp_path_factory.mktemp("base") / "base_hf"
    shutil.copytree(os.path.join(DATA, "hf", "mixtral"), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DATA, "chat", "chatml", name), path / name)
    return str(path)


def test_the_fine_tuning_arms_build_configs_that_check(checkpoint):
    routers = {}
    for arm in chat_sft.ARMS:
        config = make_config(chat_sft.SFT_CONFIG, arm, 0, None, [f"init_from={checkpoint}"])
        task = check_config(config).task  # raises on anything the run would refuse
        routers[arm] = (task.router.name, task.router.top_k, task.lm.router,
                        config.router.trainable)
    assert routers[chat_sft.VERSUS] == ("switch", 2, "switch", True)
    assert routers[chat_sft.FROZEN] == ("switch", 2, "switch", False)
    assert routers["sparsemixer_v2_n8"] == ("sparsemixer_v2", 2, "sparsemixer_v2", True)
    assert routers["default_moe_n8_eps0_norm1"][0] == "default_moe"
    config = make_config(chat_sft.SFT_CONFIG, chat_sft.VERSUS, 0, None)
    assert (config.init_from, config.data.train, config.data.format, config.init_router) == (
        chat_sft.BASE_HF, chat_sft.TRAIN_FILE, "chat", "config")
    assert config.data.valid_articles == chat_sft.VALID_ROWS  # the held-out rows, at the end


def test_the_base_config_checks_and_trains_a_bpe_vocabulary_with_top_2():
    from configs import lm_chat_base

    config = lm_chat_base.get_config()
    task = check_config(config).task
    assert (task.data.tokenizer, task.lm.router, task.lm.top_k) == ("bpe", "switch", 2)
    assert task.data.seq_len == make_config(chat_sft.SFT_CONFIG, chat_sft.VERSUS, 0,
                                            None).data.seq_len


def test_the_commands_train_every_arm_on_five_seeds_and_rebuild_the_tables():
    from experiments import compare

    commands = chat_sft.commands()
    args = compare.parse_args(chat_sft.compare_command().split()[3:])
    assert args.arms == list(chat_sft.ARMS) and args.versus == chat_sft.VERSUS
    assert args.seeds == list(chat_sft.SEEDS) and len(args.seeds) >= chat_sft.MIN_SEEDS
    assert args.config == chat_sft.SFT_CONFIG and args.root == chat_sft.FT_ROOT
    assert f"--config {chat_sft.BASE_CONFIG} --workdir {chat_sft.BASE_WORKDIR}" in commands[1]
    assert f"--workdir {chat_sft.BASE_WORKDIR} --out {chat_sft.BASE_HF}" in commands[2]
    summary = compare.parse_args(commands[5].split()[3:])
    assert summary.summarize_only and summary.root == chat_sft.FT_ROOT
    assert commands[-2:] == ["python -m lab.studies.chat_sft summarize",
                             "python -m lab.studies.chat_sft table"]


# ----------------------------------------------------------- configs/lm_sft.py, from the study


def _sft_run(checkpoint, monkeypatch, *overrides):
    """The run experiments.lm builds from ``--config configs/lm_sft.py`` and ``overrides``, the
    flags parsed as the command parses them (ml_collections reads the overrides from argv)."""
    argv = ["lm", f"--config={REPO}/configs/lm_sft.py", f"--config.init_from={checkpoint}",
            "--config.data.train=rows.jsonl", *overrides]
    monkeypatch.setattr(sys, "argv", argv)
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True)
    values(argv)
    return check_config(values.config)


def _decay_end(optim) -> int:
    """The first update after the peak whose learning rate is 0, counted from 1 (the schedule
    takes the count of updates done: update n is count n - 1)."""
    schedule = learning_rate_schedule(optim)
    return next(n for n in range(optim.warmup_steps + 1, 10_000)
                if float(schedule(n - 1)) == 0.0)


# ml_collections loads a --config file with importlib's deprecated load_module().
LOADS_CONFIG_FILE = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")


@LOADS_CONFIG_FILE
def test_the_sft_config_schedule_follows_train_steps_from_the_command_line(
        checkpoint, monkeypatch):
    default = _sft_run(checkpoint, monkeypatch)
    short = _sft_run(checkpoint, monkeypatch, "--config.train_steps=48")
    assert (default.train_steps, _decay_end(default.optim)) == (240, 240)
    assert (short.train_steps, _decay_end(short.optim)) == (48, 48)
    assert short.optim.warmup_steps == 4 < default.optim.warmup_steps
    assert (short.eval_every, short.checkpoint_every) == (12, 12)  # each quarter of the run
    # A schedule field given by itself keeps its value, and leaves train_steps alone.
    kept = _sft_run(checkpoint, monkeypatch, "--config.optim.decay_steps=100",
                    "--config.train_steps=48")
    assert (kept.train_steps, _decay_end(kept.optim)) == (48, 100)
    tiny = _sft_run(checkpoint, monkeypatch, "--config.train_steps=1")
    assert (tiny.optim.warmup_steps, tiny.optim.decay_steps, tiny.eval_every) == (0, 1, 1)


@LOADS_CONFIG_FILE
def test_the_sft_config_is_the_studys_schedule_on_chat_rows_without_wikitext(
        checkpoint, monkeypatch):
    """At the study's length it is the study's schedule (docs/lm.md gives the study's learning
    rate as the config's reason); it validates on the held-out chat rows alone."""
    run = _sft_run(checkpoint, monkeypatch)
    study = check_config(make_config(chat_sft.SFT_CONFIG, chat_sft.VERSUS, 0, None,
                                     [f"init_from={checkpoint}"]))
    schedule = ("peak_lr", "warmup_steps", "decay_steps", "schedule")
    assert [getattr(run.optim, f) for f in schedule] == [getattr(study.optim, f)
                                                          for f in schedule]
    assert run.train_steps == study.train_steps
    data = run.task.data
    assert (data.format, data.wikitext, data.train_articles) == ("chat", "", 0)
    assert data.valid_articles > 0 and run.task.init_from == checkpoint
