"""Compile a config's training and decode steps for hardware this machine does not have.

    python -m experiments.compile --config configs/wmt_n4.py --config.mesh.expert=4 \
        --target tpu:v5e:4x4 --target h100:1x1x8

Targets: ``tpu:<v4|v5e|v5p|v6e>:<topology>`` (libtpu's compile-only slice) and
``h100:1x<hosts>x<gpus>`` (H100 SXM GPUs); the packages they need are in
requirements-compile.txt. Prints per device the memory against the chip's HBM, XLA's FLOP and
byte counts, and the collectives (with ``--roofline``: each program's predicted time, MFU
bound and costliest operations on the target's chip, docs/benchmarks.md "Roofline"); exits 1
when a target does not fit or cannot be compiled for. The code lives in
:mod:`sparsemixer_jax.aot.command`.
"""

from __future__ import annotations

import logging
import sys

from absl import app, flags
from ml_collections import config_flags

from sparsemixer_jax.training import cli

config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_multi_string("target", None, "tpu:v5e:4x4, h100:1x1x8, ... (repeatable).")
flags.DEFINE_bool("decode", True, "Also compile the beam-search decode step.")
flags.DEFINE_string("json", None, "Write the figures here.")
flags.DEFINE_bool("roofline", False, "Also predict each program's time and MFU bound on the "
                  "target's chip from its optimised HLO, with its costliest operations.")
flags.mark_flags_as_required(["config", "target"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.quiet_libraries()
    from sparsemixer_jax.aot import command

    results = command.run(flags.FLAGS.config, flags.FLAGS.target,
                          decode_step=flags.FLAGS.decode, json_path=flags.FLAGS.json,
                          with_roofline=flags.FLAGS.roofline)
    sys.exit(command.exit_code(results))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    app.run(main, flags_parser=cli.parse_flags)
