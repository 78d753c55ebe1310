"""A language-modelling run's checkpoint as a Hugging Face model directory
(``python -m experiments.lm_export``; docs/lm.md).

The export computes what was trained: ``config.json`` records the run's routing under
:data:`sparsemixer_jax.hf.config.ROUTING_KEY`, which :func:`sparsemixer_jax.hf.load_pretrained`
restores and transformers ignores (it computes the type's own routing). Where the two differ at
evaluation, :func:`export_run` measures by how much on the run's validation rows and says so.
A fine-tuned run's tokenizer files come from the copies the run kept in its workdir
(:data:`KEPT_DIR`), so the checkpoint it started from may be gone.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx

from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.models.lm_config import LMConfig
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.routers import RouterConfig
from sparsemixer_jax.tasks import run_config
from sparsemixer_jax.tasks.language_model import KEPT_DIR, KEPT_FILES, LMTask
from sparsemixer_jax.training import config as config_schema
from sparsemixer_jax.training.loop import build_steps

#: ``routing=``: ``"trained"`` records the routing the run trained with (restored by
#: ``hf.load_pretrained``), ``"type"`` the type's own (what transformers computes).
ROUTINGS = ("trained", "type")
#: Validation rows the logits of the two routings are compared on.
MEASURED_ROWS = 4
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_run(workdir: str, out_dir: str, checkpoint: str = "last", dtype: str = "float32",
               routing: str = "trained", force: bool = False) -> dict[str, Any]:
    """Writes the ``checkpoint`` (``"last"`` or ``"best"``) of the language-modelling run in
    ``workdir`` as a Hugging Face directory (:func:`sparsemixer_jax.hf.save_pretrained`).

    ``routing``: ``"trained"`` records the run's routing in ``config.json``; a learned selection
    bias is written as the type's ``e_score_correction_bias`` and refused for a type without
    one, as are Default MoE's default vectors at evaluation. ``"type"`` writes the type's own
    routing (no selection bias unless the type has one). A fine-tuned run also writes the
    checkpoint's ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
    ``generation_config.json`` (and ``chat_template.jinja``), those the checkpoint lacked made
    from its tokenizer and ``config.json``; a run from scratch its SentencePiece model as
    ``spm.model`` (documents start with its id 1), or its BPE vocabulary
    (``data.tokenizer="bpe"``) as a fine-tuned run's files. ``force``: overwrite a non-empty
    ``out_dir``.

    Returns ``{"step", "model_type", "files", "routing_note"}``: the note is one line when the
    routing transformers computes differs from the trained one at evaluation (with the logit
    difference measured on a few validation rows), else None. One-line errors for a workdir
    that is not a language-modelling run or holds no such checkpoint, an ``out_dir`` that
    cannot receive the export (:func:`check_out_dir`) and a routing the checkpoint cannot hold.

    With several processes every one calls this (each restores its shards; the gathers are
    collective) and process 0 writes; the difference is then not measured.
    """
    from sparsemixer_jax import hf

    if checkpoint not in ("best", "last"):
        raise ValueError(f"checkpoint must be 'best' or 'last', got {checkpoint!r}")
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    check_out_dir(out_dir, force)
    config, task = open_run(workdir, checkpoint)
    source = task.init_from
    trained = task.lm
    own = hf.from_hf(hf.without_routing_record(hf.to_hf(trained)))  # transformers' routing
    written = _written_config(trained, own, routing)
    model, step = restore_model(workdir, config, task, checkpoint)
    differs = _routing_in_effect(own) != _routing_in_effect(trained)
    rows = _validation_rows(workdir) if differs and jax.process_count() == 1 else None
    trained_logits = None if rows is None else np.asarray(_logits(model, *rows))
    if jax.process_index() == 0:
        _clear_model_files(out_dir)
    hf.save_pretrained(model, written, out_dir, dtype=dtype)
    del model
    if jax.process_index() == 0:
        if source or task.data.tokenizer == "bpe":  # a run from scratch keeps its own
            _write_tokenizer_files(source or workdir, out_dir, hf.read_config(out_dir))
        else:
            shutil.copyfile(os.path.join(workdir, "spm.model"), os.path.join(out_dir, "spm.model"))
    note = None
    if differs:
        measured, gap = _measured(out_dir, trained, own, rows, trained_logits, workdir)
        if gap != 0.0:  # else the two differ in training only (a jitter, say)
            note = _routing_note(trained, own, routing, measured)
    return {"step": step, "model_type": trained.arch.model_type,
            "files": sorted(os.listdir(out_dir)), "routing_note": note}


def open_run(workdir: str, checkpoint: str = "last"
             ) -> tuple[ml_collections.ConfigDict, LMTask]:
    """The config and task of the language-modelling run in ``workdir``, before any weights
    are read; a fine-tuned run's ``init_from`` points at the files it kept (:data:`KEPT_DIR`),
    so the checkpoint it started from may be gone. One-line errors for a workdir that is not
    such a run or holds no ``checkpoint`` (``"last"`` or ``"best"``) yet."""
    from sparsemixer_jax.training.checkpoint import list_checkpoints

    config = _run_config(workdir)
    if not list_checkpoints(workdir, checkpoint):
        raise FileNotFoundError(f"{workdir} holds no {checkpoint} checkpoint yet")
    if config.init_from and os.path.isdir(os.path.join(workdir, KEPT_DIR)):
        config.init_from = os.path.join(workdir, KEPT_DIR)
    return config, LMTask.from_config(config)


def restore_model(workdir: str, config: ml_collections.ConfigDict, task: LMTask,
                  checkpoint: str = "last") -> tuple[CausalLM, int]:
    """The model of the run's ``checkpoint`` (``config`` and ``task`` from :func:`open_run`)
    and its step; the optimizer state is restored and dropped."""
    from sparsemixer_jax.training.state import restore_checkpoint

    # Built as from scratch (init_from's weights are not read): the model's structure is the
    # config's; its weights come from the run's checkpoint.
    run = run_config(config, dataclasses.replace(task, init_from=""))
    steps = build_steps(run, task.lm.arch.vocab_size, sharding.device_mesh(run.mesh))
    restored = restore_checkpoint(workdir, steps.abstract_state(), checkpoint)
    if restored is None:
        raise FileNotFoundError(f"{workdir} holds no {checkpoint} checkpoint")
    return steps.model(restored.state), restored.step


def check_out_dir(out_dir: str, force: bool = False) -> None:
    """Raises a one-line ValueError, before anything is read or written, if ``out_dir`` cannot
    receive an export: it is a file, a non-empty directory (unless ``force``), or a directory
    this process cannot write; or, where it does not exist yet, the nearest existing directory
    above it (the export creates the missing ones, as ``mkdir -p``) is a file or not writable."""
    if os.path.isdir(out_dir):
        if os.listdir(out_dir) and not force:
            raise ValueError(f"{out_dir} is not empty ({len(os.listdir(out_dir))} entries); "
                             "--force overwrites it")
        if not os.access(out_dir, os.W_OK | os.X_OK):
            raise ValueError(f"{out_dir} is not writable")
        return
    if os.path.lexists(out_dir):
        raise ValueError(f"{out_dir} exists and is not a directory: an export writes a directory "
                         "(config.json, safetensors, tokenizer files); name a new or empty one")
    above = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"cannot create {out_dir}: {above} is not a directory")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create {out_dir}: {above} is not writable")


def _run_config(workdir: str) -> ml_collections.ConfigDict:
    config_path = os.path.join(workdir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: is {workdir} a run of experiments.lm?")
    with open(config_path) as f:
        raw = json.load(f)
    if "model_type" in raw and "task" not in raw:  # a model's config.json, not a run's
        raise ValueError(f"{workdir} is a Hugging Face model directory, not a run of "
                         "experiments.lm")
    config = ml_collections.ConfigDict(raw)
    if config_schema.task_of(config) != "lm":
        raise ValueError(f"{workdir} holds a {config_schema.task_of(config)} run, not a "
                         "language-modelling run (experiments.lm)")
    return config


def _routing_fields(lm: LMConfig) -> dict[str, Any]:
    from sparsemixer_jax.hf.config import ROUTING_FIELDS

    return {field: getattr(lm, field) for field in ROUTING_FIELDS.values()}


def _routing_in_effect(lm: LMConfig) -> dict[str, Any]:
    """The routing fields with the options at their defaults left out (a type's config spells
    out its defaults, a run's router section does not)."""
    defaults = RouterConfig()
    fields = _routing_fields(lm)
    fields["router_options"] = {k: v for k, v in lm.router_option_dict().items()
                                if getattr(defaults, k, None) != v}
    return fields


def _written_config(trained: LMConfig, own: LMConfig, routing: str) -> LMConfig:
    """The config the export writes: the trained one, or (``routing="type"``) with the type's
    own routing. What the trained routing cannot write is refused in one line."""
    from sparsemixer_jax.hf.families import SELECTION_BIAS, types_with

    if routing == "type":
        return trained.replace(**_routing_fields(own))
    options = dict(trained.router_options)
    rate = options.get("bias_update_rate", 0.0)
    if rate and not trained.selection_bias:
        with_bias = types_with(lambda f: SELECTION_BIAS in f.moe_names)
        raise ValueError(
            f"the run learned a selection bias (router.bias_update_rate={rate}) and "
            f"{trained.arch.model_type} checkpoints have no place for one (types with "
            f"e_score_correction_bias: {', '.join(with_bias)}); --routing=type writes "
            f"{trained.arch.model_type}'s own routing without it")
    if trained.router == "default_moe_forward" and options.get("default_at_eval", True):
        raise ValueError(
            "router default_moe_forward adds its experts' default vectors to the output at "
            "evaluation, and a checkpoint has no place for them; --routing=type writes "
            f"{trained.arch.model_type}'s own routing without them")
    return trained


def _validation_rows(workdir: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The first :data:`MEASURED_ROWS` packed validation rows of the run (``tokens``,
    ``segments``), or None if its packing cache is gone."""
    found = sorted(glob.glob(os.path.join(workdir, "packed", "lm-valid-*.npz")))
    if not found:
        return None
    with np.load(found[0]) as packed:
        tokens, segments = packed["tokens"], packed["segments"]
    keep = np.flatnonzero((segments != 0).any(axis=1))[:MEASURED_ROWS]
    return tokens[keep].astype(np.int32), segments[keep].astype(np.int32)


@nnx.jit
def _logits(model, tokens, segments):
    """The deterministic forward's logits ``[B, T, V]`` of packed rows."""
    return model.forward(tokens, segment_ids=segments, token_mask=segments != 0,
                         deterministic=True).logits


def _measured(out_dir: str, trained: LMConfig, own: LMConfig, rows, trained_logits,
              workdir: str) -> tuple[str, float | None]:
    """How far the exported model, routed as its type routes, is from the trained model on
    ``rows`` (the trained model's logits ``trained_logits``): in words, and the largest
    difference (None: not measured)."""
    from sparsemixer_jax import hf

    if jax.process_count() > 1:
        return "not measured on several processes", None
    if rows is None:
        return f"not measured: {workdir}/packed holds no validation rows", None
    kept = ("compute_dtype", "dispatch", "grouped_impl", "capacity_factor", "attention_impl")
    model, _ = hf.load_pretrained(out_dir, **{f: getattr(trained.execution, f) for f in kept},
                                  **_routing_fields(own))
    real = rows[1] != 0
    gap = np.abs(np.asarray(_logits(model, *rows)) - trained_logits)[real]
    return (f"on {int(real.sum())} tokens of {len(real)} validation rows its logits differ "
            f"from the trained model's by up to {gap.max():.3g} (mean {gap.mean():.3g})",
            float(gap.max()))


def _describe(lm: LMConfig) -> str:
    """A routing in a few words: router, top-k and its options."""
    details = [f"top-{lm.top_k}", *(f"{k}={v}" for k, v in lm.router_options)]
    if lm.jitter_eps:
        details.append(f"jitter_eps={lm.jitter_eps}")
    if lm.router_option_dict().get("normalize_top_k"):  # for the routers that renormalise
        details.append("norm_topk_prob")
    return f"{lm.router} ({', '.join(details)})"


def _routing_note(trained: LMConfig, own: LMConfig, routing: str, measured: str) -> str:
    from sparsemixer_jax.hf.config import ROUTING_KEY

    kind = trained.arch.model_type
    if routing == "type":
        return (f"--routing=type: the export routes as {kind} does, {_describe(own)}, not as "
                f"trained, {_describe(trained)}: {measured}")
    return (f"transformers computes {kind}'s own routing, {_describe(own)}, not the trained "
            f"{_describe(trained)}: {measured}; hf.load_pretrained restores the trained "
            f"routing ({ROUTING_KEY} in config.json); --routing=type writes {kind}'s own")


def _clear_model_files(out_dir: str) -> None:
    """Removes an earlier export's weights from ``out_dir`` (stale shards would stay)."""
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else ():
        if name.endswith(".safetensors") or name.endswith(".safetensors.index.json"):
            os.remove(os.path.join(out_dir, name))


def _write_tokenizer_files(source: str, out_dir: str, config: dict[str, Any]) -> None:
    """The checkpoint's tokenizer and generation files (:data:`KEPT_FILES`) from ``source``;
    those it lacks, made as transformers makes them: the special tokens from its tokenizer,
    the generation config's token ids from ``config`` (``config.json``)."""
    from sparsemixer_jax import hf

    for name in KEPT_FILES:
        if name != "config.json" and os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    special = hf.load_tokenizer(source).special_tokens
    made = {SPECIAL_TOKENS_MAP: special,
            TOKENIZER_CONFIG: {"tokenizer_class": "PreTrainedTokenizerFast", **special},
            GENERATION_CONFIG: {k: config[k] for k in TOKEN_ID_KEYS
                                if config.get(k) is not None}}
    for name, content in made.items():
        if not os.path.isfile(os.path.join(out_dir, name)):
            with open(os.path.join(out_dir, name), "w") as f:
                json.dump(content, f, indent=2)
