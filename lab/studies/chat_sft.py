"""The chat fine-tuning study: supervised fine-tuning of a small base model on GLUE tasks
written as conversations, under each router-gradient estimator and with frozen routers,
5 seeds each, paired by seed (docs/lm.md, "Chat fine-tuning and the estimators").

The base is the quickstart's architecture trained with top-2 routing and a byte-level BPE
vocabulary with a ChatML template (``configs/lm_chat_base.py``), exported as a Hugging Face
directory; every fine-tuning run starts from it (``configs/lm_chat_sft.py``) and routes by the
arm's router (``init_router = "config"``). The steps, in order (each resumes or skips what is
done when run again)::

    python -m lab.studies.chat_sft commands

prints them: write the chat rows (:func:`write_chat_data`), train and export the base, train
the fine-tuning arms (``experiments.compare``), score each run's held-out answers
(:func:`score_root`), summarise the runs into ``docs/results`` and build the tables from the
summary (:func:`study_table`).

The rows: GLUE's SST-2, MRPC and RTE (``../shared/data/glue``) as one user turn (the prompt of
:data:`TASKS` with the example's text) and the assistant's answer (the label's word). The
training rows are a seeded sample of each task's train split, shuffled together; the held-out
rows a seeded sample of each dev split, in file order. A row whose user turn is longer than
:data:`MAX_PROMPT_CHARS` characters is left out (so that a conversation fits the rows of 256
tokens whole). The fine-tuning file holds the training rows followed by the held-out rows
(``data.valid_articles`` = :data:`VALID_ROWS`: the held-out loss is on their answers), and the
held-out rows are written again with their task, label and candidate answers for scoring.

Held-out accuracy: each held-out row is rendered with each of its task's answers as the
assistant's turn, and the answer whose tokens (the answer and the end-of-turn token that
closes it: exactly the tokens the fine-tuning loss is on) have the largest summed
log-probability given the conversation before them is the prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lab.studies.arms import run_dir, run_state

GLUE_DIR = "../shared/data/glue"
ROOT = "runs/chat_sft"
DATA_DIR = f"{ROOT}/data"
TRAIN_FILE = f"{DATA_DIR}/glue_chat.jsonl"
HELD_OUT_FILE = f"{DATA_DIR}/glue_chat_held_out.jsonl"
BASE_CONFIG = "configs/lm_chat_base.py"
SFT_CONFIG = "configs/lm_chat_sft.py"
BASE_WORKDIR = f"{ROOT}/base"
BASE_HF = f"{ROOT}/base_hf"
FT_ROOT = f"{ROOT}/ft"
ACCURACY_FILE = "label_accuracy.json"
RESULTS = "docs/results/chat_sft"
DATA_SEED = 43
MAX_PROMPT_CHARS = 500

SEEDS = (0, 1, 2, 3, 4)
VERSUS = "switch_n8_eps0_norm1"
FROZEN = "switch_n8_eps0_norm1_trainable0"
ARMS = ("switch_n8_eps0_norm1", "sparsemixer_v2_n8", "sparsemixer_v2star_n8",
        "densemixer_n8_eps0_norm1", "default_moe_n8_eps0_norm1", FROZEN)
"""Top-2 as the base routes (Switch's forward, Mixtral's renormalised gates), SparseMixer-v2 and
v2* (their mask threshold 0.1), DenseMixer and Default MoE (Switch's forward), and top-2 with
every router frozen at the base's weights."""
ARM_TITLES = {"switch_n8_eps0_norm1": "top-2", "sparsemixer_v2_n8": "SparseMixer-v2",
              "sparsemixer_v2star_n8": "SparseMixer-v2*",
              "densemixer_n8_eps0_norm1": "DenseMixer", "default_moe_n8_eps0_norm1": "Default MoE",
              FROZEN: "top-2, frozen routers"}
MIN_SEEDS = 5  # a difference "separates" at >= 2 standard errors with at least this many seeds


@dataclasses.dataclass(frozen=True)
class ChatTask:
    """One GLUE task as conversations: ``prompt`` formatted with the example's ``a`` (and
    ``b``) is the user's turn, ``answers[label]`` the assistant's; ``train_rows`` and
    ``dev_rows`` are how many of each split the study samples."""

    name: str
    prompt: str
    answers: tuple[str, ...]
    train_rows: int
    dev_rows: int


TASKS = (
    ChatTask("SST-2", "Review: {a}\nIs the sentiment of this review positive or negative?",
             ("negative", "positive"), 1500, 400),
    ChatTask("MRPC", "Sentence 1: {a}\nSentence 2: {b}\nDo the two sentences mean the same "
             "thing? Answer yes or no.", ("no", "yes"), 1000, 300),
    ChatTask("RTE", "Premise: {a}\nHypothesis: {b}\nDoes the premise entail the hypothesis? "
             "Answer yes or no.", ("yes", "no"), 1000, 200),
)
"""Labels in GLUE's class order: SST-2 0 negative / 1 positive, MRPC 0 not a paraphrase /
1 paraphrase, RTE entailment / not_entailment."""
VALID_ROWS = sum(t.dev_rows for t in TASKS)


# ----------------------------------------------------------------------------------- the rows


def chat_rows(task: ChatTask, examples: Sequence[Any]) -> list[dict[str, Any]]:
    """``{"task", "label", "answers", "messages"}`` of each GLUE example (``text_a``,
    ``text_b``, ``label`` as :mod:`sparsemixer_jax.data.glue` reads them) whose user turn has
    at most :data:`MAX_PROMPT_CHARS` characters; the messages are the user's turn and the
    label's answer. Texts are stripped (SST-2's end with a space)."""
    rows = []
    for e in examples:
        prompt = task.prompt.format(a=e.text_a.strip(), b=(e.text_b or "").strip())
        if len(prompt) > MAX_PROMPT_CHARS:
            continue
        rows.append({"task": task.name, "label": int(e.label), "answers": list(task.answers),
                     "messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": task.answers[e.label]}]})
    return rows


def _sample(rows: list, n: int, seed: Sequence[int], where: str) -> list:
    """``n`` of ``rows``, a seeded sample in their order."""
    if len(rows) < n:
        raise ValueError(f"{where}: {len(rows)} rows of at most {MAX_PROMPT_CHARS} characters, "
                         f"fewer than the {n} the study samples")
    keep = np.sort(np.random.default_rng(list(seed)).choice(len(rows), n, replace=False))
    return [rows[i] for i in keep]


def study_rows(glue_dir: str = GLUE_DIR, tasks: Sequence[ChatTask] = TASKS
               ) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)``: the training rows of every task shuffled together, and the held-out
    rows task by task (module docstring)."""
    from sparsemixer_jax.data import glue

    train, held_out = [], []
    for i, task in enumerate(tasks):
        spec = glue.task_spec(task.name)
        for split, n, rows in (("train", task.train_rows, train),
                               ("dev", task.dev_rows, held_out)):
            path = glue.split_path(glue_dir, spec, split)
            rows += _sample(chat_rows(task, glue.read_split(path, spec)), n,
                            (DATA_SEED, i, int(split == "dev")), path)
    order = np.random.default_rng([DATA_SEED, 99]).permutation(len(train))
    return [train[i] for i in order], held_out


def write_chat_data(glue_dir: str = GLUE_DIR, out_dir: str = DATA_DIR,
                    tasks: Sequence[ChatTask] = TASKS) -> tuple[str, str]:
    """Writes the fine-tuning file (the training rows, then the held-out rows; ``messages``
    only) and the held-out file (the held-out rows with task, label and answers). Returns
    their paths."""
    train, held_out = study_rows(glue_dir, tasks)
    os.makedirs(out_dir, exist_ok=True)
    paths = (os.path.join(out_dir, os.path.basename(TRAIN_FILE)),
             os.path.join(out_dir, os.path.basename(HELD_OUT_FILE)))
    for path, rows in zip(paths, (train + held_out, held_out), strict=True):
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                record = {"messages": row["messages"]} if path == paths[0] else row
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return paths


# --------------------------------------------------------------------------------- scoring


def candidate_examples(tokenizer: Any, rows: Sequence[dict]) -> list[Any]:
    """For each row and each of its answers in order, the conversation with that answer as the
    assistant's turn, encoded (:func:`sparsemixer_jax.data.chat.encode_example`: the loss mask
    marks the answer's tokens and its end-of-turn token)."""
    from sparsemixer_jax.data import chat

    return [chat.encode_example(tokenizer, [*row["messages"][:-1],
                                            {"role": "assistant", "content": answer}])
            for row in rows for answer in row["answers"]]


def answer_log_likelihoods(target_log_probs: Callable[[np.ndarray, np.ndarray], np.ndarray],
                           examples: Sequence[Any], seq_len: int, batch_rows: int
                           ) -> np.ndarray:
    """float64 ``[len(examples)]``: each example's summed log-probability of its targets (its
    ``loss_mask``) given the tokens before them.

    The examples are packed whole into rows of ``seq_len`` tokens with segment ids
    (:func:`sparsemixer_jax.data.chat.pack_examples`; the model masks attention across
    segments), ``batch_rows`` rows per call of ``target_log_probs(tokens, segments)``, which
    returns float ``[B, seq_len - 1]``: position ``t``'s value is the log-probability of token
    ``t + 1`` given the tokens before it."""
    from sparsemixer_jax.data import chat

    tokens, segments, targets = chat.pack_examples(examples, seq_len)
    totals = np.zeros(len(examples) + 1, np.float64)
    for start in range(0, len(tokens), batch_rows):
        rows = slice(start, start + batch_rows)
        t, s, m = tokens[rows], segments[rows], targets[rows]
        pad = batch_rows - len(t)  # one batch shape: one compilation
        if pad:
            t, s, m = (np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)])
                       for a in (t, s, m))
        log_probs = np.asarray(target_log_probs(t, s), np.float64)
        np.add.at(totals, s[:, 1:][m[:, 1:]], log_probs[m[:, 1:]])
    return totals[1:]


def accuracy_by_task(rows: Sequence[dict], scores: np.ndarray) -> dict[str, float]:
    """The share of rows whose label's answer scores highest, per task and ``"all"`` (every
    row counted once). ``scores``: one per row and answer, in :func:`candidate_examples`'
    order. A tie counts as wrong."""
    hits: dict[str, list[bool]] = {}
    at = 0
    for row in rows:
        own = scores[at: at + len(row["answers"])]
        at += len(row["answers"])
        best = np.flatnonzero(own == own.max())
        hits.setdefault(row["task"], []).append(best.tolist() == [row["label"]])
    out = {task: float(np.mean(h)) for task, h in hits.items()}
    out["all"] = float(np.mean([h for task in hits.values() for h in task]))
    return out


def restored_model(workdir: str) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, config)`` of a fine-tuning run's last checkpoint (deterministic
    forward), with the tokenizer files the run kept in its workdir, and the run's config."""
    import ml_collections

    from sparsemixer_jax import hf
    from sparsemixer_jax.parallel import sharding
    from sparsemixer_jax.tasks import run_config
    from sparsemixer_jax.tasks.language_model import KEPT_DIR, LMTask
    from sparsemixer_jax.training.loop import build_steps
    from sparsemixer_jax.training.state import restore_checkpoint

    with open(os.path.join(workdir, "config.json")) as f:
        config = ml_collections.ConfigDict(json.load(f))
    config.init_from = os.path.join(workdir, KEPT_DIR)
    task = LMTask.from_config(config)
    run = run_config(config, dataclasses.replace(task, init_from=""))
    steps = build_steps(run, task.lm.arch.vocab_size, sharding.device_mesh(run.mesh))
    restored = restore_checkpoint(workdir, steps.abstract_state(), "last")
    if restored is None:
        raise FileNotFoundError(f"{workdir} holds no checkpoint to score")
    model = steps.model(restored.state)
    model.eval()
    return model, hf.load_tokenizer(config.init_from), config


def model_log_probs(model: Any) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """``target_log_probs`` of :func:`answer_log_likelihoods` for a
    :class:`~sparsemixer_jax.models.causal_lm.CausalLM` (its deterministic forward)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit
    def forward(model, tokens, segments):
        logits = model.forward(tokens, segment_ids=segments, token_mask=segments != 0,
                               deterministic=True).logits
        log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]

    return lambda tokens, segments: forward(model, jnp.asarray(tokens), jnp.asarray(segments))


def score_run(workdir: str, held_out: str = HELD_OUT_FILE, batch_rows: int = 32
              ) -> dict[str, float]:
    """Scores a finished run's held-out answers and writes ``{workdir}/label_accuracy.json``:
    the accuracy per task and over all rows, and the rows scored."""
    with open(held_out, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    model, tokenizer, config = restored_model(workdir)
    scores = answer_log_likelihoods(model_log_probs(model), candidate_examples(tokenizer, rows),
                                    config.data.seq_len, batch_rows)
    out = {**accuracy_by_task(rows, scores), "rows": len(rows)}
    with open(os.path.join(workdir, ACCURACY_FILE), "w") as f:
        json.dump(out, f, indent=2)
    return out


def score_root(root: str = FT_ROOT, arms: Sequence[str] = ARMS, seeds: Sequence[int] = SEEDS,
               held_out: str = HELD_OUT_FILE, delete_checkpoints: bool = False) -> list[str]:
    """Scores every finished run of ``root`` not scored yet (:func:`score_run`); returns the
    workdirs scored. ``delete_checkpoints``: then removes each scored run's checkpoints."""
    import shutil

    scored = []
    for seed in seeds:
        for arm in arms:
            workdir = run_dir(root, arm, seed)
            if run_state(workdir) != "finished":
                continue
            if not os.path.exists(os.path.join(workdir, ACCURACY_FILE)):
                print(f"{workdir}: {score_run(workdir, held_out)}", flush=True)
                scored.append(workdir)
            if delete_checkpoints:
                shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
    return scored


# ------------------------------------------------------------------------------ the summary


def run_summary(workdir: str) -> dict[str, float] | None:
    """One finished, scored run's figures: the held-out loss, the accuracies, and the routing
    against the base at the end (per MoE layer, averaged over layers: ``churn``,
    ``load_entropy``; ``max_share``: the largest over layers). None if not finished or not
    scored yet."""
    paths = [os.path.join(workdir, name) for name in ("results.json", ACCURACY_FILE)]
    if not all(os.path.exists(p) for p in paths):
        return None
    with open(paths[0]) as f:
        results = json.load(f)
    with open(paths[1]) as f:
        accuracy = json.load(f)
    layers = list(results["routing"].values())
    return {"valid_loss": results["valid_loss"],
            **{f"accuracy_{task}": value for task, value in accuracy.items() if task != "rows"},
            "churn": float(np.mean([layer["churn"] for layer in layers])),
            "max_share": float(np.max([layer["max_share"] for layer in layers])),
            "load_entropy": float(np.mean([layer["load_entropy"] for layer in layers]))}


def summarize_root(root: str = FT_ROOT, arms: Sequence[str] = ARMS,
                   seeds: Sequence[int] = SEEDS) -> dict[str, Any]:
    """``{"arms": {arm: {seed: run_summary}}, "versus": VERSUS}`` of the finished, scored
    runs (seeds as strings, as JSON keeps them)."""
    out: dict[str, Any] = {"versus": VERSUS, "arms": {}}
    for arm in arms:
        runs = {str(s): r for s in seeds if (r := run_summary(run_dir(root, arm, s)))}
        out["arms"][arm] = runs
    return out


@dataclasses.dataclass(frozen=True)
class PairedDifference:
    """``arm - baseline`` over the seeds both have: mean, standard error (SD / sqrt(n)), how
    many seeds the arm is better on (a tie is not better), and how many seeds."""

    mean: float
    se: float
    better: int
    n: int

    @property
    def separates(self) -> bool:
        """At least 2 standard errors from 0 with at least :data:`MIN_SEEDS` seeds."""
        return self.n >= MIN_SEEDS and abs(self.mean) >= 2 * self.se > 0


def paired_difference(arm: dict[str, float], baseline: dict[str, float], *,
                      lower_is_better: bool) -> PairedDifference | None:
    """None with fewer than two common seeds. ``lower_is_better``: the arm is better on a seed
    where its difference is negative (a loss) rather than positive (an accuracy)."""
    seeds = sorted(set(arm) & set(baseline))
    if len(seeds) < 2:
        return None
    d = np.array([arm[s] - baseline[s] for s in seeds], np.float64)
    better = d < 0 if lower_is_better else d > 0
    return PairedDifference(float(d.mean()), float(np.std(d, ddof=1) / math.sqrt(len(d))),
                            int(np.sum(better)), len(d))


def _values(summary: dict, arm: str, key: str) -> dict[str, float]:
    return {seed: run[key] for seed, run in summary["arms"].get(arm, {}).items()
            if run.get(key) is not None and math.isfinite(run[key])}


def _difference_cell(stat: PairedDifference | None, digits: int) -> str:
    if stat is None:
        return "–"
    text = f"{stat.mean:+.{digits}f} ± {stat.se:.{digits}f} ({stat.better}/{stat.n})"
    return f"**{text}**" if stat.separates else text


def _mean_cell(values: dict[str, float], digits: int) -> str:
    if not values:
        return "–"
    v = np.array(list(values.values()), np.float64)
    se = f" ± {np.std(v, ddof=1) / math.sqrt(len(v)):.{digits}f}" if len(v) > 1 else ""
    return f"{v.mean():.{digits}f}{se} (n={len(v)})"


def study_table(summary: dict) -> str:
    """The study's tables as markdown, from :func:`summarize_root`'s summary: per arm the
    held-out loss and accuracy (mean ± SE over seeds, and minus top-2's paired by seed), the
    accuracy per task minus top-2's, and the routing at the end against the base."""
    versus = summary["versus"]
    arms = [a for a in ARMS if summary["arms"].get(a)]
    tasks = [t.name for t in TASKS]
    fewest = min((len(summary["arms"][a]) for a in arms), default=0)

    def rows(header: list[str], cells: Callable[[str], list[str]]) -> list[str]:
        out = ["| arm | " + " | ".join(header) + " |", "| --- |" + " --- |" * len(header)]
        return out + [f"| {ARM_TITLES[a]} | " + " | ".join(cells(a)) + " |" for a in arms]

    def diff(arm: str, key: str, digits: int) -> str:
        if arm == versus:
            return ""
        return _difference_cell(paired_difference(
            _values(summary, arm, key), _values(summary, versus, key),
            lower_is_better=key == "valid_loss"), digits)

    lines = [f"Each arm minus {ARM_TITLES[versus]} (`{versus}`) on the same seed: mean ± "
             "standard error (seeds where the arm is better / seeds: a lower loss, a higher "
             "accuracy); bold where "
             f"the difference separates (at least 2 standard errors, with at least {MIN_SEEDS} "
             "seeds)."
             + (f" Fewer than {MIN_SEEDS} seeds in some arm: preliminary." if fewest < MIN_SEEDS
                else ""), ""]
    lines += rows(["held-out loss", "minus top-2's", "accuracy (all)", "minus top-2's"],
                  lambda a: [_mean_cell(_values(summary, a, "valid_loss"), 4),
                             diff(a, "valid_loss", 4),
                             _mean_cell(_values(summary, a, "accuracy_all"), 3),
                             diff(a, "accuracy_all", 3)])
    lines += ["", f"Held-out accuracy per task: {ARM_TITLES[versus]}'s (mean ± standard error), "
              "each other arm's minus it on the same seed (seeds where the arm's accuracy is "
              "higher / seeds).", ""]
    lines += rows(tasks, lambda a: [diff(a, f"accuracy_{t}", 3) if a != versus else
                                    _mean_cell(_values(summary, a, f"accuracy_{t}"), 3)
                                    for t in tasks])
    lines += ["", "Routing at the end against the base on the held-out tokens: churn (share of "
              "tokens whose chosen pair changed, mean over layers), the busiest expert's "
              "share (largest over layers; 0.25 uniform) and the load entropy (/ log 8, mean "
              "over layers): mean ± standard error over seeds.", ""]
    lines += rows(["churn", "max share", "load entropy"],
                  lambda a: [_mean_cell(_values(summary, a, k), 3)
                             for k in ("churn", "max_share", "load_entropy")])
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ the commands


def compare_command() -> str:
    """The ``experiments.compare`` command of the fine-tuning arms."""
    return (f"python -m experiments.compare --config {SFT_CONFIG} --root {FT_ROOT} "
            f"--arms {' '.join(ARMS)} --versus {VERSUS} --seeds {' '.join(map(str, SEEDS))} "
            "--parallel 2 --no-dense")


def commands() -> list[str]:
    """Every step of the study, in order (module docstring)."""
    return [
        "python -m lab.studies.chat_sft data",
        f"python -m experiments.lm --config {BASE_CONFIG} --workdir {BASE_WORKDIR}",
        f"python -m experiments.lm_export --workdir {BASE_WORKDIR} --out {BASE_HF} --force",
        compare_command(),
        "python -m lab.studies.chat_sft score --delete-checkpoints",
        compare_command().replace(" --parallel 2", "")
        + f" --summarize-only --out-json {RESULTS}_compare_cpu.json --out-md "
        f"{RESULTS}_compare_cpu.md --plot {RESULTS}_cpu.png --plot-router "
        f"{RESULTS}_router_cpu.png --pack {RESULTS}_compare_runs.tar.gz",
        "python -m lab.studies.chat_sft summarize",
        "python -m lab.studies.chat_sft table",
    ]


def main(argv: list[str] | None = None) -> None:
    """``python -m lab.studies.chat_sft {commands,data,score,summarize,table}``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("commands", "data", "score", "summarize", "table"))
    parser.add_argument("--root", default=FT_ROOT, help="the fine-tuning runs")
    parser.add_argument("--delete-checkpoints", action="store_true",
                        help="score: then delete each scored run's checkpoints")
    parser.add_argument("--summary", default=f"{RESULTS}_cpu.json")
    parser.add_argument("--out-md", default=f"{RESULTS}_cpu.md")
    args = parser.parse_args(argv)
    if args.step == "commands":
        print(*commands(), sep="\n")
    elif args.step == "data":
        for path in write_chat_data():
            print(f"wrote {path}")
    elif args.step == "score":
        from sparsemixer_jax.training.cli import cpu_only_where_no_accelerator

        cpu_only_where_no_accelerator()  # as experiments' commands start JAX
        score_root(args.root, delete_checkpoints=args.delete_checkpoints)
    elif args.step == "summarize":
        pathlib.Path(args.summary).write_text(json.dumps(summarize_root(args.root), indent=2)
                                              + "\n")
        print(f"wrote {args.summary}")
    else:
        if not os.path.exists(args.summary):
            raise SystemExit(f"error: {args.summary} not found; run the summarize step first")
        table = study_table(json.loads(pathlib.Path(args.summary).read_text()))
        print(table, end="")
        pathlib.Path(args.out_md).write_text(table)


if __name__ == "__main__":
    main()
