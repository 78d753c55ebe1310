"""Names a package exports but imports only on first use (PEP 562 module ``__getattr__``), so that
``import sparsemixer_jax`` and the routers need JAX alone and Flax loads only for what uses it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, defined_in: dict[str, str]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``defined_in`` (name -> the module
    that defines it) is imported on first access and kept in the package's namespace, so later
    lookups do not come back here."""

    def __getattr__(name: str) -> Any:
        if name in defined_in:
            value = getattr(importlib.import_module(defined_in[name]), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(defined_in))

    return __getattr__, __dir__
