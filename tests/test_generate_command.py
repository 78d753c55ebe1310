"""``python -m experiments.generate`` (:mod:`sparsemixer_jax.tasks.lm_complete`): a tiny Qwen3-MoE
directory with the ChatML test tokenizer, a tiny BPE run from scratch whose checkpoint and its
export generate the same text, and bad input as one line with exit code 2.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from experiments import generate as command
from sparsemixer_jax import hf
from sparsemixer_jax.data import chat
from sparsemixer_jax.tasks import lm_complete
from tests import kit, tiny_lm_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tests/data/hf/qwen3_moe's model, its vocabulary widened to the ChatML tokenizer's 400."""
    from flax import nnx

    from sparsemixer_jax.models.causal_lm import CausalLM

    path = str(tmp_path_factory.mktemp("qwen3_moe_chat"))
    with open(os.path.join(DATA, "hf", "qwen3_moe", "config.json")) as f:
        lm = hf.from_hf({**json.load(f), "vocab_size": 400})
    hf.save_pretrained(CausalLM(lm, rngs=nnx.Rngs(params=0, router=1)), lm, path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DATA, "chat", "chatml", name), path)
    return path


def test_the_command_prints_the_greedy_answer_to_a_chat_turn(model_dir):
    """The printed text is the decoded greedy continuation of the ChatML generation prompt, cut
    at <|im_end|>: recomputed here from the model's logits one token at a time."""
    run = subprocess.run([sys.executable, "-m", "experiments.generate", "--model", model_dir,
                          "--chat", "What is 2 plus 2?", "--max-new-tokens", "6"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    source = lm_complete.load_source(model_dir=model_dir)
    ids = chat.generation_prompt(source.tokenizer.hf, "What is 2 plus 2?")
    assert lm_complete.prompt_ids(source, "What is 2 plus 2?", chat_turn=True) == ids
    header = source.tokenizer.hf.encode("<|im_start|>assistant\n")
    assert ids[-len(header):] == header  # the generation prompt ends the prompt
    eos = lm_complete.end_id(source.tokenizer)
    assert eos == source.tokenizer.hf.tokenizer.token_to_id("<|im_end|>")
    new = []
    for _ in range(6):  # the full forward pass, no cache: what generate's loop must equal
        logits = np.asarray(source.model(np.asarray([ids + new], np.int32)))[0, -1]
        if int(logits.argmax()) == eos:
            break
        new.append(int(logits.argmax()))
    assert new, "the test needs a continuation that is not empty"
    assert run.stdout == source.tokenizer.decode(new) + "\n"


def test_sampling_depends_on_the_seed_and_greedy_does_not(model_dir):
    source = lm_complete.load_source(model_dir=model_dir)
    greedy = [lm_complete.complete(source, "Hi", 8, seed=s) for s in (0, 1)]
    sampled = {lm_complete.complete(source, "Hi", 8, temperature=5.0, seed=s) for s in range(4)}
    assert greedy[0] == greedy[1]
    assert len(sampled) > 1  # at temperature 5 four draws of 8 tokens from 400 all equal: ~0


def test_a_run_and_its_export_generate_the_same_text(tmp_path):
    """A two-step BPE run from scratch (its ChatML template): --workdir restores the checkpoint
    and the run's tokenizer, and generates what the exported directory generates."""
    from sparsemixer_jax.tasks import lm_export
    from sparsemixer_jax.tasks.language_model import train_lm

    corpus = tiny_lm_config.write_corpus(str(tmp_path / "corpus"))
    config = kit.tiny_config("lm", corpus, **{
        "data.tokenizer": "bpe", "data.vocab_size": 300, "train_steps": 2, "eval_every": 2,
        "checkpoint_every": 2, "data.wikitext": "", "sample.tokens": 0})
    workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
    train_lm(config, workdir)
    lm_export.export_run(workdir, out)
    texts = {}
    for name, kwargs in {"run": {"workdir": workdir}, "export": {"model_dir": out}}.items():
        source = lm_complete.load_source(**kwargs)
        texts[name] = [lm_complete.complete(source, "The river", 12),
                       lm_complete.complete(source, "Hello", 12, chat_turn=True)]
    assert texts["run"] == texts["export"]
    assert command.main(["--workdir", workdir, "--prompt", "The river",
                         "--max-new-tokens", "12"]) == texts["run"][0]


def _no_template(model_dir, tmp_path):
    path = tmp_path / "no_template"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("args, message", [
    ([], "error: give exactly one of --model (a Hugging Face directory) and --workdir"),
    (["--model", "{M}", "--workdir", "{M}"], "error: give exactly one of --model"),
    (["--model", "{MISSING}"], "error: {MISSING}: no such directory"),
    (["--workdir", "{EMPTY}"],
     "error: {EMPTY}/config.json not found: is {EMPTY} a run of experiments.lm?"),
    (["--workdir", "{M}"],
     "error: {M} is a Hugging Face model directory, not a run of experiments.lm"),
    (["--model", "{M}", "--prompt", "a", "--chat", "b"],
     "error: give --prompt or --chat, not both"),
    (["--model", "{NO_TEMPLATE}", "--chat", "b"],
     "error: {NO_TEMPLATE}: --chat needs a chat template and this tokenizer has none"),
    (["--model", "{M}", "--top-p", "1.5"], "error: top_p must be in (0, 1], got 1.5"),
])
def test_bad_input_is_one_line_and_exit_code_2(model_dir, tmp_path, capsys, args, message):
    names = {"M": model_dir, "EMPTY": str(tmp_path), "MISSING": str(tmp_path / "missing"),
             "NO_TEMPLATE": str(tmp_path / "no_template")}
    if "{NO_TEMPLATE}" in args:
        shutil.copytree(model_dir, names["NO_TEMPLATE"])
        config_file = os.path.join(names["NO_TEMPLATE"], "tokenizer_config.json")
        with open(config_file) as f:
            config = json.load(f)
        del config["chat_template"]
        with open(config_file, "w") as f:
            json.dump(config, f)
    with pytest.raises(SystemExit) as exit_:
        command.main([a.format(**names) for a in args])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(message.format(**names)) and err.count("\n") == 1, err
