"""Two processes on this machine stand in for two hosts: each runs the same command with the
variables a cluster sets (``tests/multiprocess.py``: coordinator on localhost, gloo collectives),
with two simulated CPU devices, four devices in all. Each run is compared with the same run in
one process on a mesh of the same shape (four of this test process's eight devices).

- Default run: a Hugging Face checkpoint loaded onto a mesh whose fsdp axis spans the two
  processes gives one process's logits, and ``hf.save_pretrained`` (each tensor gathered from
  both processes) writes one process's files byte for byte, from process 0 alone.
- ``-m slow``: the translation, language-modelling and pretraining commands train, stop and
  resume on two processes and match one process (losses, parameters, translations);
  ``experiments.lm_export`` on two processes writes one process's export of the same checkpoint;
  pretraining sets Admin's scales there as one process does.

Tolerances: the two-process and one-process runs see the same global batches and the same
random keys, and compile the same programs for the same mesh; only the order in which the
cross-device sums (gradients, losses) add their terms may differ (gloo between the processes,
XLA's own in one process), and the two processes use XLA's other elementwise math
(``other_math``), so a tolerance tuned to one host's math library fails here on every host.
Losses within :func:`tests.kit.sum_rtol` of the longest chain of float32 additions into a
gradient element (each test names it); parameters within :func:`tests.kit.adam_parameter_atol`
of that gradient rounding, with Adam in its linear regime (:data:`tests.kit.LINEAR_ADAM`), where
its update is Lipschitz in the gradient. The derivations are in :mod:`tests.kit`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from sparsemixer_jax import hf
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.parallel.partitioning import Partitioner
from sparsemixer_jax.tasks import run_config
from tests import kit, tiny_lm_config
from tests.hf_on_processes import MAX_SHARD_BYTES, WIDTH_WHOLE
from tests.multiprocess import run_processes

HF_CHECKPOINT = os.path.join(os.path.dirname(__file__), "data", "hf", "mixtral")


@nnx.jit
def logits_of(model, ids):
    return model(ids)


def _files(directory: str) -> dict[str, bytes]:
    """Each file's name and content."""
    contents = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            contents[name] = f.read()
    return contents


# Process 0 says so on stderr and hangs (as a process waiting for a dead peer in a collective
# would); process 1 fails once process 0 has spoken.
_ONE_FAILS = """
import os, sys, time
i = int(os.environ["JAX_PROCESS_ID"])
print(f"process {i} of {os.environ['JAX_NUM_PROCESSES']} here", file=sys.stderr, flush=True)
if i == 0:
    open("spoke", "w").close()
    time.sleep(600)
while not os.path.exists("spoke"):
    time.sleep(0.01)
sys.exit(3)
"""


def test_launcher_stops_the_others_when_one_process_fails_and_shows_every_log(tmp_path):
    with pytest.raises(AssertionError) as failure:
        run_processes(["-c", _ONE_FAILS], cwd=str(tmp_path), timeout=60)
    message = str(failure.value)
    assert message.startswith("a process failed; the others were stopped")  # not timed out
    assert "process 0 of 2 here" in message and "process 1 of 2 here" in message
    assert "process 1: exit code 3" in message
    assert "process 0: exit code -9" in message  # stopped, not waited for


def test_hf_checkpoint_loads_onto_two_processes_and_exports_from_process_0(tmp_path):
    """``hf.load_pretrained`` onto a mesh whose fsdp axis spans two processes (no process holds
    a whole matrix) gives one process's logits bit for bit; ``hf.save_pretrained`` there
    writes, from process 0 alone, the files one process writes, byte for byte (three shards
    and the index). Placed again by other rules (``sharding.shard_state``: the shards move
    between the processes), the model still gives one process's logits."""
    out = str(tmp_path / "two")
    os.makedirs(out)
    run_processes(["-m", "tests.hf_on_processes", HF_CHECKPOINT, out], timeout=240)

    mesh = sharding.make_mesh(1, 2, jax.devices()[:4], fsdp=2)
    model, config = hf.load_pretrained(HF_CHECKPOINT, mesh=mesh)
    ids = np.load(os.path.join(HF_CHECKPOINT, "reference.npz"))["input_ids"]
    expected = np.asarray(logits_of(model, ids))
    # Bit for bit: the same programs on the same mesh, and a sum over the two fsdp shards has
    # two terms, which add to the same float in either order.
    np.testing.assert_array_equal(np.load(os.path.join(out, "logits.npy")), expected)
    one = str(tmp_path / "one")
    hf.save_pretrained(model, config, one, max_shard_bytes=MAX_SHARD_BYTES)
    written, reference = _files(os.path.join(out, "0")), _files(one)
    assert written.keys() == reference.keys()
    assert len([n for n in written if n.endswith(".safetensors")]) == 3
    for name, content in reference.items():
        assert written[name] == content, name
    # Process 1 gathered every tensor with process 0 and wrote nothing.
    assert os.listdir(os.path.join(out, "1")) == []
    # Placed again by other rules: each process's shards of the loaded weights resharded.
    sharding.shard_state(model, Partitioner(mesh, WIDTH_WHOLE))
    assert model.embed_tokens.embedding[...].sharding.is_fully_replicated
    np.testing.assert_array_equal(np.load(os.path.join(out, "logits_width_whole.npy")),
                                  np.asarray(logits_of(model, ids)))


# ------------------------------------------------------------------------ training commands


def _command_args(module: str, config: str, workdir: str, overrides: dict) -> list[str]:
    return ["-m", module, "--config", config, "--workdir", workdir,
            *(f"--config.{key}={value}" for key, value in overrides.items())]


def _stop_and_resume(module: str, config: str, workdir: str, overrides: dict,
                     first_steps: int) -> list:
    """Runs ``module`` on two processes for ``first_steps`` updates, then again to the
    config's ``train_steps`` (resuming from the first run's checkpoint); returns each run's
    :class:`tests.multiprocess.Finished` per process."""
    runs = []
    for steps in (first_steps, overrides["train_steps"]):
        runs.append(run_processes(
            _command_args(module, config, workdir, {**overrides, "train_steps": steps}),
            timeout=400, other_math=True))
    return runs


def _check_written_once(runs: list, workdir: str, steps: int) -> None:
    """Process 0 alone printed the results and wrote the metrics (each update logged once);
    both processes wrote their shards of the last checkpoint (orbax's per-process files)."""
    from sparsemixer_jax.training.checkpoint import step_dir

    state = os.path.join(step_dir(workdir, "last", steps), "state")
    for process in (0, 1):
        assert os.listdir(os.path.join(state, f"ocdbt.process_{process}", "d")), process
    for finished in runs:
        assert "results:" in finished[0].stdout
        assert "results:" not in finished[1].stdout
    assert [r["step"] for r in kit.read_metrics(workdir) if "loss" in r] == \
        list(range(1, steps + 1))
    with open(os.path.join(workdir, "results.json")) as f:
        assert json.load(f)["steps"] == steps


def test_a_workdir_in_use_stops_both_processes_before_anything_is_written(tmp_path):
    """Process 0 alone takes the workdir's lock; when another run holds it, process 1 refuses
    too (the processes agree), each on one line, and nothing is written."""
    from sparsemixer_jax.training.workdir_lock import WorkdirLock

    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    lock = WorkdirLock(workdir)
    try:
        finished = run_processes(
            _command_args("experiments.wmt", "tests/tiny_wmt_config.py", workdir,
                          {"mesh.data": 4}),
            check=False, stop_on_failure=False, timeout=120)
    finally:
        lock.release()
    for f in finished:
        assert f.returncode == 2, f.stderr[-3000:]
        assert f"error: workdir {workdir} is in use by another run" in f.stderr
    assert os.listdir(workdir) == ["lock"]


# Four devices: two data-parallel halves each splitting the experts over its own two devices;
# the experts split inside each process and every weight split across the processes (fsdp);
# four experts, one per device, the tokens sent between the processes (all-to-all).
MESHES = {"data_expert": {"mesh.data": 2, "mesh.expert": 2},
          "fsdp_expert": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 2},
          "expert": {"mesh.data": 1, "mesh.expert": 4, "model.num_experts": 4}}
STEPS = 4  # 2 updates, stop, resume, 2 more


@pytest.mark.slow  # four command starts, each importing jax and compiling: python -m pytest -m slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_translation_trains_and_resumes_on_two_processes_as_on_one(tmp_path, mesh,
                                                                   last_checkpoint):
    from sparsemixer_jax import training
    from sparsemixer_jax.tasks import translation

    overrides = {"train_steps": STEPS, "eval_every": 2, "checkpoint_every": 2,
                 **kit.LINEAR_ADAM, **MESHES[mesh]}
    config = kit.tiny_config(**overrides)
    reference = str(tmp_path / "one")
    translation.train_and_evaluate(config, reference)
    workdir = str(tmp_path / "two")
    runs = _stop_and_resume("experiments.wmt", "tests/tiny_wmt_config.py", workdir, overrides,
                            first_steps=2)
    _check_written_once(runs, workdir, STEPS)
    one_device = kit.tiny_config(**{k: v for k, v in overrides.items()
                                    if not k.startswith("mesh.")})
    steps = training.build_steps(run_config(one_device),
                                 config.data.vocab_size)
    # 1,024 token positions an update, more than 2 layers x the vocab (128).
    kit.assert_same_training(workdir, reference, 1024,
                             lambda w: last_checkpoint(w, steps))
    # Test-set beam search: each process decodes its rows; process 0 writes them in file order.
    for name in ("translations_last.txt", "translations_best.txt"):
        with open(os.path.join(reference, name)) as f, open(os.path.join(workdir, name)) as g:
            assert g.read() == f.read(), name


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """``(corpus, one-process workdir, two-process workdir, two-process runs)`` of the tiny LM
    on a ``fsdp=2 x expert=2`` mesh (every weight split across the processes), the two-process
    run stopped after 2 updates and resumed."""
    from sparsemixer_jax.tasks import language_model

    corpus = tiny_lm_config.write_corpus(str(tmp_path_factory.mktemp("corpus")))
    overrides = {"train_steps": STEPS, "eval_every": 2, "checkpoint_every": 2,
                 **kit.LINEAR_ADAM, "mesh.fsdp": 2, "mesh.expert": 2}
    reference = str(tmp_path_factory.mktemp("one"))
    language_model.train_lm(kit.tiny_config("lm", corpus, **overrides), reference)
    workdir = str(tmp_path_factory.mktemp("two"))
    runs = _stop_and_resume("experiments.lm", f"tests/tiny_lm_config.py:{corpus}", workdir,
                            overrides, first_steps=2)
    return corpus, reference, workdir, runs


@pytest.mark.slow
def test_language_model_trains_and_resumes_on_two_processes_as_on_one(lm_runs, last_checkpoint):
    from sparsemixer_jax import training

    corpus, reference, workdir, runs = lm_runs
    _check_written_once(runs, workdir, STEPS)
    config = kit.tiny_config("lm", corpus)
    steps = training.build_steps(run_config(config), config.data.vocab_size)
    # 128 tokens an update, fewer than 2 layers x the vocab (120).
    kit.assert_same_training(workdir, reference, 240,
                             lambda w: last_checkpoint(w, steps))


@pytest.mark.slow
def test_lm_export_on_two_processes_writes_one_process_export(lm_runs, tmp_path):
    """``experiments.lm_export`` on two processes, the checkpoint's weights split across them:
    process 0 writes the files that one process's export of the same checkpoint writes."""
    from sparsemixer_jax.tasks import lm_export

    _, _, workdir, _ = lm_runs
    out = str(tmp_path / "two")
    finished = run_processes(["-m", "experiments.lm_export", "--workdir", workdir,
                              "--out", out], timeout=240)
    assert "wrote step 4" in finished[0].stdout
    assert "wrote" not in finished[1].stdout
    one = str(tmp_path / "one")
    lm_export.export_run(workdir, one)
    written, reference = _files(out), _files(one)
    assert written.keys() == reference.keys()
    for name, content in reference.items():
        assert written[name] == content, name


@pytest.mark.slow
def test_pretraining_trains_and_resumes_on_two_processes_as_on_one(tmp_path, last_checkpoint):
    """ELECTRA pretraining (generator and discriminator, both with MoE layers) by
    ``python -m experiments.pretrain`` on a ``fsdp=2 x expert=2`` mesh, stopped after 2 updates
    and resumed, against one process. Admin's initialisation (the config's): every host profiles
    the whole first micro-batch, gathered from the hosts, and sets one process's scales."""
    from sparsemixer_jax import training
    from sparsemixer_jax.tasks import pretraining
    from tests import tiny_electra_config

    corpus = tiny_electra_config.write_corpus(str(tmp_path / "corpus"))
    model = {"model.init": "admin"}
    overrides = {"train_steps": STEPS, "eval_every": 2, "checkpoint_every": 2,
                 **kit.ELECTRA_LINEAR_ADAM, "mesh.fsdp": 2, "mesh.expert": 2, **model}
    reference = str(tmp_path / "one")
    pretraining.pretrain(kit.tiny_config("pretraining", corpus, **overrides), reference)
    workdir = str(tmp_path / "two")
    runs = _stop_and_resume("experiments.pretrain", f"tests/tiny_electra_config.py:{corpus}",
                            workdir, overrides, first_steps=2)
    _check_written_once(runs, workdir, STEPS)
    config = kit.tiny_config("pretraining", corpus, **model)
    steps = training.build_steps(run_config(config), config.data.vocab_size)
    # 128 tokens an update, fewer than 3 layers (generator and discriminator) x the vocab (120).
    kit.assert_same_training(workdir, reference, 360,
                             lambda w: last_checkpoint(w, steps))
