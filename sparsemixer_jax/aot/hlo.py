"""The optimised HLO of a compiled program as data: computations, instructions, shapes, source.

:func:`parse_module` reads the text of ``compiled.as_text()`` (optimised, scheduled HLO) into
:class:`Module`: each computation's instructions with their output type, opcode, operand names and
the attribute text after the operands, and the module's stack-frame table, which maps an
instruction's ``stack_frame_id`` to the Python line that traced it. Only what the roofline
(:mod:`~sparsemixer_jax.aot.roofline`) reads is parsed; the rest stays text.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

# Bytes per element of HLO's array types.
ITEM_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
              "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
              "u64": 8, "f64": 8, "c64": 8, "c128": 16}
FLOAT_TYPES = ("f8e4m3fn", "f8e5m2", "f16", "bf16", "f32", "f64")
ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^([\w\-]+)\(")
_NAME = re.compile(r"%([\w.\-]+)")
_FRAME = re.compile(r"^(\d+) \{(.*)\}$")
_KEY_VALUE = re.compile(r"(\w+)=(\d+)")
_TABLE_ROW = re.compile(r'^(\d+) "(.*)"$')


def output_type(rhs: str) -> str:
    """The output type of an instruction's right-hand side: ``f32[4,8]{1,0}``, or a tuple
    ``(f32[4]{0}, bf16[2,2]{1,0})`` (a multi-output fusion: one buffer per element)."""
    if not rhs.startswith("("):
        return rhs.split(" ", 1)[0]
    depth = 0
    for i, char in enumerate(rhs):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rhs[:i + 1]
    return rhs


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of an HLO type: ``dtype`` (``"bf16"``) and ``dims``."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return self.size * ITEM_BYTES.get(self.dtype, 0)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def arrays(type_text: str) -> list[Array]:
    """The arrays of an HLO type (a tuple's elements in order, nested tuples flattened)."""
    return [Array(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in ARRAY.findall(type_text) if dtype in ITEM_BYTES]


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``%name = type opcode(operands), attributes``."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str

    @property
    def outputs(self) -> list[Array]:
        return arrays(self.type)

    def attribute(self, pattern: str) -> str | None:
        """The first group of regex ``pattern`` in the attribute text, or None."""
        match = re.search(pattern, self.attributes)
        return match.group(1) if match else None

    def called(self, key: str) -> list[str]:
        """The computations named by attribute ``key`` (``calls``, ``body``, ``to_apply``,
        ``branch_computations``...)."""
        match = re.search(rf"\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)", self.attributes)
        return _NAME.findall(match.group(1)) if match else []


@dataclasses.dataclass(frozen=True)
class Computation:
    """A computation's ``instructions`` in order; ``root``: the name of its ROOT instruction."""

    name: str
    instructions: tuple[Instruction, ...]
    root: str = ""

    def types(self) -> dict[str, str]:
        return {i.name: i.type for i in self.instructions}

    def parameter(self, index: int) -> Instruction | None:
        for instruction in self.instructions:
            if instruction.opcode == "parameter" and instruction.operands == (str(index),):
                return instruction
        return None


@dataclasses.dataclass(frozen=True)
class Module:
    """A parsed HLO module: ``computations`` by name, the ``entry`` one's name, and ``sources``:
    ``stack_frame_id`` -> ``"path:line (function)"``."""

    computations: dict[str, Computation]
    entry: str
    sources: dict[int, str]

    def source(self, instruction: Instruction) -> str:
        """Where ``instruction`` was traced: the metadata's ``source_file:source_line``, or its
        stack frame's; ``op_name`` where neither is there; ``""`` when nothing is."""
        file = instruction.attribute(r'source_file="([^"]*)"')
        if file:
            line = instruction.attribute(r"source_line=(\d+)")
            return f"{short_path(file)}:{line}"
        frame = instruction.attribute(r"stack_frame_id=(\d+)")
        if frame and int(frame) in self.sources:
            return self.sources[int(frame)]
        return instruction.attribute(r'op_name="([^"]*)"') or ""


def short_path(path: str) -> str:
    """``path`` from the project's package or script folders on, else its file name."""
    for root in ("sparsemixer_jax/", "experiments/", "lab/", "configs/", "tests/"):
        if root in path:
            return root + path.rsplit(root, 1)[1]
    return path.rsplit("/", 1)[-1]


def _split_operands(text: str) -> tuple[tuple[str, ...], str]:
    """``(operand names, attribute text)`` of ``opcode(...)...`` text after the opcode."""
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            inner, rest = text[1:i], text[i + 1:].lstrip(", ")
            names = tuple(_NAME.findall(inner))
            # parameter(0), get-tuple-element's index and constants: no operand names.
            return (names if names else ((inner,) if inner.isdigit() else ())), rest
    return (), ""


def parse_instruction(line: str) -> Instruction | None:
    match = _INSTRUCTION.match(line)
    if not match:
        return None
    name, rhs = match.groups()
    type_text = output_type(rhs)
    rest = rhs[len(type_text):].lstrip()
    opcode = _OPCODE.match(rest)
    if not opcode:
        return None
    operands, attributes = _split_operands(rest[len(opcode.group(1)):])
    return Instruction(name, type_text, opcode.group(1), operands, attributes)


def parse_module(text: str) -> Module:
    """The :class:`Module` of an HLO module's text."""
    computations: dict[str, Computation] = {}
    tables: dict[str, dict[int, str]] = {}
    entry, current, body, table, root = "", None, [], None, ""
    for line in _joined_lines(text):
        if current is None:
            header = None if line[:1].isspace() else _HEADER.match(line)
            if header:
                current, body, table = header.group(2), [], None
                entry = current if header.group(1) else entry
            elif line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                table = tables.setdefault(line, {})
            elif table is not None and line.strip():
                row = _TABLE_ROW.match(line) or _FRAME.match(line)
                if row:
                    table[int(row.group(1))] = row.group(2)
            continue
        if line.startswith("}"):
            computations[current] = Computation(current, tuple(body), root)
            current = None
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            body.append(instruction)
            root = instruction.name if line.lstrip().startswith("ROOT ") else root
    return Module(computations, entry, _sources(tables))


def _joined_lines(text: str) -> Iterator[str]:
    """The lines of ``text``, an instruction's continuation lines joined to it: TPU kernels
    print their ``frontend_attributes`` over several lines (``kernel_metadata={`` then the
    metadata, then ``}}, metadata={...}, backend_config=...``), and a line starting with ``}``
    would otherwise end the computation."""
    pending, depth = "", 0
    for line in text.splitlines():
        if depth > 0:
            pending += " " + line.strip()
        elif _INSTRUCTION.match(line):
            pending = line
        else:
            yield line
            continue
        depth = pending.count("{") - pending.count("}")
        if depth <= 0:
            yield pending
            pending, depth = "", 0
    if pending:
        yield pending


def _sources(tables: dict[str, dict[int, str]]) -> dict[int, str]:
    """``stack_frame_id`` -> ``"path:line (function)"`` of the innermost frame."""
    files, functions = tables.get("FileNames", {}), tables.get("FunctionNames", {})
    locations = {k: dict(_KEY_VALUE.findall(v)) for k, v in tables.get("FileLocations", {}).items()}
    out = {}
    for frame, fields in tables.get("StackFrames", {}).items():
        location = locations.get(int(dict(_KEY_VALUE.findall(fields)).get("file_location_id", 0)))
        if location:
            file = short_path(files.get(int(location.get("file_name_id", 0)), "?"))
            function = functions.get(int(location.get("function_name_id", 0)), "?")
            out[frame] = f"{file}:{location.get('line', '?')} ({function})"
    return out
