"""What the command-line entry points share: the platforms JAX may start, multi-process start-up,
the compilation cache, quiet library logging, config-flag errors, hints.

Library INFO logs (orbax announces every save and restore, TFDS every file) are off unless
``--verbosity`` is given (absl's flag: ``--verbosity=0`` brings back INFO, ``1`` adds DEBUG);
the project's own INFO lines stay. An unknown ``--config.<field>`` override is one line naming
the field and its closest matches, not ml_collections' chain of tracebacks.
"""

from __future__ import annotations

import difflib
import glob
import importlib.util
import logging
import os
import pkgutil
import sys
from importlib import metadata
from typing import Any, NoReturn

from absl import app, flags

# Loggers of the libraries whose INFO lines are noise to a user (orbax logs through absl).
LIBRARY_LOGGERS = ("absl", "orbax", "jax", "tensorflow", "tensorflow_datasets")


# JAX plugins whose hardware jax's own probes can see (NVIDIA and AMD GPUs). Another plugin (a
# simulator, a vendor's device) may run where those probes see nothing, so its presence leaves the
# choice of platforms to JAX.
_PROBED_PLUGINS = ("xla_cuda", "xla_rocm")


def _installed_plugins() -> list[str]:
    """The modules JAX will load as PJRT plugins: the ``jax_plugins`` namespace and entry points."""
    try:
        import jax_plugins
    except ImportError:
        names = []
    else:
        names = [name for _, name, _ in pkgutil.iter_modules(jax_plugins.__path__)]
    names += [e.value.rpartition(".")[2] for e in metadata.entry_points(group="jax_plugins")]
    return names


def _platforms_chosen() -> bool:
    """Whether the user chose JAX's platforms (``JAX_PLATFORMS``, even empty, or jax's config)."""
    import jax

    return "JAX_PLATFORMS" in os.environ or bool(jax.config.jax_platforms)


def _accelerator_visible() -> bool:
    """Whether jax's own probes (those it uses to skip CUDA and to suggest missing plugins) see an
    NVIDIA or AMD GPU or a TPU; True where they cannot tell (another OS, another jax)."""
    if sys.platform != "linux":  # the probes read Linux's /dev and /sys
        return True
    try:
        from jax._src import hardware_utils as probes

        return (probes.has_visible_nvidia_gpu()
                or probes.num_available_tpu_chips_and_device_id()[0] > 0
                or probes.num_available_amd_gpus(stop_at=1) > 0)
    except (ImportError, AttributeError, OSError):
        return True


def cpu_only_where_no_accelerator() -> bool:
    """Start JAX on the CPU alone when this machine has no accelerator that an installed plugin
    could drive, unless the user chose the platforms (``JAX_PLATFORMS``); returns whether it did.

    With no platforms chosen, JAX initialises every installed plugin. The CUDA plugin first checks
    the CUDA libraries it would load on a GPU (``requirements-compile.txt`` installs the plugin to
    compile for H100s, without cuDNN) and a failed check is logged as a 20-line traceback, although
    JAX then skips CUDA on a machine without an NVIDIA GPU anyway; libtpu, tried without a TPU,
    prints its own errors. Neither plugin needs to start for compiling to its hardware
    (:mod:`sparsemixer_jax.aot` loads them for that by itself). Where an NVIDIA or AMD GPU or a
    TPU is visible, or a plugin the probes cannot see the hardware of is installed, nothing
    changes. Call before JAX starts its backend.
    """
    if _platforms_chosen() or _accelerator_visible():
        return False
    if not all(p.startswith(_PROBED_PLUGINS) for p in _installed_plugins()):
        return False
    import jax

    jax.config.update("jax_platforms", "cpu")
    return True


def _multi_process_environment() -> bool:
    env = os.environ
    return (
        "JAX_COORDINATOR_ADDRESS" in env
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
        or "," in env.get("TPU_WORKER_HOSTNAMES", "")
    )


def initialize_distributed() -> None:
    """``jax.distributed.initialize()`` when launched as one of several processes."""
    if not _multi_process_environment():
        return
    import jax

    # CPU hosts need a collectives implementation to talk to each other; GPUs/TPUs ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    env = os.environ
    if "JAX_COORDINATOR_ADDRESS" in env and "JAX_NUM_PROCESSES" in env:
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache in ``~/.cache/sparsemixer_jax/xla``, unless the user
    set ``JAX_COMPILATION_CACHE_DIR`` (which JAX reads itself).

    Every length bucket compiles its own step (tens of seconds each on a CPU); the cache lets
    resumed runs, other seeds and later runs with the same shapes skip that.
    """
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    import jax

    cache = os.path.join(os.path.expanduser("~"), ".cache", "sparsemixer_jax", "xla")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def quiet_libraries() -> None:
    """Library loggers to WARNING unless the user asked for a ``--verbosity``."""
    if flags.FLAGS["verbosity"].present:
        return
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def load_config_file(spec: str) -> Any:
    """``get_config()`` of a config file named as ``--config`` names it (``path[:arg]``)."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_config_for_error", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _config_spec(argv: list[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``path[:arg]``), or None."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if spec is None and "--config" in argv[:-1]:
        spec = argv[argv.index("--config") + 1]
    return spec


def config_file_error(argv: list[str]) -> str | None:
    """A one-line message if the ``--config`` file of ``argv`` is missing or its ``get_config``
    refuses its argument (a wrong variant names the valid ones); None if it loads."""
    spec = _config_spec(argv)
    if spec is None:
        return None
    path = spec.partition(":")[0]
    if not os.path.isfile(path):
        near = sorted(glob.glob(os.path.join(os.path.dirname(path) or ".", "*.py")))
        names = [os.path.basename(n) for n in near if not n.endswith("__init__.py")]
        close = difflib.get_close_matches(os.path.basename(path), names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        return f"--config={spec}: no such config file {path!r}{hint}"
    try:
        load_config_file(spec)
    except ValueError as err:
        return f"--config={spec}: {err}"
    except TypeError:  # a variant given to a get_config() that takes none
        return f"--config={spec}: {path} has no variants; use --config={path}"
    return None


def unknown_config_field(argv: list[str]) -> str | None:
    """A one-line message for the first ``--config.a.b=...`` of ``argv`` that names no field of
    the config file, with the closest field names; None if every override names a field."""
    spec = _config_spec(argv)
    if spec is None:
        return None
    try:
        config = load_config_file(spec)
    except Exception:  # config_file_error reports the file's own errors
        return None
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[len("--config."):].split("=", 1)[0]
        node, done = config, []
        for key in path.split("."):
            if not hasattr(node, "keys") or key not in node:
                fields = sorted(node.keys()) if hasattr(node, "keys") else []
                close = difflib.get_close_matches(key, fields, n=3, cutoff=0.5)
                where = "config" + "".join("." + k for k in done)
                hint = f"did you mean {', '.join(where + '.' + c for c in close)}?" if close else (
                    f"its fields are: {', '.join(fields)}" if fields else f"{where} has no fields")
                return f"--config.{path}: {where} has no field {key!r}; {hint}"
            node = node[key]
            done.append(key)
    return None


def dashed_flags(argv: list[str]) -> list[str]:
    """``argv`` with ``--some-flag`` (and ``--nosome-flag``) spelled ``--some_flag`` wherever that
    names a defined flag: absl only knows the underscore spelling."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "-" in arg[2:].split("=", 1)[0]:
            name, eq, value = arg[2:].partition("=")
            fixed = name.replace("-", "_")
            bare = fixed[2:] if fixed.startswith("no") and eq == "" else fixed
            if bare in flags.FLAGS or fixed in flags.FLAGS:
                arg = f"--{fixed}{eq}{value}"
        out.append(arg)
    return out


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a missing config file, a wrong variant and an unknown
    ``--config.`` field each reported on one line, and
    ``--dashed-names`` read as ``--dashed_names``."""
    argv = dashed_flags(argv)
    message = config_file_error(argv)
    if message is not None:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
    try:
        return app.parse_flags_with_usage(argv)
    except (AttributeError, KeyError, ValueError):
        message = unknown_config_field(argv)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def train_or_exit(train_fn, config, workdir: str) -> dict:
    """``train_fn(config, workdir)``; a divergence exits with code 1, a config, data, workdir or
    resume error with code 2, each as one line on stderr (they name the field and the fix, so a
    traceback adds nothing; ``--verbosity=1`` shows it). A run stopped by SIGTERM or SIGINT
    after checkpointing its step says so on one line and exits with 128 + the signal's number;
    Ctrl-C outside the training steps (reading data, the final evaluation) exits with 130."""
    from sparsemixer_jax.training import TrainingDiverged
    from sparsemixer_jax.training.checkpoint import CheckpointError
    from sparsemixer_jax.training.preemption import Stopped
    from sparsemixer_jax.training.workdir_lock import WorkdirError

    try:
        return train_fn(config, workdir)
    except Stopped as stop:
        print(stop, file=sys.stderr)
        exit_process(stop.exit_code)
    except KeyboardInterrupt:
        print("interrupted outside the training steps; rerun to resume from the last checkpoint "
              "(if one was written)", file=sys.stderr)
        sys.exit(130)
    except TrainingDiverged as err:
        print(f"training stopped: {err}", file=sys.stderr)
        exit_process(1)
    except (ValueError, FileNotFoundError, CheckpointError, WorkdirError) as err:
        if flags.FLAGS.verbosity >= 1:
            raise
        print(f"error: {err}", file=sys.stderr)
        exit_process(2)


def exit_process(code: int) -> NoReturn:
    """``sys.exit(code)``; one of several processes first leaves the distributed runtime with
    the others (``jax.distributed.shutdown``: a barrier) and then ends at once.

    Why at once: a process hosting the coordination service sometimes hung for good in the
    interpreter's final garbage collection after the shutdown (seen with CPU hosts' gloo
    collectives, about one exit in eight on a loaded machine). Only for runs that end early
    (an error, a divergence, a stop signal), whose training loop has already waited for its
    checkpoints and flushed its logs: a finished run's atexit work must run."""
    from jax._src import distributed  # is this process part of a distributed run?

    if distributed.global_state.client is None:
        sys.exit(code)
    import jax

    sys.stdout.flush()
    sys.stderr.flush()
    jax.distributed.shutdown()
    logging.shutdown()
    os._exit(code)


def run_training(train_fn, config, workdir: str, summary_keys: tuple[str, ...]) -> dict:
    """What a training entry point does once its flags are parsed: the config's runtime
    settings (before JAX starts its backend: XLA reads its flags once), several hosts, the
    compilation cache, quiet library logs, ``train_fn(config, workdir)`` through
    :func:`train_or_exit`, and a one-line summary of the results on process 0."""
    from sparsemixer_jax.training import runtime

    if "runtime" in config:  # GLUE fine-tuning's config has none: JAX's defaults
        runtime.configure(runtime.RuntimeConfig.from_config(config.runtime))
    initialize_distributed()
    import jax

    enable_compilation_cache()
    quiet_libraries()
    if jax.process_index() != 0:
        logging.getLogger().setLevel(logging.WARNING)
    results = train_or_exit(train_fn, config, workdir)
    if jax.process_index() == 0:
        print("results:", {k: results.get(k) for k in summary_keys})
    return results


def try_it_hint(config, workdir: str) -> str | None:
    """For a run on the generated language: what the model translates and a command to try it."""
    if config.data.source != "synthetic":
        return None
    import shlex

    from sparsemixer_jax.data.sources import DataConfig, read_split

    source = read_split(DataConfig.from_config(config), "test")[0][0]
    return (
        "this model translates the generated language of sparsemixer_jax.data.synthetic (not "
        "English or German); try it on a sentence of its test split:\n"
        f"  echo {shlex.quote(source)} | python -m experiments.translate --workdir "
        f"{shlex.quote(workdir)}"
    )
