"""Exports a language-modelling run's checkpoint as a Hugging Face model directory.

    python -m experiments.lm_export --workdir runs/lm_quickstart --out runs/lm_quickstart_hf
    python -m experiments.lm_export --workdir runs/lm_finetune --out hf_dir --checkpoint best

Writes ``config.json`` and safetensors that transformers' ``AutoModelForCausalLM`` loads (and
:func:`sparsemixer_jax.hf.load_pretrained`), plus the tokenizer: a fine-tuned run's
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and
``generation_config.json``, a run from scratch's SentencePiece ``spm.model`` (docs/lm.md).

``config.json`` records the routing the run trained with, which ``hf.load_pretrained`` restores;
transformers computes the type's own. Where the two differ at evaluation, one printed line says
so with the logit difference measured on a few validation rows. ``--routing=type`` writes the
type's own routing instead. An existing non-empty ``--out`` is refused without ``--force``, a
file or an unwritable place at once, in one line; missing directories are created.

On several hosts, run the same command on every host, as for training: each restores its own
shards of the checkpoint, every tensor is gathered from them in turn, and process 0 writes.
"""

from __future__ import annotations

import sys

from absl import app, flags

from sparsemixer_jax.training import cli

flags.DEFINE_string("workdir", None, "The run's directory (experiments.lm).")
flags.DEFINE_string("out", None, "The Hugging Face directory to write (created with its "
                    "missing parents; an existing one must be empty, or --force).")
flags.DEFINE_enum("checkpoint", "last", ["last", "best"], "Which checkpoint to export.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "The saved tensors' dtype.")
flags.DEFINE_enum("routing", "trained", ["trained", "type"],
                  "Record the routing the run trained with (restored by hf.load_pretrained), "
                  "or write the type's own (what transformers computes).")
flags.DEFINE_bool("force", False, "Overwrite a non-empty --out.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.initialize_distributed()
    cli.quiet_libraries()
    import jax

    from sparsemixer_jax.tasks.lm_export import export_run
    from sparsemixer_jax.training.checkpoint import CheckpointError

    f = flags.FLAGS
    try:
        written = export_run(f.workdir, f.out, f.checkpoint, f.dtype, routing=f.routing,
                             force=f.force)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if jax.process_index() == 0:
        print(f"wrote step {written['step']} of {f.workdir} as a {written['model_type']} "
              f"checkpoint to {f.out}: {', '.join(written['files'])}")
        if written["routing_note"]:
            print(f"note: {written['routing_note']}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
