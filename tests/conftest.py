"""Test set-up, before any test module imports jax (XLA reads its flags once, when JAX starts).

Eight simulated CPU devices for the mesh tests. LLVM optimisation level 0: the tests' models are
tiny, so XLA's compile time, not run time, is most of the suite; level 0 halves it (5.3 to 3.9 min
on 2 cores). Subprocesses that tests start inherit both flags through the environment.

Float32 matmuls at ``highest`` precision: the tests compare float32 numbers at CPU tolerances,
and NVIDIA GPUs would otherwise run them as TF32 (about 1e-3 relative error). CPUs compute float32
matmuls in full precision either way, so CPU results do not change."""

import gc
import os
import sys

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


@pytest.fixture(scope="session")
def last_checkpoint():
    """``read(workdir, steps) -> (params, meta)``: the parameters (numpy) and meta of the last
    checkpoint in ``workdir``, restored into the train state of ``steps``
    (:class:`sparsemixer_jax.training.steps.Steps` of the run's model)."""
    import jax
    import numpy as np

    from sparsemixer_jax.training.state import restore_checkpoint

    def read(workdir, steps):
        restored = restore_checkpoint(workdir, steps.abstract_state(), "last")
        return jax.tree.map(np.asarray, restored.state.params), restored.meta

    return read


@pytest.fixture(scope="module")
def straight_run(task, tmp_path_factory):
    """``(workdir, results)`` of an uninterrupted run of the module's ``task`` (a module-scoped
    :class:`tests.kit.Task` fixture each training-run module defines) with its tiny config: the
    reference for the resume tests. Module-scoped: the module's runs share its compilations."""
    workdir = str(tmp_path_factory.mktemp("straight"))
    return workdir, task.run(workdir)


@pytest.fixture(scope="session")
def electra_run(tmp_path_factory):
    """The tiny ELECTRA of ``tests/tiny_electra_config.py`` pretrained once for the whole test
    run (both pytest-xdist workers: :func:`tests.kit.built_once`), on its generated corpus:
    ``.corpus`` (the directory of ``train.txt`` and ``valid.txt``), ``.workdir`` (the finished
    6-step run) and ``.results`` (what ``pretraining.pretrain`` returned). The straight run of
    ``test_pretrain.py`` and the pretrained model ``test_glue.py`` fine-tunes. Shared by every
    module that uses it: a test that changes the workdir copies it first. Only the files are
    shared; each module compiles its own programs (``free_compiled_programs``)."""
    import types

    from sparsemixer_jax.tasks import pretraining
    from tests import kit, tiny_electra_config

    def build(directory):
        corpus = tiny_electra_config.write_corpus(os.path.join(directory, "corpus"))
        return pretraining.pretrain(kit.tiny_config("pretraining", corpus),
                                    os.path.join(directory, "run"))

    directory, results = kit.built_once(tmp_path_factory, "electra", build)
    return types.SimpleNamespace(corpus=os.path.join(directory, "corpus"),
                                 workdir=os.path.join(directory, "run"), results=results)


@pytest.fixture(scope="session")
def translation_run(tmp_path_factory):
    """``(workdir, results)``: the tiny translation run of ``tests/tiny_wmt_config.py`` without
    test BLEU, trained once for the whole test run (both pytest-xdist workers, as
    ``electra_run``): last and best checkpoints at steps 3 and 6. The finished run that
    ``test_checkpoint.py`` damages copies of and the uninterrupted reference of
    ``test_preemption.py``. Shared: a test that changes the workdir copies it first."""
    from sparsemixer_jax.tasks import translation
    from tests import kit, tiny_wmt_config

    def build(directory):
        return translation.train_and_evaluate(
            tiny_wmt_config.tiny(**{"decode.test_bleu": False}), directory)

    return kit.built_once(tmp_path_factory, "translation", build)


@pytest.fixture(scope="module", autouse=True)
def free_compiled_programs():
    """After each module, JAX's caches of traced and compiled programs are dropped. Each XLA CPU
    program holds its machine code in memory mappings of its own, and a worker that kept every
    program of the modules it ran reached the kernel's limit on mappings per process
    (``vm.max_map_count``, 65,530 by default) and crashed with a segmentation fault in its next
    compile. Cleared after each module, a worker holds about 750 mappings at a module's end
    instead of 11,000 after three modules; modules share few programs, so little is compiled
    twice."""
    yield
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
        gc.collect()
