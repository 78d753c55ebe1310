"""Tests that only mean something on a GPU (skipped elsewhere): deterministic mode.

XLA:GPU's reductions and scatter-adds are not deterministic by default, so a resumed run can
differ from the uninterrupted one in the last digits (an H100 run measured the 6th digit of the
valid loss). ``config.runtime.deterministic`` sets ``--xla_gpu_deterministic_ops=true``
before JAX starts its backend, which a test process that already runs JAX on the GPU cannot do:
the runs go in a fresh subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda"), reason="needs a GPU")

# Straight 6 steps, and 3 steps then resumed to 6, in one process with deterministic GPU ops set
# through config.runtime (train_and_evaluate applies it before the backend starts). Prints the
# two valid losses and whether every parameter is bitwise equal.
_SCRIPT = """
import json, sys
import jax, numpy as np
from sparsemixer_jax.tasks import run_config
from sparsemixer_jax.tasks import translation
from sparsemixer_jax import training
from sparsemixer_jax.training.state import restore_checkpoint
from tests import tiny_wmt_config

def tiny(steps):
    c = tiny_wmt_config.get_config()
    c.train_steps = steps
    c.runtime.deterministic = True
    c.decode.test_bleu = False
    return c

def last_params(workdir, config):
    steps = training.build_steps(run_config(config), config.data.vocab_size)
    state = restore_checkpoint(workdir, steps.abstract_state(), "last").state
    return jax.tree.leaves(jax.tree.map(np.asarray, state.params))

root = sys.argv[1]
straight = translation.train_and_evaluate(tiny(6), root + "/straight")
translation.train_and_evaluate(tiny(3), root + "/resumed")
resumed = translation.train_and_evaluate(tiny(6), root + "/resumed")
same = all(np.array_equal(a, b) for a, b in zip(last_params(root + "/straight", tiny(6)),
                                                 last_params(root + "/resumed", tiny(6))))
print(json.dumps({"straight": straight["valid_loss"], "resumed": resumed["valid_loss"],
                  "params_equal": same, "backend": jax.default_backend(),
                  "xla_flags": __import__("os").environ.get("XLA_FLAGS", "")}))
"""


def run_resume_check(root: str, platform: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=platform, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", _SCRIPT, root], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_deterministic_mode_makes_resume_bit_exact_on_gpu(tmp_path):
    result = run_resume_check(str(tmp_path), "cuda")
    assert result["backend"] in ("gpu", "cuda")
    assert "--xla_gpu_deterministic_ops=true" in result["xla_flags"]
    assert result["resumed"] == result["straight"]
    assert result["params_equal"]
