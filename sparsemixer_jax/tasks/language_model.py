"""Language modelling: a decoder-only MoE model
(:class:`~sparsemixer_jax.models.causal_lm.CausalLM`) trained on packed documents by the one
training loop, from scratch (the project's SentencePiece) or fine-tuned from a Hugging Face
checkpoint (``config.init_from``, its own tokenizer).

``train_lm(config, workdir)`` is the whole run: next-token loss plus the routers' auxiliary
losses, validation perplexity and bits per byte on held-out text, and at the end the second
held-out set (WikiText-2), the unigram baseline and generated text.
:func:`sparsemixer_jax.tasks.lm_export.export_run` writes a run's checkpoint as a Hugging Face
directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from sparsemixer_jax.data import bpe, chat, lm_text, text
from sparsemixer_jax.data.tokenizer import vocabulary_sample
from sparsemixer_jax.hf.scratch import check_router_for_lm, from_scratch_config, router_overrides
from sparsemixer_jax.layers.packed_attention import check_rows_fit
from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.models.lm_config import LMConfig, LMExecution
from sparsemixer_jax.models.lm_loss import token_nll
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.section import cast
from sparsemixer_jax.tasks import check_sections, run_config
from sparsemixer_jax.tasks.lm_sections import (
    INIT_ROUTERS,
    LMModelConfig,
    SampleConfig,
    refuse_overruled_router_fields,
    refuse_unused_router_fields,
    router_of_run,
)
from sparsemixer_jax.training import Run, TaskData, train
from sparsemixer_jax.training import config as config_schema
from sparsemixer_jax.training.hosts import is_main_process, wait_for_all_processes
from sparsemixer_jax.training.loop import evaluate

logger = logging.getLogger(__name__)

_SUMS = ("nll", "tokens", "correct", "bytes")
#: Where a fine-tuning run keeps copies of its checkpoint's files other than the weights
#: (:data:`KEPT_FILES`, those it has), when it starts: its export needs no ``init_from``.
KEPT_DIR = "init_from_files"
KEPT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


def next_token_sums(logits: jax.Array, tokens: jax.Array, is_target: jax.Array,
                    row_bytes: jax.Array) -> dict[str, jax.Array]:
    """Sums over the targets of packed rows (:mod:`sparsemixer_jax.data.lm_text`): ``nll``,
    ``tokens``, ``correct`` (argmax hits) and ``bytes`` (their text's UTF-8 bytes).

    ``logits`` float32 ``[B, T, V]``; ``tokens`` int ``[B, T]``; ``is_target`` bool ``[B, T]``
    (position ``t`` is predicted from the positions before it); ``row_bytes`` ``[B]``."""
    targets = tokens[:, 1:]
    weights = is_target[:, 1:].astype(jnp.float32)
    # Over all T positions (the last one's target a dummy, left out): no [B, T - 1, V] slice.
    padded = jnp.pad(targets, ((0, 0), (0, 1)))
    nll = token_nll(logits, padded)[:, :-1]
    correct = (jnp.argmax(logits, axis=-1)[:, :-1] == targets).astype(jnp.float32)
    return {"nll": jnp.sum(nll * weights), "tokens": jnp.sum(weights),
            "correct": jnp.sum(correct * weights), "bytes": jnp.sum(row_bytes)}


def _forward(model: CausalLM, batch, deterministic: bool):
    segments = batch.get("segments")
    if segments is None:  # one sequence a row, every token real (a benchmark's batch)
        return model.forward(batch["tokens"], deterministic=deterministic)
    return model.forward(batch["tokens"], segment_ids=segments, token_mask=segments != 0,
                         deterministic=deterministic)


def per_token_metrics(nll: float, tokens: float, nbytes: float, prefix: str) -> dict[str, float]:
    """``{prefix}_loss`` (mean NLL), ``_ppl`` and ``_bits_per_byte``."""
    loss = nll / max(tokens, 1.0)
    return {f"{prefix}_loss": loss, f"{prefix}_ppl": math.exp(min(loss, 700.0)),
            f"{prefix}_bits_per_byte": nll / (math.log(2) * max(nbytes, 1.0))}


@dataclasses.dataclass(frozen=True)
class LMTask:
    """The language-modelling task (:class:`sparsemixer_jax.training.Task`).

    ``lm`` is the model's config: built from ``config.model`` for a run from scratch, or read
    from the checkpoint's ``config.json`` for fine-tuning (``init_from``), both before anything
    is read or written. ``router``: the router section as the run uses it
    (:func:`~sparsemixer_jax.tasks.lm_sections.router_of_run`; keeping the checkpoint's
    routing, its auxiliary losses alone).
    """

    lm: LMConfig
    router: RouterConfig
    data: lm_text.LMDataConfig
    sample: SampleConfig
    init_from: str = ""

    batch_keys = ("tokens", "segments", "targets", "bytes")
    progress_keys = ("loss", "ppl")

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> LMTask:
        """Every section, each checked, and the rules between them: a ValueError naming the
        first bad field (or what is wrong with ``init_from``)."""
        check_sections(config)
        model = LMModelConfig.from_config(config.model)
        execution = LMExecution.from_config(config.model)
        init_from = cast(str, config.init_from, "config.init_from")
        init_router = cast(str, config.init_router, "config.init_router")
        if init_router not in INIT_ROUTERS:
            raise ValueError(f"config.init_router={init_router!r}; choose one of {INIT_ROUTERS}")
        router = router_of_run(config.router, init_from, init_router)
        data = lm_text.LMDataConfig.from_config(config)
        sample = SampleConfig.from_config(config.sample)
        if init_from and data.tokenizer != "spm":
            raise ValueError(f"config.data.tokenizer={data.tokenizer!r}: a run from a "
                             "checkpoint (config.init_from) tokenizes with the checkpoint's "
                             "own tokenizer; leave it at 'spm'")
        if init_from:
            lm = _checkpoint_config(init_from, router, execution, init_router, data.format)
        elif data.format != "text":
            raise ValueError(f"config.data.format={data.format!r} needs a checkpoint's "
                             "tokenizer (and, for chat, its chat template): set "
                             "config.init_from to a Hugging Face directory")
        else:
            config_schema.validate(config, router)
            lm = from_scratch_config(model, router, data.vocab_size, execution)
            if data.tokenizer == "bpe":  # config.json names its special tokens' ids
                lm = lm.replace(hf_config=json.dumps({**lm.hf, **bpe.TOKEN_IDS}))
        return cls(lm, router, data, sample, init_from)

    # -- in the compiled steps

    def loss(self, model: CausalLM, batch, key):
        """The token-summed next-token NLL plus the auxiliary losses, and metric sums."""
        # The scanned stacks hold one key per layer: match_shape splits the new one to them.
        nnx.reseed(model, policy="match_shape", router=key)
        out = _forward(model, batch, deterministic=False)
        sums = next_token_sums(out.logits, batch["tokens"], batch["targets"], batch["bytes"])
        router, tokens = self.router, sums["tokens"]
        aux = router.balance_weight * out.aux["balance_loss"] + \
            router.z_loss_weight * out.aux["z_loss"]
        # As in translation: "per_token" weights the micro-batch's auxiliary losses by its
        # tokens (the update's objective is mean NLL + weight * loss), "per_batch" adds them once.
        aux_scale = tokens if router.balance_normalization == "per_token" else 1.0
        metrics = {**sums, "balance_loss": out.aux["balance_loss"] * tokens,
                   "z_loss": out.aux["z_loss"] * tokens,
                   "moe": jax.tree.map(lambda v: v * tokens, out.aux["moe"])}
        return sums["nll"] + aux * aux_scale, metrics

    def summarize(self, m):
        tokens = jnp.maximum(m["tokens"], 1.0)
        loss = m["nll"] / tokens
        return tokens, {
            "loss": loss,
            "ppl": jnp.exp(jnp.minimum(loss, 700.0)),
            "bits_per_byte": m["nll"] / (math.log(2) * jnp.maximum(m["bytes"], 1.0)),
            "accuracy": m["correct"] / tokens,
            "balance_loss": m["balance_loss"] / tokens,
            "z_loss": m["z_loss"] / tokens,
            "tokens": m["tokens"],
            # Each MoE layer's loads and router diagnostics, token-weighted over micro-batches.
            "moe": jax.tree.map(lambda v: v / tokens, m["moe"]),
        }

    def evaluate(self, model: CausalLM, batch, key):
        del key  # the deterministic forward draws nothing
        out = _forward(model, batch, deterministic=True)
        return next_token_sums(out.logits, batch["tokens"], batch["targets"], batch["bytes"])

    @property
    def tracks_routing(self) -> bool:
        """Fine-tuning logs what it does to the checkpoint's routing at each evaluation
        (:mod:`sparsemixer_jax.training.routing_watch`)."""
        return bool(self.init_from)

    def routing_choices(self, model: CausalLM, batch):
        """Each MoE layer's chosen experts per token ``[B, T, k]`` (a model that reports them:
        :func:`sparsemixer_jax.moe.layer.report_choices`) and the mask of real tokens."""
        out = _forward(model, batch, deterministic=True)
        return ({name: m["choices"] for name, m in out.aux["moe"].items()},
                batch["segments"] != 0)

    def for_platform(self, platform: str) -> LMTask:
        """This task with ``dispatch="auto"`` resolved for ``platform`` (a JAX platform name),
        not for the machine that traces it: the compile command's programs for a target."""
        from sparsemixer_jax.moe.dispatch import resolve_dispatch

        run = self.lm.execution
        dispatch = resolve_dispatch(run.dispatch, platform)
        return dataclasses.replace(self, lm=self.lm.replace(
            execution=dataclasses.replace(run, dispatch=dispatch)))

    # -- on the host

    def tokenizer(self, workdir: str, paragraphs=None,
                  documents=None) -> lm_text.LMTokenizer:
        """The run's tokenizer: the checkpoint's ``tokenizer.json``; from scratch
        ``{workdir}/spm.model`` (trained on ``paragraphs()`` on first use) or, with
        ``data.tokenizer="bpe"``, ``{workdir}/tokenizer.json`` (trained on a seeded sample of
        ``documents()``, each a list of paragraphs)."""
        from sparsemixer_jax import hf

        d = self.data
        if self.init_from:
            return lm_text.HFTokenizerLM(hf.load_tokenizer(self.init_from),
                                         lm_text.hf_bos_id(self.lm.hf))
        if d.tokenizer == "bpe":
            if not os.path.exists(os.path.join(workdir, "tokenizer.json")):
                sample = vocabulary_sample(documents(), d.vocab_sample_sentences, d.seed)
                bpe.train_bpe(["\n".join(doc) for doc in sample], workdir, d.vocab_size)
            return lm_text.HFTokenizerLM(hf.load_tokenizer(workdir), lm_text.hf_bos_id(self.lm.hf))
        needed = not os.path.exists(os.path.join(workdir, "spm.model"))
        spm = text.get_text_tokenizer(
            text.TextDataConfig(train=d.train, valid="", vocab_size=d.vocab_size, seq_len=8,
                                batch_size=1, seed=d.seed,
                                vocab_sample_sentences=d.vocab_sample_sentences,
                                spm_model_type=d.spm_model_type,
                                character_coverage=d.character_coverage),
            workdir, paragraphs() if needed and paragraphs is not None else ())
        return lm_text.SentencePieceLM(spm)

    def load_data(self, workdir: str, batch_multiple: int) -> TaskData:
        """Reads the documents or rows (only when the packing cache lacks them), trains the
        vocabulary on first use, packs every split."""
        d = self.data
        if d.micro % batch_multiple:
            raise ValueError(f"config.data: a micro-batch of {d.micro} rows does not split over "
                             f"the mesh's {batch_multiple} devices; make data.micro_batch_size "
                             f"(or data.batch_size) a multiple of {batch_multiple}")
        documents: dict[str, Any] = {}

        def split(name: str):
            if not documents:
                source = text.read_documents(d.train) if d.format == "text" else \
                    chat.read_rows(text.text_files(d.train))
                documents["train"], documents["valid"] = lm_text.split_documents(d, source)
            return documents[name]

        if self.init_from and is_main_process():
            keep_checkpoint_files(self.init_from, workdir)
        if not is_main_process():  # process 0 trains the vocabulary, the others then read it
            wait_for_all_processes("vocabulary ready")
        # From scratch is text only (chat rows need a checkpoint's tokenizer: from_config).
        tokenizer = self.tokenizer(workdir, lambda: [p for doc in split("train") for p in doc],
                                   lambda: split("train"))
        if is_main_process():
            wait_for_all_processes("vocabulary ready")
        if self.init_from:
            check_tokenizer_fits(tokenizer, self.lm.arch.vocab_size, self.init_from)
        cache = os.path.join(workdir, "packed")
        files = text.text_files(d.train)
        write = is_main_process()
        train_split = lm_text.pack_split(d, cache, "lm-train", files, tokenizer,
                                         lambda: split("train"), write)
        valid_split = lm_text.pack_split(d, cache, "lm-valid", files, tokenizer,
                                         lambda: split("valid"), write)
        held_out = {}
        for file in text.text_files(d.wikitext) if d.wikitext else ():
            name = lm_text.held_out_name(file)
            held_out[name] = lm_text.pack_split(d, cache, f"lm-wikitext-{name}", [file],
                                                tokenizer, lambda f=file: text.read_documents(f),
                                                write, fmt="text")
        execution = self.lm.execution
        if execution.attention_impl == "cudnn" and execution.cudnn_document_mask == "offsets":
            for name, packed in (("train", train_split), ("valid", valid_split), *held_out.items()):
                check_rows_fit(packed.segments, packed.segments != 0,
                               execution.max_segments_per_row,
                               f"config.data: the {name} split")
        processes = {"process_index": jax.process_index(), "process_count": jax.process_count()}
        batches = lm_text.LMBatches(train_split, d.micro, seed=d.seed, **processes)
        # Evaluation batches split over the mesh too: padded with empty rows to a multiple.
        eval_rows = -(-d.eval_rows // batch_multiple) * batch_multiple
        valid = lm_text.eval_batches(valid_split, eval_rows, **processes)
        stats = {"train": train_split.stats, "valid": valid_split.stats,
                 **{f"wikitext_{k}": v.stats for k, v in held_out.items()}}
        extra = {"tokenizer": tokenizer, "held_out": held_out, "valid_split": valid_split,
                 "eval_rows": eval_rows, "batch_multiple": batch_multiple,
                 "unigram": lm_text.unigram_log_probs(train_split, self.lm.arch.vocab_size)}
        return TaskData(train=batches, valid=valid, vocab_size=self.lm.arch.vocab_size, stats=stats,
                        micro_batches=d.batch_size // d.micro, extra=extra)

    def build_model(self, run, vocab_size: int, mesh) -> CausalLM:
        """From scratch: a fresh model seeded from ``run.seed``; fine-tuning: the
        checkpoint's weights. In training mode either way."""
        del vocab_size  # the LMConfig's (checked against the tokenizer)
        seed = run.seed
        if self.init_from:
            from sparsemixer_jax import hf

            model, _ = hf.load_pretrained(self.init_from, seed=seed, mesh=mesh,
                                          rules=run.mesh.rules,
                                          **_changes(self.lm, self.init_from))
        else:
            model = CausalLM(self.lm, mesh=mesh, rngs=nnx.Rngs(params=seed, router=seed + 2))
            if mesh is not None:  # by the mesh section's rules, as the optimizer state will be
                sharding.shard_state(model, mesh, run.mesh.rules)
        model.train()
        return model

    def validation_metrics(self, total) -> dict[str, float]:
        t = {k: float(total[k]) for k in _SUMS}
        return {**per_token_metrics(t["nll"], t["tokens"], t["bytes"], "valid"),
                "valid_accuracy": t["correct"] / max(t["tokens"], 1.0),
                "valid_tokens": t["tokens"], "valid_bytes": t["bytes"]}

    def finish(self, run: Run) -> dict[str, Any]:
        """The second held-out set, the unigram baseline and the generated sample."""
        extra = run.data.extra
        key = jax.random.key(run.config.seed + 5)
        out = lm_text.unigram_metrics(extra["unigram"], extra["valid_split"], "unigram")
        for name, split in extra["held_out"].items():
            batches = lm_text.eval_batches(split, extra["eval_rows"],
                                           process_index=jax.process_index(),
                                           process_count=jax.process_count())
            metrics = evaluate(run.steps, run.state, batches, run.place, self, key)
            for k in ("loss", "ppl", "bits_per_byte"):
                out[f"wikitext_{name}_{k}"] = metrics[f"valid_{k}"]
            out.update(lm_text.unigram_metrics(extra["unigram"], split,
                                               f"wikitext_{name}_unigram"))
        if self.sample.tokens and jax.process_count() == 1:
            out["samples"] = generate_samples(run.steps.model(run.state), extra["tokenizer"],
                                              self.sample, run.config.seed,
                                              rows=extra["batch_multiple"],
                                              as_chat=self.data.format == "chat")
            if is_main_process():
                with open(os.path.join(run.workdir, "sample.txt"), "w") as f:
                    f.write("\n\n".join(out["samples"]) + "\n")
        return out


def _changes(lm: LMConfig, path: str) -> dict[str, Any]:
    """The fields of ``lm`` that differ from the checkpoint's own config (the overrides)."""
    from sparsemixer_jax import hf

    own = hf.from_hf(hf.read_config(path))
    return {f.name: getattr(lm, f.name) for f in dataclasses.fields(LMConfig)
            if getattr(lm, f.name) != getattr(own, f.name)}


def _checkpoint_config(path: str, router: RouterConfig, execution: LMExecution,
                       init_router: str, data_format: str = "text") -> LMConfig:
    """The :class:`LMConfig` a fine-tuning run trains: the checkpoint's, with the model
    section's execution settings and (``init_router="config"``) the router section.
    One-line ValueErrors for a directory that is not a checkpoint, an unsupported type, a
    refused key, a missing shard or tokenizer, or no chat template (``chat`` data) or eos
    token (``prompt_completion``)."""
    from sparsemixer_jax import hf

    where = f"config.init_from={path!r}"
    try:
        cfg = hf.read_config(path)
        overrides: dict[str, Any] = {"execution": execution}
        if init_router == "config":
            check_router_for_lm(router, cfg.get("model_type", ""))
            overrides.update(router_overrides(router, cfg.get("model_type", ""),
                                              over_type=False))
        lm = hf.from_hf(cfg, **overrides)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ValueError(f"{where}: no tokenizer.json (fine-tuning tokenizes with the "
                         "checkpoint's own tokenizer)")
    try:  # a garbled tokenizer.json or tokenizer_config.json: one line, before any data
        tokenizer = hf.load_tokenizer(path)
        if data_format != "text":
            _check_rows_tokenizer(tokenizer, data_format)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return lm


def _check_rows_tokenizer(tokenizer: Any, data_format: str) -> None:
    """What encoding ``chat`` rows (a chat template that parses, jinja2 installed) or
    ``prompt_completion`` rows (an eos token) needs of the checkpoint's tokenizer."""
    if data_format == "prompt_completion":
        if tokenizer.token_id("eos_token") is None:
            raise ValueError("prompt_completion rows end with the eos token, and the tokenizer "
                             "names none (tokenizer_config.json's eos_token)")
        return
    if tokenizer.chat_template is None:
        raise ValueError("config.data.format='chat' renders rows with the checkpoint's chat "
                         "template, and it has none (tokenizer_config.json's chat_template or "
                         "chat_template.jinja)")
    chat.compile_template(tokenizer.chat_template)


def keep_checkpoint_files(path: str, workdir: str) -> None:
    """Copies the checkpoint's :data:`KEPT_FILES` into ``{workdir}/KEPT_DIR`` once (a resumed
    run keeps the first copies), each written whole or not at all."""
    kept = os.path.join(workdir, KEPT_DIR)
    if os.path.isdir(kept):
        return
    partial = f"{kept}.tmp{os.getpid()}"
    os.makedirs(partial, exist_ok=True)
    for name in KEPT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            shutil.copyfile(os.path.join(path, name), os.path.join(partial, name))
    os.replace(partial, kept)


def check_tokenizer_fits(tokenizer: lm_text.HFTokenizerLM, vocab_size: int, path: str) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"{path!r}: tokenizer.json has {tokenizer.vocab_size} tokens but the "
                         f"model's vocab_size is {vocab_size}")


def generate_samples(model: CausalLM, tokenizer: lm_text.LMTokenizer, sample: SampleConfig,
                     seed: int, rows: int = 1, as_chat: bool = False) -> list[str]:
    """``prompt + continuation`` for each prompt of ``sample`` (deterministic routing). Each
    prompt is decoded as a batch of ``rows`` copies (the rows a mesh splits a batch into) and
    the first row is kept. ``as_chat``: each prompt is a user turn in the checkpoint's chat
    template, the continuation the assistant's answer up to its eos token."""
    from sparsemixer_jax.models.lm_generate import generate

    model.eval()
    texts = []
    key = jax.random.key(seed + 7)
    stop = tokenizer.bos_id  # a new document: the sample ends there
    if as_chat and tokenizer.hf.token_id("eos_token") is not None:
        stop = tokenizer.hf.token_id("eos_token")  # the end of the answer
    for i, prompt in enumerate(sample.prompts()):
        if as_chat:
            ids = chat.generation_prompt(tokenizer.hf, prompt)
        else:
            ids = [tokenizer.bos_id] + (tokenizer.encode_batch([prompt])[0] if prompt else [])
        out = generate(model, jnp.asarray([ids] * rows, jnp.int32), sample.tokens,
                       temperature=sample.temperature, top_k=sample.top_k or None,
                       key=jax.random.fold_in(key, i) if sample.temperature else None)
        continuation = [int(t) for t in np.asarray(out[0, len(ids):])]
        if stop in continuation:
            continuation = continuation[: continuation.index(stop)]
        texts.append(tokenizer.decode(ids[0 if as_chat else 1:] + continuation))
    return texts


def train_lm(config: ml_collections.ConfigDict, workdir: str,
             given: tuple[str, ...] = ()) -> dict[str, Any]:
    """Trains (resuming from ``workdir`` if it holds a checkpoint); writes results.json.

    ``given``: the config fields set on the command line (``"router.score"``); fine-tuning with
    the checkpoint's routing refuses a routing field among them, which it would ignore.

    Raises ValueError (one line) for a bad config or checkpoint before anything is written
    (the checkpoint's weights checked from their headers: every tensor there, of its shape and
    a float dtype), :class:`sparsemixer_jax.training.TrainingDiverged` if the loss becomes
    non-finite."""
    refuse_unused_router_fields(cast(str, config.init_from, "config.init_from"),
                                cast(str, config.init_router, "config.init_router"), given)
    run = run_config(config, LMTask.from_config(config))
    task = run.task
    refuse_overruled_router_fields(task.lm, task.router, given)
    if task.init_from:  # its errors name the file
        from sparsemixer_jax import hf

        hf.check_checkpoint(task.init_from, task.lm)
    task.data.check_files()
    return train(run, workdir)
