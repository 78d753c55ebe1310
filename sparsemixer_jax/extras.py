"""Which extra installs each optional dependency, so that importing one that is missing names the
extra (``pip install 'sparsemixer-jax[train]'``) instead of Python's bare ``No module named``.

``import sparsemixer_jax`` appends :class:`MissingExtraFinder` to ``sys.meta_path``. Python asks
it only after every other finder has failed to find a module, so it changes nothing but the
message of an import that fails anyway. A probe (``importlib.util.find_spec``, which orbax's
paths and JAX's compilation cache use to ask whether tensorflow is installed) still gets None.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

#: The top-level package of each optional dependency and the extra of ``pyproject.toml`` that
#: installs it.
EXTRA_OF = {
    **dict.fromkeys(("flax", "optax", "orbax", "ml_collections", "absl", "sentencepiece",
                     "sacrebleu", "sacremoses", "tensorflow", "tensorflow_datasets",
                     "tensorboardX", "tqdm"), "train"),
    **dict.fromkeys(("safetensors", "tokenizers", "jinja2"), "hf"),
    "matplotlib": "experiments",
    **dict.fromkeys(("chex", "sklearn", "pytest"), "test"),
}


_PROBE = importlib.util.find_spec.__code__


class MissingExtraFinder(importlib.abc.MetaPathFinder):
    """The last finder: a top-level package of :data:`EXTRA_OF` that no finder before it found
    is a ModuleNotFoundError naming the extra that installs it."""

    def find_spec(self, fullname, path, target=None):
        extra = EXTRA_OF.get(fullname) if path is None else None
        # Called by importlib.util.find_spec (through importlib._bootstrap._find_spec): a
        # question whether the package is there, to which "no" is the answer, not an error.
        if extra is not None and sys._getframe(2).f_code is not _PROBE:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: it comes with sparsemixer-jax's {extra} extra "
                f"(pip install 'sparsemixer-jax[{extra}]'; the core install has JAX and NumPy "
                "alone)", name=fullname)
        return None


def name_missing_extras() -> None:
    """Appends :class:`MissingExtraFinder` to ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MissingExtraFinder) for f in sys.meta_path):
        sys.meta_path.append(MissingExtraFinder())
