"""A roofline of a compiled program, read from its optimised HLO: no hardware needed.

Every top-level operation of the optimised program (a fusion, a GEMM or attention custom call,
a Pallas / Mosaic kernel, a collective, any other kernel) costs

    pure:        max(FLOPs / peak, bytes / HBM bandwidth)           (collectives: bytes / link)
    calibrated:  max(FLOPs / (peak x fraction), bytes / (HBM bandwidth x memory_fraction))
                 + kernel_seconds

with the fraction of peak by the kernel's class (cuBLAS and XLA GEMMs by their size, Pallas
kernels, cuDNN attention by direction and mask type: :class:`Calibration`)

times how often it runs (the trip counts of the ``while`` loops around it), and a program's
predicted time is the sum: operations run one after another, as a GPU stream or a TPU core
runs them (overlap of collectives with compute is not credited). :class:`Calibration` holds the
fitted constants (docs/benchmarks.md, "Roofline").

Where the counts come from: the optimised HLO itself (:mod:`~sparsemixer_jax.aot.hlo`), not
XLA's cost analysis, which returns nothing for GPU programs compiled without the hardware and
counts custom calls (cuBLAS GEMMs, cuDNN attention, Pallas kernels) as zero;
``jax.experimental.roofline`` counts the jaxpr before XLA fuses it, so it cannot see which
intermediates the compiled program keeps in HBM. Here:

* FLOPs: the matmuls only (``dot`` and ``convolution``, inside fusions too: ``2 x output
  elements x contracted size``), at the chip's matmul peak; elementwise arithmetic is left out
  (it is memory-bound on these chips). Custom calls (cuBLAS GEMMs, cuDNN and splash attention,
  Pallas kernels): from their shapes and attributes (:mod:`~sparsemixer_jax.aot.kernel_flops`).
* Bytes: what each kernel reads and writes in HBM: its operands and outputs, except that an
  operand read only through ``dynamic-slice``/``slice``/``gather`` counts the slices (a scanned
  layer reads one layer of a stacked weight) and an in-place ``dynamic-update-slice`` counts
  the update, not the buffer.
* Collectives: bytes on the wire per device (ring all-reduce ``2 (n-1)/n`` of the buffer,
  all-gather ``(n-1)`` x the input, reduce-scatter and all-to-all ``(n-1)/n``), at the chip's
  link bandwidth in one direction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from sparsemixer_jax.aot import hlo
from sparsemixer_jax.aot.analysis import COLLECTIVES
from sparsemixer_jax.aot.kernel_flops import attention_variant, custom_call_cost, dims


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip: dense bfloat16 matmul ``peak_flops`` (FLOP/s), ``hbm_bandwidth``
    and ``link_bandwidth`` (bytes/s; the link: one direction, per chip), and where the figures
    come from."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    link_bandwidth: float
    source: str


# Keyed by sparsemixer_jax.aot.targets.Target.chip.
CHIPS = {
    "h100": Chip("H100 SXM", 989e12, 3.35e12, 450e9,
                 "NVIDIA H100 Tensor Core GPU datasheet, SXM column: BF16 Tensor Core 1,979 "
                 "TFLOPS with sparsity (989 dense), GPU memory bandwidth 3.35 TB/s, NVLink "
                 "900 GB/s (450 GB/s each way)"),
    "h200": Chip("H200 SXM", 989e12, 4.8e12, 450e9,
                 "NVIDIA H200 Tensor Core GPU datasheet, SXM column: BF16 Tensor Core 1,979 "
                 "TFLOPS with sparsity (989 dense), GPU memory bandwidth 4.8 TB/s, NVLink "
                 "900 GB/s (450 GB/s each way)"),
    "v4": Chip("TPU v4", 275e12, 1.2e12, 1.1e15 / 4096,
               "cloud.google.com/tpu/docs/v4: 275 TFLOPs (bf16) per chip, HBM2 1200 GBps; "
               "link: the pod's all-reduce bandwidth, 1.1 PB/s over 4096 chips"),
    "v5e": Chip("TPU v5e", 197e12, 819e9, 200e9,
                "cloud.google.com/tpu/docs/v5e: 197 TFLOPs (bf16) per chip, HBM2 819 GBps, "
                "ICI 400 GBps per chip both ways (200 each way)"),
    "v5p": Chip("TPU v5p", 459e12, 2765e9, 600e9,
                "cloud.google.com/tpu/docs/v5p: 459 TFLOPs (bf16) per chip, HBM2e 2765 GBps, "
                "ICI 1200 GBps per chip both ways (600 each way)"),
    "v6e": Chip("TPU v6e", 918e12, 1638e9, 400e9,
                "cloud.google.com/tpu/docs/v6e: 918 TFLOPs (bf16) per chip, HBM 1638 GBps, "
                "ICI 800 GBps per chip both ways (400 each way)"),
}


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What the hardware reaches of the roofline, per kind of kernel, fitted on measured step
    times (:mod:`lab.benchmarks.roofline_fit`).

    Every kernel costs ``kernel_seconds`` (launch, prologue, tail, the gap to the next) on top
    of ``max(compute, memory)``. Compute, by the kernel's class (:attr:`Op.cost_class`):

    * ``gemm`` (cuBLAS calls and fusions with a matmul): a matmul of ``F`` FLOPs runs at
      ``gemm_peak_fraction x F / (F + gemm_half_flops)`` of the chip's peak (small matmuls
      do not fill the chip);
    * ``pallas`` (Pallas / Mosaic kernels: on GPU the grouped expert matmuls): at
      ``pallas_fraction`` of peak;
    * ``attention <direction> <mask>[ bias]`` (cuDNN's fused attention,
      :func:`~sparsemixer_jax.aot.kernel_flops.attention_variant`): at the fraction
      ``attention`` gives for that variant; a variant it lacks takes the first one of the
      same direction (its mask type unmeasured), and without one, the GEMM's.

    Memory: every kernel moves its bytes at ``memory_fraction`` of the HBM bandwidth,
    collectives at ``link_fraction`` of the link's.
    """

    kernel_seconds: float
    gemm_peak_fraction: float
    gemm_half_flops: float
    memory_fraction: float
    pallas_fraction: float = 1.0
    attention: tuple[tuple[str, float], ...] = ()
    link_fraction: float = 0.8

    def gemm_fraction(self, flops: float) -> float:
        return self.gemm_peak_fraction * flops / (flops + self.gemm_half_flops)

    def compute_fraction(self, cost_class: str, flops: float) -> float:
        """The fraction of peak a kernel of ``cost_class`` computing ``flops`` reaches."""
        if cost_class == "pallas":
            return self.pallas_fraction
        if cost_class.startswith("attention"):
            variant = cost_class.removeprefix("attention ")
            fractions = dict(self.attention)
            if variant in fractions:
                return fractions[variant]
            direction = variant.split(" ")[0]
            same = [f for v, f in self.attention if v.split(" ")[0] == direction]
            if same:
                return same[0]
        return self.gemm_fraction(flops)


PURE = Calibration(kernel_seconds=0.0, gemm_peak_fraction=1.0, gemm_half_flops=0.0,
                   memory_fraction=1.0, link_fraction=1.0)
# The fit of lab.benchmarks.roofline_fit to 3 significant digits
# (docs/results/roofline_fit_kinds.json, docs/benchmarks.md section 7): every committed one-GPU
# language-model run (one H100 at the benchmark's own sizes, one H200 at configs/lm_bench.py's),
# each distinct compiled program once, with the two profiles' device time per kind of kernel.
# Used for every chip until one has its own measurements. Both cuDNN runs used an explicit
# mask (CAUSAL with a bias): other mask types (the packed documents' PADDING_CAUSAL) take its
# fractions, unmeasured. The link fraction is not fitted (the one-GPU runs have no
# collectives).
GPU_FIT = Calibration(kernel_seconds=2.53e-6, gemm_peak_fraction=0.871, gemm_half_flops=2.58e9,
                      memory_fraction=0.757, pallas_fraction=0.516,
                      attention=(("backward CAUSAL bias", 0.200), ("forward CAUSAL bias", 0.274)))

# Instructions that launch nothing.
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
                   "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
                   "reshape", "send", "recv", "send-done", "recv-done"})
# Custom calls that mark or reserve buffers (TPU programs) and move no data.
_FREE_TARGETS = frozenset({"AllocateBuffer", "AssumeGatherIndicesInBound",
                           "GatherScatterIndicesBitpacked", "Sharding", "SPMDFullToShardShape",
                           "SPMDShardToFullShape"})
_SLICES = frozenset({"dynamic-slice", "slice", "gather"})


@dataclasses.dataclass(frozen=True)
class Op:
    """One top-level operation of a program: per run ``flops`` (matmul FLOPs), HBM ``bytes``,
    ``link_bytes`` (a collective's bytes on the wire); ``count``: runs per program run (loop
    trip counts); ``kind``: ``gemm`` (a fusion or call with matmuls), ``attention``, ``kernel``
    (Pallas), ``collective``, ``fusion`` or another opcode; ``shapes``: output <- operands."""

    name: str
    kind: str
    flops: float
    bytes: float
    link_bytes: float
    count: float
    shapes: str
    source: str
    variant: str = ""  # cuDNN attention: kernel_flops.attention_variant

    @property
    def cost_class(self) -> str:
        """Which of :class:`Calibration`'s rates this kernel runs at: ``collective``,
        ``attention <variant>``, ``pallas``, ``gemm`` (any other kernel with matmul FLOPs) or
        ``memory``."""
        if self.kind == "attention":
            return f"attention {self.variant}".strip()
        if self.kind == "kernel":
            return "pallas"
        if self.kind == "collective":
            return "collective"
        return "gemm" if self.flops else "memory"

    def seconds(self, chip: Chip, calibration: Calibration) -> float:
        """One run's time on ``chip`` under ``calibration``."""
        if self.kind == "collective":
            return (self.link_bytes / (chip.link_bandwidth * calibration.link_fraction)
                    + calibration.kernel_seconds)
        compute = 0.0
        if self.flops:
            compute = self.flops / (chip.peak_flops * calibration.compute_fraction(
                self.cost_class, self.flops))
        memory = self.bytes / (chip.hbm_bandwidth * calibration.memory_fraction)
        return max(compute, memory) + calibration.kernel_seconds

    def bound(self, chip: Chip) -> str:
        if self.kind == "collective":
            return "link"
        return "compute" if self.flops / chip.peak_flops >= self.bytes / chip.hbm_bandwidth \
            else "memory"


def _size(text: str, types: dict[str, str]) -> int:
    return sum(a.bytes for a in hlo.arrays(types.get(text, "")))


def dot_flops(instruction: hlo.Instruction, types: dict[str, str]) -> float:
    """``2 x output elements x contracted size`` of a ``dot`` or ``convolution``."""
    outputs = instruction.outputs
    if not outputs or len(instruction.operands) < 2:
        return 0.0
    lhs = hlo.arrays(types.get(instruction.operands[0], ""))
    rhs = hlo.arrays(types.get(instruction.operands[1], ""))
    if not lhs or not rhs:
        return 0.0
    if instruction.opcode == "dot":
        contracted = math.prod(lhs[0].dims[d] for d in
                               dims(instruction.attribute(r"lhs_contracting_dims=\{([\d,]*)\}")))
        return 2.0 * outputs[0].size * contracted
    labels = instruction.attribute(r"dim_labels=(\w+->\w+)")  # e.g. "0bf1_1oi0->0b1f"
    if not labels or labels.count("_") != 1:
        return 0.0
    operands, out_labels = labels.split("->")
    lhs_labels, kernel_labels = operands.split("_")
    if "i" not in kernel_labels:
        return 0.0
    window = _Window.parse(instruction.attribute(r"window=\{([^}]*)\}") or "")
    # Per output element, the contracted features times the window taps that land on the
    # input rather than on its padding or between dilated elements. TPU programs write a
    # matmul's batch dimensions (attention's heads and rows) as spatial dimensions with a
    # window the size of the dimension, padded or dilated so that one tap lands: counting
    # every tap counted those matmuls once more per head.
    macs = outputs[0].size * rhs[0].dims[kernel_labels.index("i")]
    for d in range(len(window.sizes)):
        if str(d) not in out_labels or str(d) not in lhs_labels:
            return 0.0
        out = outputs[0].dims[out_labels.index(str(d))]
        macs *= window.landing(d, out, lhs[0].dims[lhs_labels.index(str(d))]) / max(1, out)
    return 2.0 * macs


@dataclasses.dataclass(frozen=True)
class _Window:
    """A convolution's window (HLO ``window={size=.. stride=.. pad=.. lhs_dilate=..
    rhs_dilate=..}``), one entry per spatial dimension."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    pads: tuple[int, ...]  # the low padding
    lhs_dilations: tuple[int, ...]
    rhs_dilations: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> _Window:
        fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
        sizes = tuple(int(v) for v in fields.get("size", "").split("x") if v)

        def each(key: str, default: int) -> tuple[int, ...]:
            if key not in fields:
                return (default,) * len(sizes)
            return tuple(int(v.split("_")[0]) for v in fields[key].split("x"))

        return cls(sizes, each("stride", 1), each("pad", 0), each("lhs_dilate", 1),
                   each("rhs_dilate", 1))

    def landing(self, d: int, out: int, size: int) -> int:
        """How many (output position, tap) pairs of spatial dimension ``d`` (``out`` outputs,
        an input of ``size``) read an input element."""
        stride, dilation, last = self.strides[d], self.lhs_dilations[d], \
            (size - 1) * self.lhs_dilations[d]
        total = 0
        for tap in range(self.sizes[d]):
            offset = tap * self.rhs_dilations[d] - self.pads[d]  # input position of output 0
            if dilation == 1:  # outputs o with 0 <= o stride + offset <= last
                first = max(0, -(offset // stride))  # ceil(-offset / stride)
                end = min(out - 1, (last - offset) // stride) if last >= offset else -1
                total += max(0, end - first + 1)
            else:
                total += sum(1 for o in range(out) if 0 <= o * stride + offset <= last
                             and (o * stride + offset) % dilation == 0)
        return total


def computation_flops(module: hlo.Module, name: str) -> tuple[float, str]:
    """``(matmul FLOPs, kind)`` of a fused (or called) computation, nested fusions and custom
    calls (a Pallas kernel XLA wraps in a fusion) included; ``kind``: ``gemm`` for matmuls, a
    custom call's kind, else ``fusion``."""
    computation = module.computations.get(name)
    if computation is None:
        return 0.0, "fusion"
    types, total, kind = computation.types(), 0.0, "fusion"
    for instruction in computation.instructions:
        if instruction.opcode in ("dot", "convolution"):
            total += dot_flops(instruction, types)
            kind = "gemm" if kind == "fusion" else kind
        elif instruction.opcode == "custom-call":
            kind, flops, _ = custom_call_cost(instruction, types)
            total += flops
        elif instruction.opcode != "reduce":  # a reduction's to_apply is a scalar add
            for called in instruction.called("calls") + instruction.called("to_apply"):
                flops, inner = computation_flops(module, called)
                total += flops
                kind = inner if kind == "fusion" else kind
    return total, kind


def _fusion_bytes(module: hlo.Module, instruction: hlo.Instruction,
                  types: dict[str, str]) -> float:
    """HBM bytes a fusion reads and writes (module docstring: slices and in-place updates)."""
    called = instruction.called("calls")
    fused = module.computations.get(called[0]) if called else None
    if fused is None:
        return sum(_size(o, types) for o in instruction.operands) + \
            sum(a.bytes for a in instruction.outputs)
    inner = fused.types()
    by_name = {i.name: i for i in fused.instructions}
    root = by_name.get(fused.root)
    roots = [by_name[o] for o in root.operands if o in by_name] \
        if root is not None and root.opcode == "tuple" else [root] if root else []
    params = {p.name: int(p.operands[0]) for p in fused.instructions
              if p.opcode == "parameter" and p.operands and p.operands[0].isdigit()}
    def source(name: str) -> str:  # through bitcasts, which move nothing
        while name in by_name and by_name[name].opcode == "bitcast":
            name = by_name[name].operands[0]
        return name

    in_place, written = set(), 0.0
    for out in roots:
        if out.opcode == "dynamic-update-slice" and source(out.operands[0]) in params:
            in_place.add(params[source(out.operands[0])])
            written += _size(out.operands[1], inner)
        else:
            written += sum(a.bytes for a in out.outputs)
    read = 0.0
    for index, operand in enumerate(instruction.operands):
        param = next((p for p, i in params.items() if i == index), None)
        users = [i for i in fused.instructions
                 if i.opcode != "bitcast" and any(source(o) == param for o in i.operands)]
        if index in in_place:  # the buffer updated in place is read only where sliced
            users = [u for u in users if not (u.opcode == "dynamic-update-slice"
                                              and source(u.operands[0]) == param)]
        if param and all(u.opcode in _SLICES and source(u.operands[0]) == param
                         for u in users) and (users or index in in_place):
            read += sum(sum(a.bytes for a in u.outputs) for u in users)
        else:
            read += _size(operand, types)
    return read + written


def _group_size(instruction: hlo.Instruction, devices: int) -> int:
    iota = instruction.attribute(r"replica_groups=\[(\d+),(\d+)\]")
    if iota:
        return int(instruction.attribute(r"replica_groups=\[\d+,(\d+)\]"))
    groups = instruction.attribute(r"replica_groups=\{\{([\d,]*)\}")
    return len(dims(groups)) if groups else devices


def _collective_link_bytes(opcode: str, instruction: hlo.Instruction,
                           types: dict[str, str], devices: int) -> float:
    size = sum(_size(o, types) for o in instruction.operands)
    n = _group_size(instruction, devices)
    if opcode == "collective-permute":
        return float(size)
    if n <= 1:
        return 0.0
    factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": n - 1}.get(opcode, (n - 1) / n)
    return factor * size


def program_ops(module: hlo.Module, devices: int = 1) -> list[Op]:
    """The top-level operations of ``module``'s entry computation (loop bodies and called
    computations expanded, their ops counted as often as they run), with their costs."""
    ops: list[Op] = []
    _visit(module, module.entry, 1.0, devices, ops)
    return ops


def _visit(module: hlo.Module, name: str, count: float, devices: int, ops: list[Op]) -> None:
    computation = module.computations.get(name)
    if computation is None:
        return
    types = computation.types()
    for instruction in computation.instructions:
        opcode = instruction.opcode
        if opcode in _FREE or opcode.endswith(("-done", "-update")) or (
                opcode == "custom-call" and instruction.attribute(
                    r'custom_call_target="([^"]*)"') in _FREE_TARGETS):
            continue
        if opcode == "while":
            trip = trip_count(module, instruction)
            for called in instruction.called("body") + instruction.called("condition"):
                _visit(module, called, count * trip, devices, ops)
            continue
        branches = instruction.called("branch_computations") or (
            instruction.called("true_computation") + instruction.called("false_computation"))
        if opcode == "conditional" and branches:  # each branch weighted equally
            for called in branches:
                _visit(module, called, count / len(branches), devices, ops)
            continue
        if opcode in ("call", "async-start"):
            for called in instruction.called("to_apply") + instruction.called("calls"):
                _visit(module, called, count, devices, ops)
            continue
        if opcode not in ("fusion", "custom-call") and not any(a.dims for a in instruction.outputs):
            continue  # scalar bookkeeping (loop counters, RNG state): the TPU's scalar unit
        ops.append(_op(module, instruction, types, count, devices))


def trip_count(module: hlo.Module, instruction: hlo.Instruction) -> float:
    """How often a ``while`` loop runs: its ``known_trip_count`` (GPU programs carry it), else
    the bound of a condition ``counter < N`` (a scan's, counting from 0; TPU programs), else
    1."""
    known = instruction.attribute(r'"known_trip_count":\{"n":"(\d+)"')
    if known:
        return float(known)
    condition = module.computations.get(next(iter(instruction.called("condition")), ""))
    if condition is None:
        return 1.0
    by_name = {i.name: i for i in condition.instructions}
    root = by_name.get(condition.root)
    direction = root.attribute(r"direction=(\w+)") if root and root.opcode == "compare" else None
    if direction not in ("LT", "LE"):
        return 1.0
    bound = by_name.get(root.operands[1]) if len(root.operands) == 2 else None
    if bound is None or bound.opcode != "constant" or not bound.operands[0].isdigit():
        return 1.0
    return float(int(bound.operands[0]) + (direction == "LE"))


def _op(module: hlo.Module, instruction: hlo.Instruction, types: dict[str, str], count: float,
        devices: int) -> Op:
    opcode = instruction.opcode.removesuffix("-start")
    flops, link, variant = 0.0, 0.0, ""
    if opcode in COLLECTIVES:
        kind, moved = "collective", 0.0
        link = _collective_link_bytes(opcode, instruction, types, devices)
    elif opcode == "fusion":
        called = instruction.called("calls")
        flops, kind = computation_flops(module, called[0]) if called else (0.0, "fusion")
        moved = _fusion_bytes(module, instruction, types)
        if kind == "attention":  # a cuDNN call XLA wrapped in a fusion
            calls = [i for i in module.computations[called[0]].instructions
                     if i.opcode == "custom-call" and "__cudnn$fmha" in i.attributes]
            variant = attention_variant(calls[0]) if calls else ""
    elif opcode == "custom-call":
        kind, flops, moved = custom_call_cost(instruction, types)
        variant = attention_variant(instruction) if kind == "attention" else ""
    else:
        flops = dot_flops(instruction, types) if opcode in ("dot", "convolution") else 0.0
        kind = "gemm" if flops else opcode
        operands = [_size(o, types) for o in instruction.operands]
        written = sum(a.bytes for a in instruction.outputs)
        if opcode == "dynamic-update-slice" and len(operands) > 1:
            moved = 2.0 * operands[1]
        elif instruction.opcode == "copy-start":  # its output tuple holds both buffers
            moved = 2.0 * sum(operands)
        elif opcode in _SLICES:
            moved = 2.0 * written
        else:
            moved = float(sum(operands) + written)
    return Op(instruction.name, kind, flops, moved, link, count,
              _shapes(instruction, types), module.source(instruction), variant)


def _shapes(instruction: hlo.Instruction, types: dict[str, str]) -> str:
    def show(text: str) -> str:
        found = hlo.arrays(text)
        return ", ".join(map(str, found[:4])) + (", ..." if len(found) > 4 else "")

    operands = [show(types.get(o, "")) for o in instruction.operands[:4]]
    return f"{show(instruction.type)} <- {', '.join(o for o in operands if o)}"


def _totals(ops: Iterable[Op], chip: Chip, calibration: Calibration) -> float:
    return sum(op.count * op.seconds(chip, calibration) for op in ops)


def roofline(hlo_text: str, chip: Chip, model_flops: float | None, *, devices: int = 1,
             calibration: Calibration = GPU_FIT, top: int = 15) -> dict[str, Any]:
    """The roofline of one compiled program (per device) on ``chip``.

    ``model_flops``: the model FLOPs one device computes in one run of the program (None: no
    MFU). Returns ``predicted_seconds`` and ``mfu_bound`` (``calibration``),
    ``predicted_seconds_pure`` and ``mfu_bound_pure`` (:data:`PURE`), the program's totals
    (``flops``, ``bytes``, ``link_bytes``, ``kernels``: launches per run) and ``top_ops``: the
    ``top`` costliest operations under ``calibration``, each with its ``flops``, ``bytes``
    (per run), ``count``, ``seconds`` (all runs), ``bound``, ``kind``, ``shapes`` and
    ``source``; ``kinds``: per kind of operation (``gemm``, ``attention``, ``kernel``,
    ``fusion``, ...), its ``seconds``, ``flops`` and ``kernels`` summed over the program;
    ``classes``: the same per :attr:`Op.cost_class`, the calibration's terms (they add up to
    ``predicted_seconds``).
    """
    ops = program_ops(hlo.parse_module(hlo_text), devices)
    seconds = _totals(ops, chip, calibration)
    pure = _totals(ops, chip, PURE)

    def mfu(time: float) -> float | None:
        return model_flops / time / chip.peak_flops if model_flops and time else None

    ranked = sorted(ops, key=lambda op: -op.count * op.seconds(chip, calibration))
    kinds: dict[str, dict[str, float]] = {}
    classes: dict[str, dict[str, float]] = {}
    for op in ops:
        for key, table in ((op.kind, kinds), (op.cost_class, classes)):
            entry = table.setdefault(key, {"seconds": 0.0, "flops": 0.0, "kernels": 0.0})
            entry["seconds"] += op.count * op.seconds(chip, calibration)
            entry["flops"] += op.count * op.flops
            entry["kernels"] += op.count
    return {
        "chip": chip.name,
        "predicted_seconds": seconds, "mfu_bound": mfu(seconds),
        "predicted_seconds_pure": pure, "mfu_bound_pure": mfu(pure),
        "model_flops": model_flops,
        "flops": sum(op.count * op.flops for op in ops),
        "bytes": sum(op.count * op.bytes for op in ops),
        "link_bytes": sum(op.count * op.link_bytes for op in ops),
        "kernels": sum(op.count for op in ops),
        "top_ops": [{"name": op.name, "kind": op.kind, "flops": op.flops, "bytes": op.bytes,
                     "count": op.count, "seconds": op.count * op.seconds(chip, calibration),
                     "bound": op.bound(chip), "class": op.cost_class, "shapes": op.shapes,
                     "source": op.source}
                    for op in ranked[:top]],
        "kinds": dict(sorted(kinds.items(), key=lambda item: -item[1]["seconds"])),
        "classes": dict(sorted(classes.items(), key=lambda item: -item[1]["seconds"])),
    }


def format_roofline(result: dict[str, Any]) -> str:
    """Lines for a person: the prediction, then the costliest operations."""
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    lines = [f"  roofline on {result['chip']}: {1e3 * result['predicted_seconds']:.2f} ms "
             f"(MFU bound {pct(result['mfu_bound'])}); pure roofline "
             f"{1e3 * result['predicted_seconds_pure']:.2f} ms (MFU bound "
             f"{pct(result['mfu_bound_pure'])}); {result['flops'] / 1e12:.3f} TFLOP of matmuls, "
             f"{result['bytes'] / 2**30:.2f} GiB moved, {result['kernels']:.0f} kernels",
             "  by kind: " + ", ".join(f"{kind} {1e3 * k['seconds']:.2f} ms ({k['kernels']:.0f})"
                                       for kind, k in result["classes"].items()),
             "    ms      share  bound    runs  TFLOP/run  MiB/run  kind        shapes  [source]"]
    for op in result["top_ops"]:
        share = op["seconds"] / result["predicted_seconds"] if result["predicted_seconds"] else 0
        lines.append(f"    {1e3 * op['seconds']:7.3f} {100 * share:5.1f}%  {op['bound']:<8}"
                     f"{op['count']:4.0f}  {op['flops'] / 1e12:9.4f}  "
                     f"{op['bytes'] / 2**20:7.1f}  {op['kind']:<10}  {op['shapes']}  "
                     f"[{op['source']}]")
    return "\n".join(lines)
