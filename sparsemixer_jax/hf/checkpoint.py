"""Loading and saving Hugging Face model directories (``config.json`` + safetensors).

Loading streams: the model is built abstractly (no parameter is initialised), each parameter is
allocated once on the device, and the safetensors files are read one at a time, tensor by tensor
(memory-mapped in its own dtype, bfloat16 and float8 included:
:mod:`sparsemixer_jax.hf.safetensors_read`), each written into its slice on the
device; the host holds one tensor at a time, never the model. Saving reads back one slice at a
time and writes a shard whenever ``max_shard_bytes`` is reached, with the index json transformers
reads.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparsemixer_jax.hf import fp8, mxfp4, safetensors_read
from sparsemixer_jax.hf.config import from_hf, to_hf
from sparsemixer_jax.hf.families import family_of
from sparsemixer_jax.hf.tokenizer import read_json_object
from sparsemixer_jax.hf.weights import Path, Slot, convert, read_table, saved_tensors, saved_value
from sparsemixer_jax.models.causal_lm import CausalLM
from sparsemixer_jax.models.lm_config import LMConfig
from sparsemixer_jax.parallel import sharding
from sparsemixer_jax.parallel.partitioning import Partitioner

#: What a checkpoint holds: the params and the MoE layers' selection bias (a checkpoint's
#: ``e_score_correction_bias``, the layer's bias state).
CHECKPOINT_STATE = nnx.Any(nnx.Param, nnx.PathContains("expert_bias"))
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


LAYER_NUMBER = re.compile(r"model\.layers\.(\d+)\.")
logger = logging.getLogger(__name__)


def _safetensors():
    try:
        import safetensors.numpy as st_numpy
        from safetensors import safe_open
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("Hugging Face checkpoints need the safetensors package: pip install "
                          "'sparsemixer-jax[hf]'") from err
    return safe_open, st_numpy


def read_config(path: str) -> dict[str, Any]:
    """``config.json`` of a Hugging Face model directory, or a one-line ValueError."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(file):
        raise ValueError(f"{path!r} is not a Hugging Face model directory (no config.json)")
    return read_json_object(file)


def weight_files(path: str) -> list[str]:
    """The safetensors files of a directory: the shards its index names (each checked to
    exist) or ``model.safetensors``; a one-line ValueError otherwise."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        for shard in shards:
            if not os.path.isfile(os.path.join(path, shard)):
                raise ValueError(f"{path!r}: shard {shard!r} named in {INDEX_FILE} is missing")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"{path!r} has no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                     "checkpoints are read)")


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("placement",))
def _write(array: jax.Array, value: jax.Array, index: jax.Array,
           placement: jax.sharding.Sharding | None = None) -> jax.Array:
    """``array`` with ``array[index...] = value`` (updated in place: the input is donated),
    kept sharded as ``placement`` says (a parameter loaded onto a mesh)."""
    start = tuple(index) + (0,) * (array.ndim - index.shape[0])
    out = jax.lax.dynamic_update_slice(array, value.reshape((1,) * index.shape[0] + value.shape),
                                       start)
    return out if placement is None else jax.lax.with_sharding_constraint(out, placement)


def _zeros(shape: tuple[int, ...], dtype: Any, placement: jax.sharding.Sharding | None
           ) -> jax.Array:
    """Zeros of ``shape``, made in place on the mesh (each device its part) when placed."""
    if placement is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=placement)()


def _to_host(value: jax.Array) -> np.ndarray:
    """One tensor on this host, also when its shards are spread over several processes."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(jax.device_get(value))


def _get(tree: dict, path: Path):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _set(tree: dict, path: Path, value) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def _build(config: LMConfig, seed: int, mesh) -> tuple[Any, Any, Any]:
    """``(graphdef, abstract params, other state)`` of the model, without initialising params:
    the other state (router RNG keys, Default MoE's vectors) is computed under ``jit``, where
    the unused parameter initialisers are dead code."""
    make = functools.partial(_make, config, seed, mesh)
    graphdef, params, _ = nnx.split(nnx.eval_shape(make), CHECKPOINT_STATE, ...)
    rest = jax.jit(lambda: nnx.split(make(), CHECKPOINT_STATE, ...)[2])()
    return graphdef, params, rest


def _make(config: LMConfig, seed: int, mesh) -> CausalLM:
    return CausalLM(config, mesh=mesh, rngs=nnx.Rngs(params=seed, router=seed + 1))


def load_pretrained(path: str, *, seed: int = 0, mesh: jax.sharding.Mesh | None = None,
                    rules: Any = None, **overrides: Any) -> tuple[CausalLM, LMConfig]:
    """A :class:`CausalLM` and its :class:`LMConfig` from a Hugging Face model directory.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``).
      seed: seeds the routers' sampling streams (training only).
      mesh: optional ``("data", "fsdp", "expert")`` mesh
        (:func:`sparsemixer_jax.parallel.sharding.make_mesh`): each parameter is made sharded on it
        as
        the logical-axis ``rules`` say (:mod:`sparsemixer_jax.parallel.partitioning`; None: the
        defaults, the width over ``fsdp`` and experts over ``expert``) and each tensor of the
        checkpoint is written into its shards as it is read, so no device (and no host beyond
        one tensor) ever holds the whole model.
      rules: ``config.mesh.rules``-style mapping of logical axis names to mesh axes.
      **overrides: :class:`LMConfig` fields to change, e.g. ``router="sparsemixer_v2star"``,
        ``jitter_eps``, ``router_options``; a field of its execution section
        (:class:`~sparsemixer_jax.models.lm_config.LMExecution`) by its own name,
        ``compute_dtype="bfloat16"``, ``dispatch``, ``capacity_factor``, or the whole section
        as ``execution=``. The default routing is the checkpoint's own: the one an export
        of this library recorded in ``config.json``, else the type's (docs/lm.md).

    Quantized checkpoints (gpt-oss's MXFP4 experts, DeepSeek-V3's block-FP8 weights) are
    dequantized as each tensor is read; tensors of layers past ``num_hidden_layers``
    (multi-token prediction) are skipped with one logged line, and so are those under a prefix
    the type does not compute (the hybrids' ``mtp.*``, Qwen3.5's vision tower), one line per
    prefix naming how many. A Qwen3.5 image-text-to-text directory loads as its text model.

    Returns the model in eval mode (``model.train()`` for training) and its config. One-line
    ValueErrors: not a model directory, unsupported ``model_type``, a refused or missing config
    key, a missing shard, an unreadable safetensors file, a tensor of the wrong shape or dtype
    (named), a tensor missing or unexpected (named).
    """
    source = read_config(path)
    config = from_hf(source, **overrides)
    files = weight_files(path)
    graphdef, abstract, rest = _build(config, seed, mesh)
    pure = nnx.to_pure_dict(abstract)
    partitioner = None if mesh is None else Partitioner(mesh, rules)
    placements = (jax.tree.map(lambda _: None, pure) if partitioner is None
                  else partitioner.shardings(pure, warn=True))
    arrays = jax.tree.map(lambda a, p: _zeros(a.shape, a.dtype, p), pure, placements)
    replicated = None if partitioner is None else partitioner.replicated()
    quantization = source.get("quantization_config") or {}  # from_hf checked the method
    beyond: set[int] = set()  # layers past num_hidden_layers (multi-token prediction)
    skipped: dict[str, int] = {}  # tensors per skipped prefix (Family.skipped)
    tensors = checkpoint_tensors(files, quantization)
    for value, slot in _placed(path, config, pure, tensors, beyond, skipped):
        target = _get(arrays, slot.path)
        got = np.asarray(convert(value, slot.transform), target.dtype)
        start = np.asarray(slot.index, np.int32)
        if replicated is not None:  # several processes: global arrays only
            got, start = sharding.place((got, start), (replicated, replicated))
        _set(arrays, slot.path, _write(target, got, start,
                                       placement=_get(placements, slot.path)))
    if beyond:
        logger.info("%s: skipped the tensors of layers %s past num_hidden_layers=%d "
                    "(multi-token prediction layers, which this model does not compute)",
                    path, sorted(beyond), config.arch.num_layers)
    what = family_of(config.arch.model_type).skipped
    for prefix, count in skipped.items():
        logger.info("%s: skipped the %d tensors under %r (%s, which this model does not "
                    "compute)", path, count, prefix, what[prefix])
    _omega_ones(arrays, placements)
    nnx.replace_by_pure_dict(abstract, arrays)
    if partitioner is not None:  # RNG streams and layer state: replicated on the mesh
        rest = sharding.place(rest, partitioner.shardings(rest))
    model = nnx.merge(graphdef, abstract, rest)
    model.eval()
    return model, config


def check_checkpoint(path: str, config: LMConfig) -> None:
    """What :func:`load_pretrained` would refuse in the checkpoint ``path`` for a model of
    ``config``, found from the safetensors headers alone (no tensor is read): a missing shard,
    a truncated or garbled file, a tensor missing, unexpected, or of the wrong shape or dtype.
    A one-line ValueError naming the file (or directory) and the fault; None if it loads."""
    files = weight_files(path)
    quantization = read_config(path).get("quantization_config") or {}
    abstract = nnx.eval_shape(functools.partial(_make, config, 0, None))
    pure = nnx.to_pure_dict(nnx.split(abstract, CHECKPOINT_STATE, ...)[1])
    for _ in _placed(path, config, pure, checkpoint_tensors(files, quantization, headers=True),
                     set()):
        pass


#: The floating-point dtypes a checkpoint's tensors may have (each is cast to the params').
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
class TensorInfo(NamedTuple):
    """A tensor as a safetensors header describes it (``dtype`` a numpy dtype)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _placed(path: str, config: LMConfig, pure: dict, tensors: Iterator[tuple[str, Any, str]],
            beyond: set[int], skipped: dict[str, int] | None = None
            ) -> Iterator[tuple[Any, Slot]]:
    """``(value, slot)`` for each slot of each checkpoint tensor ``(name, value, file)`` (value
    an array or a :class:`TensorInfo`), after checking that the tensor has a place in a model of
    ``config`` (whose params ``pure`` has, abstract or not), a float dtype and the shape the slot
    needs; once ``tensors`` is exhausted, that every tensor the model needs came. Tensors of
    layers past ``num_hidden_layers`` (multi-token prediction) are skipped, their layer numbers
    added to ``beyond``, as transformers builds no such layer; so are those under a prefix of
    the type's ``skipped`` (counted per prefix in ``skipped``), and the type's ``renamed``
    prefixes are read as what they stand for. One-line ValueErrors naming the file and the
    tensor."""
    layers = CausalLM.layer_index_of(config)
    table = read_table(config, layers)
    family = family_of(config.arch.model_type)
    filled: dict[Path, np.ndarray] = {}  # per param: which leading-index slices were written
    for name, value, file in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # recomputed from the config; some old checkpoints store it
        prefix = next((p for p in family.skipped if name.startswith(p)), None)
        if prefix is not None:
            if skipped is not None:
                skipped[prefix] = skipped.get(prefix, 0) + 1
            continue
        for old, new in family.renamed.items():
            if name.startswith(old):
                name = new + name.removeprefix(old)
        number = LAYER_NUMBER.match(name)
        if number and int(number.group(1)) >= config.arch.num_layers:
            beyond.add(int(number.group(1)))
            continue
        if name == "lm_head.weight" and config.arch.tie_word_embeddings:
            continue  # tied: the embedding is the head
        slots = table.get(name)
        if not slots or any(_get(pure, s.path) is None for s in slots):
            raise ValueError(f"{file}: tensor {name!r} has no place in a "
                             f"{config.arch.model_type} model of this config.json")
        if np.dtype(value.dtype).name not in FLOAT_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} is {np.dtype(value.dtype).name}; model "
                             f"weights are floating point ({', '.join(sorted(FLOAT_DTYPES))})")
        for slot in slots:
            shape = _get(pure, slot.path).shape
            expected = _hf_shape(shape, slot)
            if tuple(value.shape) != expected:
                raise ValueError(f"{file}: tensor {name!r} has shape {list(value.shape)}, "
                                 f"expected {list(expected)}")
            yield value, slot
            mark = filled.setdefault(slot.path, np.zeros(
                shape[:2] if slot.path[-1] in ("w_gate", "w_up", "w_down")
                else shape[:1] if slot.path[0] == "stacks" else (), bool))
            mark[slot.index] = True
    for name, slot in saved_tensors(config, layers):
        mark = filled.get(slot.path)
        if mark is None or not np.all(mark[slot.index]):
            raise ValueError(f"{path!r}: tensor {name!r} is missing from the checkpoint")


def _info(entry: dict) -> TensorInfo:
    """A :func:`safetensors_read.header` row as a :class:`TensorInfo`."""
    return TensorInfo(tuple(entry["shape"]), np.dtype(safetensors_read.DTYPES[entry["dtype"]]))


def checkpoint_tensors(files: list[str], quantization: dict[str, Any], headers: bool = False
                       ) -> Iterator[tuple[str, Any, str]]:
    """Every tensor of the safetensors ``files``, ``(name, value, file)``, one at a time
    (memory-mapped until read, in its own dtype: :mod:`sparsemixer_jax.hf.safetensors_read`;
    ``headers``: a :class:`TensorInfo` each, nothing read). ``quantization``: the checkpoint's
    ``quantization_config`` (empty: none). MXFP4: each ``<name>_blocks`` comes with its
    ``<name>_scales`` (from whichever file holds it) as the dequantized ``<name>``
    (:mod:`sparsemixer_jax.hf.mxfp4`); block FP8: each float8 weight with its
    ``weight_scale_inv`` (:mod:`sparsemixer_jax.hf.fp8`). A missing or misshaped scale tensor, or
    a file that is not safetensors, is a one-line ValueError naming the file (and tensor)."""
    tables = {file: safetensors_read.header(file) for file in files}
    holder = {name: file for file, entries in tables.items() for name in entries}

    def tensor(name: str) -> Any:
        entry = tables[holder[name]][name]
        return _info(entry) if headers else safetensors_read.read(holder[name], entry)

    method = quantization.get("quant_method")
    block = _fp8_block(quantization) if method == "fp8" else (0, 0)
    for file, entries in tables.items():
        for name, entry in entries.items():
            if method == "fp8":
                if entry["dtype"] in fp8.FP8_DTYPES:
                    yield name, _fp8_weight(file, name, tensor, holder, block, headers), file
                elif not (name.endswith(fp8.SCALE_SUFFIX)
                          and name.removesuffix(fp8.SCALE_SUFFIX) in holder):
                    yield name, tensor(name), file  # unquantized (a lone scale: no place)
                continue
            base = name.removesuffix(mxfp4.BLOCKS).removesuffix(mxfp4.SCALES)
            if not method or base == name:
                yield name, tensor(name), file
            elif name.endswith(mxfp4.BLOCKS):
                yield base, _dequantized(tensor(name), base, tensor, holder, file, headers), file
            elif base + mxfp4.BLOCKS not in holder:  # scales without blocks
                yield name, tensor(name), file


def _fp8_block(quantization: dict[str, Any]) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` (DeepSeek-V3's [128, 128] if absent)."""
    block = tuple(int(b) for b in quantization.get("weight_block_size") or (128, 128))
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"config.json: quantization_config.weight_block_size={list(block)}; "
                         "block FP8 needs two block sizes >= 1")
    return block


def _fp8_weight(file: str, name: str, tensor: Any, holder: dict[str, str],
                block: tuple[int, int], headers: bool) -> Any:
    """The float32 weight ``name`` (float8, in ``file``) of its values and its scale tensor
    (``headers``: the :class:`TensorInfo` it would have)."""
    scale_name = name + fp8.SCALE_SUFFIX
    if scale_name not in holder:
        raise ValueError(f"{file}: tensor {name!r} is float8 but the checkpoint has no "
                         f"{scale_name!r} (block FP8 weights need their scales)")
    weight, scale = tensor(name), tensor(scale_name)
    fp8.check_scale(weight.shape, scale, block, name, holder[scale_name])
    if headers:
        return TensorInfo(weight.shape, np.dtype(np.float32))
    return fp8.dequantize(weight, scale, block)


def _dequantized(blocks: Any, base: str, tensor: Any, holder: dict[str, str], file: str,
                 headers: bool) -> Any:
    """The float32 weight ``base`` of its MXFP4 ``blocks`` (read from ``file``) and scales
    (``headers``: the :class:`TensorInfo` it would have)."""
    scales_name = base + mxfp4.SCALES
    if scales_name not in holder:
        raise ValueError(f"{file}: tensor {base + mxfp4.BLOCKS!r} has no {scales_name!r} in the "
                         "checkpoint (MXFP4 blocks need their scales)")
    scales = tensor(scales_name)
    mxfp4.check_pair(blocks, scales, base, holder[scales_name])
    if headers:  # [..., rows, cols / 32, 16] -> [..., cols, rows]
        *lead, rows, groups, _ = blocks.shape
        return TensorInfo((*lead, groups * 2 * mxfp4.BLOCK_BYTES, rows), np.dtype(np.float32))
    return mxfp4.dequantize(blocks, scales)


def _omega_ones(arrays: dict, placements: dict) -> None:
    """SparseMixer routers scale the MoE output by omega, which checkpoints do not have: ones."""
    for leaf_path, _ in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        keys = tuple(k.key for k in leaf_path)
        if keys[-1] == "omega":
            omega = _get(arrays, keys)
            _set(arrays, keys, _zeros(omega.shape, omega.dtype, _get(placements, keys)) + 1)


def _hf_shape(param_shape: tuple[int, ...], slot) -> tuple[int, ...]:
    """The shape a checkpoint tensor must have to fill ``slot`` of a param of this shape."""
    if slot.transform in ("gate", "up"):  # the whole [N, emb, I] -> fused [N, 2I, emb]
        n, emb, width = param_shape[1:]
        return (n, 2 * width, emb)
    if slot.transform == "down":  # [N, I, emb] -> [N, emb, I]
        n, width, emb = param_shape[1:]
        return (n, emb, width)
    if slot.transform in ("even", "odd", "first", "second"):  # one of two halves, last axis
        shape = param_shape[len(slot.index):]
        return (*shape[:-1], 2 * shape[-1])
    if slot.transform == "conv":  # [C, K] -> Conv1d's [C, 1, K]
        channels, taps = param_shape[len(slot.index):]
        return (channels, 1, taps)
    shape = tuple(param_shape[len(slot.index):])
    return shape[::-1] if slot.transform == "T" or slot.transform.startswith("pairs") else shape


def save_pretrained(model: CausalLM, config: LMConfig, out_dir: str, *,
                    max_shard_bytes: int = 5 * 2**30, dtype: str = "float32",
                    tokenizer: Any = None) -> None:
    """Writes ``model`` as a Hugging Face directory that transformers'
    ``AutoModelForCausalLM.from_pretrained`` loads: ``config.json`` (:func:`to_hf`), the
    per-expert tensors in safetensors shards of at most ``max_shard_bytes`` (one file, or
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``), and
    ``tokenizer.json`` when a ``tokenizers.Tokenizer`` is given.

    SparseMixer's ``omega`` is folded into the experts' down projections (the function is
    unchanged; checkpoints have no ``omega``). ``dtype``: ``"float32"`` or ``"bfloat16"``.

    A model sharded over a mesh is written one tensor at a time, each gathered from its shards
    as it is written: no host holds more of the model than one tensor and the file being filled
    (``max_shard_bytes``). With several processes every one calls this (the gathers are
    collective) and process 0 writes.
    """
    _, st_numpy = _safetensors()
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    np_dtype = np.float32 if dtype == "float32" else jnp.bfloat16
    hf_config = to_hf(config)
    hf_config["dtype"] = dtype
    os.makedirs(out_dir, exist_ok=True)
    pure = nnx.to_pure_dict(nnx.state(model, CHECKPOINT_STATE))
    layers = model.layer_index()
    shards: list[str] = []
    weight_map: dict[str, int] = {}
    pending: dict[str, np.ndarray] = {}
    size = total = 0

    writer = jax.process_index() == 0  # every process gathers each tensor; one writes it

    def flush() -> None:
        nonlocal pending, size
        if pending:
            shards.append(f"shard-{len(shards):05d}.tmp")
            if writer:
                st_numpy.save_file(pending, os.path.join(out_dir, shards[-1]),
                                   metadata={"format": "pt"})
            pending, size = {}, 0

    for name, named in itertools.groupby(saved_tensors(config, layers), key=lambda t: t[0]):
        value = _saved_value(pure, [slot for _, slot in named]).astype(np_dtype)
        if size and size + value.nbytes > max_shard_bytes:
            flush()
        pending[name] = value
        weight_map[name] = len(shards)
        size += value.nbytes
        total += value.nbytes
    flush()
    if not writer:
        return
    for stale in (SINGLE_FILE, INDEX_FILE):
        if os.path.exists(os.path.join(out_dir, stale)):
            os.remove(os.path.join(out_dir, stale))
    if len(shards) == 1:
        os.replace(os.path.join(out_dir, shards[0]), os.path.join(out_dir, SINGLE_FILE))
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
        for tmp, final in zip(shards, names, strict=True):
            os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, final))
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": {k: names[v] for k, v in weight_map.items()}}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    if tokenizer is not None:
        tokenizer.save(os.path.join(out_dir, "tokenizer.json"))


def _saved_value(pure: dict, slots: list) -> np.ndarray:
    """The tensor of ``slots`` (one, or gpt-oss's interleaved pair) on this host, each slice
    gathered from its shards; SparseMixer's omega folded into the experts' outputs."""
    values = []
    for slot in slots:
        array = _get(pure, slot.path)
        value = array[slot.index] if slot.index else array
        if slot.path[-1] in ("w_down", "b_down"):
            omega = _get(pure, (*slot.path[:-1], "omega"))
            if omega is not None:
                value = value * omega[slot.index[0]]
        value = _to_host(value)
        values.append(saved_value(value, slot.transform))
    if len(values) == 2 and slots[0].transform == "first":  # Llama 4's halves, last axis
        values = [np.concatenate(values, axis=-1)]
    elif len(values) == 2:  # "even" and "odd": interleaved along the last axis
        values = [np.stack(values, axis=-1).reshape(*values[0].shape[:-1], -1)]
    return np.ascontiguousarray(values[0])

