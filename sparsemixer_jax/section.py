"""How a typed config section reads its fields: the one place that casts a config value.

Every section of an experiment config (``config.model``, ``config.router``, ``config.data``, ...)
has a frozen dataclass owned by the code it configures, with a ``from_config(section,
where="config.<section>.")`` classmethod that reads its fields with :func:`read_fields`, checks
them and raises one-line ValueErrors naming the field. The code then reads typed attributes, never
the ConfigDict. Pure Python (no JAX, Flax or ml_collections), so that the routers' section imports
with JAX alone.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from typing import Any

try:  # numpy's bool is no subclass of bool; numpy is optional here
    from numpy import bool_ as np_bool
except ImportError:  # pragma: no cover
    np_bool = bool


def has_field(section: Any, name: str) -> bool:
    """Whether ``section`` (a mapping such as a ConfigDict or dict, or an attribute object)
    holds ``name``."""
    if isinstance(section, typing.Mapping) or hasattr(section, "keys"):
        return name in section
    return hasattr(section, name)


def get_field(section: Any, name: str) -> Any:
    if isinstance(section, typing.Mapping) or hasattr(section, "keys"):
        return section[name]
    return getattr(section, name)


def cast(kind: Any, value: Any, name: str) -> Any:
    """``value`` as the annotated ``kind`` (int, float, str, bool or a Literal of strings);
    a one-line ValueError naming the field ``name`` for a value of another kind. Integers are
    accepted as floats and integral floats as ints (JSON and command lines write either); a bool
    is neither an int nor a float here, so ``True`` cannot stand for 1, nor 1 for ``True``."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None
        if value is None:
            return None
        (kind,) = [k for k in typing.get_args(kind) if k is not type(None)]
    if kind is bool:
        if not isinstance(value, (bool, np_bool)):
            raise ValueError(f"{name} must be a bool, got {value!r}")
        return bool(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != int(value):
            raise ValueError(f"{name} must be an int, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return float(value)
    if kind is str or typing.get_origin(kind) is typing.Literal:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    return value  # nested sections and other types are built by their own from_config


def read_fields(cls: type, section: Any, where: str, *, skip: tuple[str, ...] = ()
                ) -> dict[str, Any]:
    """The fields of dataclass ``cls`` that ``section`` holds, cast to their annotations
    (:func:`cast`); a field it lacks takes the dataclass default (configs saved before the field
    existed; :data:`sparsemixer_jax.training.config.ADDED_FIELD_DEFAULTS` says which), and a field
    without
    a default is an error naming ``{where}{name}``. ``skip`` names fields the caller builds."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        if has_field(section, f.name):
            values[f.name] = cast(hints[f.name], get_field(section, f.name), where + f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{where}{f.name} is missing")
    return values


def check_positive(where: str, **values: float) -> None:
    """ValueError ``{where}{name} must be > 0`` for the first value that is not."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{where}{name} must be > 0, got {value}")


def check_fraction(where: str, **values: float) -> None:
    """ValueError ``{where}{name} must lie in [0, 1)`` for the first value outside."""
    for name, value in values.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{where}{name} must lie in [0, 1), got {value}")


def check_choice(where: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{where}{name}={value!r}; choose one of {choices}")
