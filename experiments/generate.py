"""Continues a prompt with a language model and prints the text it writes.

    python -m experiments.generate --model hf_dir --prompt "Once upon a time"
    python -m experiments.generate --model hf_dir --chat "What is 2 plus 2?"
    python -m experiments.generate --workdir runs/lm_quickstart --prompt "The" --temperature 0.8

``--model`` is a Hugging Face directory (config.json, safetensors, tokenizer.json), ``--workdir``
a run of ``experiments.lm`` (its last checkpoint, or ``--checkpoint best``, with the tokenizer
it trained with). ``--prompt`` starts a document; ``--chat`` is a user turn rendered with the
checkpoint's chat template and its generation prompt. Decoding is greedy unless
``--temperature`` is above 0, and stops at the tokenizer's end token
(:mod:`sparsemixer_jax.tasks.lm_complete`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model", help="a Hugging Face model directory")
    add("--workdir", help="a language-modelling run's directory (experiments.lm)")
    add("--checkpoint", default="last", choices=["last", "best"],
        help="the run's checkpoint (--workdir)")
    add("--prompt", default="", help="text the continuation follows (a document's start)")
    add("--chat", help="a user message, rendered with the chat template")
    add("--max-new-tokens", type=int, default=64)
    add("--temperature", type=float, default=0.0, help="0: greedy")
    add("--top-k", type=int, default=None)
    add("--top-p", type=float, default=None)
    add("--seed", type=int, default=0, help="the sampling key's seed")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> str:
    args = parse_args(argv)
    from sparsemixer_jax.training import cli

    cli.quiet_libraries()
    from sparsemixer_jax.tasks import lm_complete
    from sparsemixer_jax.training.checkpoint import CheckpointError

    try:
        if args.chat is not None and args.prompt:
            raise ValueError("give --prompt or --chat, not both")
        source = lm_complete.load_source(args.model, args.workdir, args.checkpoint)
        text = lm_complete.complete(
            source, args.prompt if args.chat is None else args.chat, args.max_new_tokens,
            chat_turn=args.chat is not None, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed)
    except (ValueError, FileNotFoundError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(text)
    return text


if __name__ == "__main__":
    main()
