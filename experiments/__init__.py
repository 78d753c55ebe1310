"""Entry points: python -m experiments.<name>.

Every entry point is a module of this package, so this runs first in each command, before JAX
starts its backend: on a machine without an accelerator, JAX starts on the CPU alone instead of
trying the installed accelerator plugins
(:func:`sparsemixer_jax.training.cli.cpu_only_where_no_accelerator`).
"""

from sparsemixer_jax.training.cli import cpu_only_where_no_accelerator

cpu_only_where_no_accelerator()
