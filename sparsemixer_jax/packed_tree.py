"""A tree of metrics whose float32 leaves travel in one vector.

The compiled steps return and accumulate many small metrics (a few per MoE layer: loads, router
diagnostics). Each leaf of a compiled program's output is a buffer of its own, and XLA computes
each in a kernel of its own: about 200 one-element kernels per accumulation and as many again
in the update for a 16-layer MoE model, each costing a kernel launch. :class:`PackedTree` holds
the float32 leaves concatenated in one vector (the other leaves, such as a bool flag, as they
are), so that a program computes them in a few kernels (the concatenation, which takes each
leaf's expression as its operand) and returns one buffer; the leaves are read back by slicing,
on the device or, after ``jax.device_get``, on the host. Packing copies the values. A program
that computes on the leaves computes on :meth:`PackedTree.unpack`'s and packs the result: each
value is then computed by the same expression as on the unpacked tree, rounded the same way
(XLA may contract a product and a sum written in one expression, not one split by the
concatenation).

A packed tree can be stacked: ``jax.lax.scan`` returning one per step stacks its ``vector``
(``[steps, size]``) and its other leaves, and :meth:`PackedTree.unpack` then gives each leaf
with the leading ``[steps]`` axis, so a layer scan's metrics are one stacked output, not one
per metric and layer.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["PackedTree"]


@jax.tree_util.register_pytree_node_class
class PackedTree(Mapping):
    """A pytree of arrays with its float32 leaves in one vector.

    ``vector``: float32 ``[*lead, total size of the float32 leaves]`` (``lead`` empty, or the
    axes it was stacked on); ``others``: the other leaves, in order; ``layout``: static
    ``(treedef, per leaf its shape if float32 else None)``. As a pytree its children are
    ``vector`` and ``others``; as a mapping (for a tree with a dict at its top) it reads as the
    unpacked tree's top level (``metrics["loss"]``), so code that indexed the tree indexes it
    unchanged.
    """

    def __init__(self, vector: Any, others: tuple, layout: tuple):
        self.vector, self.others, self.layout = vector, tuple(others), layout
        self._unpacked: Any = None

    @classmethod
    def pack(cls, tree: Any) -> PackedTree:
        """``tree`` packed (its float32 leaves raveled and concatenated, in flattening order)."""
        leaves, treedef = jax.tree.flatten(tree)
        floats = [jnp.ravel(leaf) for leaf in leaves if leaf.dtype == jnp.float32]
        vector = jnp.concatenate(floats) if floats else jnp.zeros((0,), jnp.float32)
        shapes = tuple(tuple(leaf.shape) if leaf.dtype == jnp.float32 else None
                       for leaf in leaves)
        return cls(vector, tuple(leaf for leaf in leaves if leaf.dtype != jnp.float32),
                   (treedef, shapes))

    def unpack(self) -> Any:
        """The tree: each float32 leaf a slice of ``vector``, ``[*lead, *shape]`` (numpy views
        after a ``jax.device_get``), the others as held."""
        if self._unpacked is None:
            treedef, shapes = self.layout
            others, leaves, start = iter(self.others), [], 0
            for shape in shapes:
                if shape is None:
                    leaves.append(next(others))
                    continue
                size = math.prod(shape)
                leaves.append(self.vector[..., start:start + size].reshape(
                    (*self.vector.shape[:-1], *shape)))
                start += size
            self._unpacked = jax.tree.unflatten(treedef, leaves)
        return self._unpacked

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return (self.vector, *self.others), self.layout

    @classmethod
    def tree_unflatten(cls, layout: tuple, children: tuple) -> PackedTree:
        return cls(children[0], children[1:], layout)

    def __getitem__(self, key: str) -> Any:
        return self.unpack()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.unpack())

    def __len__(self) -> int:
        return len(self.unpack())

    def __repr__(self) -> str:
        return f"PackedTree({self.unpack()!r})"
