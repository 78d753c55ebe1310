"""Compiling for hardware this machine does not have (ahead-of-time, "deviceless" compiles).

* :mod:`~sparsemixer_jax.aot.targets`: TPU slices and H100 hosts as compile-only devices, and
  the H100 description XLA compiles for.
* :mod:`~sparsemixer_jax.aot.analysis`: what a compiled program says before it runs (memory,
  FLOPs, collectives, kernels).
* :mod:`~sparsemixer_jax.aot.hlo`: the optimised HLO's text as computations and instructions.
* :mod:`~sparsemixer_jax.aot.roofline`: a compiled program's predicted time and MFU bound on a
  chip, from its optimised HLO.
* :mod:`~sparsemixer_jax.aot.translation`: the translation task's training and decode steps,
  built abstractly on a target's mesh and compiled.
* :mod:`~sparsemixer_jax.aot.lm`: the language model's training step, likewise.
* :mod:`~sparsemixer_jax.aot.command`: ``python -m experiments.compile``.
"""
