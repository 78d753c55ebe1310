"""What a compiled program says about itself before it runs: memory, FLOPs, collectives, kernels.

Every figure is XLA's compile-time model of one device's program (an SPMD program is the same
on every device): the memory analysis (buffers the program's allocation assigns), the cost
analysis (FLOPs and bytes accessed as XLA counts them), and the operations of the optimised HLO.
None of it is a timing.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

import jax

from sparsemixer_jax.aot import hlo

# Collective operations of optimised HLO; asynchronous ones appear as "<name>-start".
COLLECTIVES = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute",
               "ragged-all-to-all")
_OP = re.compile(r"=\s*[^=]*?\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
# Mosaic GPU kernels are custom calls to this target (jax.experimental.mosaic.gpu).
_MOSAIC_GPU = re.compile(r'custom_call_target="mosaic_gpu[^"]*"')
_TPU_KERNEL = re.compile(r'custom_call_target="tpu_custom_call"')


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """One compiled program on one device of the target.

    Memory in bytes: ``arguments`` (inputs, parameters included), ``outputs``, ``aliased``
    (outputs written over donated inputs), ``temporaries`` (everything else the program
    allocates), and ``total`` = arguments + outputs - aliased + temporaries: the peak the
    allocator must find free. ``flops`` and ``bytes_accessed`` come from XLA's cost analysis
    (None where the backend gives none). ``collectives`` counts each collective of the optimised
    program; ``kernels`` counts Pallas kernels (Mosaic GPU or Mosaic TPU custom calls).

    ``parameters`` and ``optimizer_state`` are the bytes of the train state's parameters and
    optimizer state that one device holds (their shards; None for a program without a train
    state); a program that does not read one (``accumulate``: the optimizer state) has it
    outside its ``arguments``. ``largest_buffer`` is the largest array an instruction of the
    optimised program outputs, per device: ``(its type and shape, bytes)``.
    """

    name: str
    compile_seconds: float
    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    flops: float | None
    bytes_accessed: float | None
    collectives: dict[str, int]
    kernels: int
    parameters: int | None = None
    optimizer_state: int | None = None
    largest_buffer: tuple[str, int] | None = None
    # The optimised HLO's text, for the roofline (left out of as_dict's JSON).
    hlo_text: str = dataclasses.field(default="", repr=False)

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries


def collective_counts(hlo_text: str) -> dict[str, int]:
    """``{op: count}`` of the collectives in an optimised HLO module's text (zeros left out)."""
    counts = collections.Counter(match.group(1) for match in _OP.finditer(hlo_text))
    return {op: counts[op] for op in COLLECTIVES if counts[op]}


def kernel_count(hlo_text: str) -> int:
    """Pallas kernels (Mosaic GPU or Mosaic TPU custom calls) in an optimised HLO module."""
    return len(_MOSAIC_GPU.findall(hlo_text)) + len(_TPU_KERNEL.findall(hlo_text))


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*)$")


def largest_buffer(hlo_text: str) -> tuple[str, int] | None:
    """``("f32[8,1024,4096]", bytes)`` of the largest array an instruction of the optimised HLO
    outputs, leaving out the instructions inside fusions (XLA never materialises those)."""
    best: tuple[str, int] | None = None
    fused = False
    for line in hlo_text.splitlines():
        # A computation's header starts at the margin (its instructions are indented).
        header = None if line[:1].isspace() else _COMPUTATION.match(line)
        if header:
            fused = "fus" in header.group(2) or "wrapped" in header.group(2)
            continue
        match = _INSTRUCTION.match(line)
        if fused or not match:
            continue
        for array in hlo.arrays(hlo.output_type(match.group(1))):
            if best is None or array.bytes > best[1]:
                best = (str(array), array.bytes)
    return best


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays or ``jax.ShapeDtypeStruct`` (with shardings:
    the largest shard of each; without, the whole array)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        placement = getattr(leaf, "sharding", None)
        if placement is not None:
            shape = tuple(placement.shard_shape(shape))
        count = 1
        for d in shape:
            count *= d
        total += count * _itemsize(leaf.dtype)
    return total


def _itemsize(dtype: Any) -> int:
    try:
        return jax.numpy.dtype(dtype).itemsize
    except TypeError:  # an RNG key: its raw data (two uint32 for threefry)
        return int(getattr(dtype, "itemsize", 8))


def _cost(compiled: Any) -> dict[str, float]:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    return dict(cost or {})


def analyse(name: str, compiled: jax.stages.Compiled, compile_seconds: float,
            state: Any = None) -> ProgramReport:
    """The :class:`ProgramReport` of ``compiled``; ``state``: the train state it takes
    (abstract, with shardings), whose parameters and optimizer state are counted."""
    memory = compiled.memory_analysis()
    cost = _cost(compiled)
    text = compiled.as_text()
    return ProgramReport(
        name=name,
        compile_seconds=compile_seconds,
        arguments=int(memory.argument_size_in_bytes),
        outputs=int(memory.output_size_in_bytes),
        aliased=int(memory.alias_size_in_bytes),
        temporaries=int(memory.temp_size_in_bytes),
        flops=cost.get("flops"),
        bytes_accessed=cost.get("bytes accessed"),
        collectives=collective_counts(text),
        kernels=kernel_count(text),
        parameters=None if state is None else bytes_per_device(state.params),
        optimizer_state=None if state is None else bytes_per_device(state.opt_state),
        largest_buffer=largest_buffer(text),
        hlo_text=text,
    )


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def format_report(report: ProgramReport, hbm_bytes: int) -> str:
    """Lines for a person: memory against ``hbm_bytes``, FLOPs, bytes, collectives, kernels."""
    fits = "fits" if report.total <= hbm_bytes else "DOES NOT FIT"
    flops = "n/a" if report.flops is None else f"{report.flops / 1e12:.3f} TFLOP"
    moved = "n/a" if report.bytes_accessed is None else _gib(report.bytes_accessed)
    collectives = ", ".join(f"{n} {op}" for op, n in report.collectives.items()) or "none"
    state, largest = [], []
    if report.parameters is not None:
        state.append(f"  train state held: parameters {_gib(report.parameters)}, optimizer "
                     f"state {_gib(report.optimizer_state)} (a program that does not read a "
                     "part leaves it out of its arguments)")
    if report.largest_buffer is not None:
        largest.append(f"  largest buffer: {report.largest_buffer[0]} "
                       f"({_gib(report.largest_buffer[1])})")
    return "\n".join([
        f"{report.name} (compiled in {report.compile_seconds:.1f} s), per device:",
        *state,
        f"  memory: arguments {_gib(report.arguments)}, outputs {_gib(report.outputs)} "
        f"({_gib(report.aliased)} aliased to donated inputs), temporaries "
        f"{_gib(report.temporaries)}; total {_gib(report.total)} of {_gib(hbm_bytes)} HBM "
        f"({100 * report.total / hbm_bytes:.1f}%): {fits}",
        f"  cost analysis (compile-time model, not a timing): {flops}, {moved} accessed",
        f"  collectives: {collectives}; Pallas kernels: {report.kernels}",
        *largest,
    ])


def as_dict(report: ProgramReport) -> dict[str, Any]:
    """The report as plain JSON-ready values (``total`` included, the HLO text left out)."""
    fields = dataclasses.asdict(report)
    del fields["hlo_text"]
    return {**fields, "total": report.total}
