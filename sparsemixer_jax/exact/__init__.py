"""Exact-gradient oracles by enumeration; :mod:`sparsemixer_jax.exact_gradient` gathers their
public names and documents the problem."""
