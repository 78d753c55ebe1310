"""The parameters a model consumes in its compute dtype, cast once instead of in every layer.

A model with float32 parameters and bfloat16 compute casts each weight where it uses it: in the
forward pass and, when the backward pass recomputes elementwise operations, again there, in
every micro-batch. The gradient steps instead cast those parameters once (once per update when
several micro-batches share the copies) and differentiate with respect to the copies. This is
exact: the derivative of ``f(cast(w))`` with respect to ``w`` is the cotangent of the cast's
output converted to float32, and with respect to the copy ``c = cast(w)`` it is that same
cotangent, which the steps then convert to float32. On CPU the gradients are the same bit for
bit. On a GPU they agree to bfloat16 rounding, not bitwise: XLA:GPU compiles a matmul whose
operand is a cast (fused into the GEMM's operand read) and one whose operand is a bfloat16
array as different kernels, which sum their float32 products in different orders, so a result
at a rounding boundary lands one ulp apart (an H200 showed 10 of 1,920 elements of one
gradient apart, by at most 0.8% of their value).

Which parameters qualify is read from the model itself, not from their names: the loss is traced
and a parameter is copied when its only use is one conversion to a narrower floating dtype (also
inside the layer scan, ``jit`` and rematerialised blocks, where a stacked parameter's slice is
cast). A parameter used twice (a tied embedding), consumed in float32 (routers, norm statistics)
or handed to a custom-derivative function is left as it is: there the float32 gradient is a sum
of several converted cotangents, which a bfloat16 copy would add in bfloat16 instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core

# Primitives whose body receives each operand as its own input of the same index. Of a scan's
# operands only the scanned-over ones qualify: a constant or a carry cast inside the body is cast
# once per iteration, and its cotangents add up across iterations after their conversion.
_SCANNED_OR_CALLED = ("jit", "pjit", "closed_call", "checkpoint", "remat", "remat2", "scan")


def _body(eqn: core.JaxprEqn, index: int) -> tuple[core.Jaxpr, core.Var] | None:
    """The body jaxpr of ``eqn`` and the body's input that operand ``index`` becomes."""
    name = eqn.primitive.name
    if name not in _SCANNED_OR_CALLED:
        return None
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)  # a closed jaxpr's own, where the version has them
    if name == "scan" and index < sum(_scan_groups(eqn)):
        return None  # only the scanned-over operands are sliced once per iteration
    return body, body.invars[index]


def _scan_groups(eqn: core.JaxprEqn) -> tuple[int, int]:
    """A scan's numbers of constants and of carried values (its first operands, in order)."""
    if "num_consts" in eqn.params:
        return eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, xs = eqn.params["ft_in"].unpack()  # groups of operands (their lengths)
    if len(consts) + len(carry) + len(xs) != len(eqn.invars):
        return len(eqn.invars), 0  # a layout this reading does not know: copy nothing
    return len(consts), len(carry)


def _uses(jaxpr: core.Jaxpr, var: core.Var) -> tuple[list[jnp.dtype], list[int]] | None:
    """``(the dtypes of every conversion var goes through, the positions of jaxpr's outputs
    that are var itself)``, following it into bodies and, where a body returns it unchanged
    (the layer scan's modules hand their parameters back), out again; None when any other
    operation uses it."""
    outputs = [i for i, out in enumerate(jaxpr.outvars) if out is var]
    casts: list[jnp.dtype] = []
    for eqn in jaxpr.eqns:
        for index, operand in enumerate(eqn.invars):
            if operand is not var:
                continue
            if eqn.primitive.name == "convert_element_type":
                casts.append(jnp.dtype(eqn.params["new_dtype"]))
                continue
            body = _body(eqn, index)
            inner = None if body is None else _uses(*body)
            if inner is None:
                return None
            casts.extend(inner[0])
            for position in inner[1]:
                if eqn.primitive.name == "scan" and position < _scan_groups(eqn)[1]:
                    return None  # a carried value, not the operand
                outer = _uses(jaxpr, eqn.outvars[position])  # a scan's: the same stack
                if outer is None:
                    return None
                casts.extend(outer[0])
                outputs.extend(outer[1])
    return casts, outputs


def _copy_dtype(jaxpr: core.Jaxpr, var: core.Var, dtype: jnp.dtype) -> jnp.dtype | None:
    uses = _uses(jaxpr, var)
    if uses is None or uses[1] or len(uses[0]) != 1:
        return None  # used otherwise, returned, cast twice or never
    casts = uses[0]
    (to,) = casts
    narrower = (jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(to, jnp.floating)
                and to.itemsize < jnp.dtype(dtype).itemsize)
    return to if narrower else None


def copy_dtypes(loss: Callable[..., Any], params: Any, *args: Any) -> Any:
    """For every leaf of ``params``: the dtype ``loss(params, *args)`` casts it to in its only
    use, or None where it is used otherwise (same tree as ``params``; arrays or shapes)."""
    closed = jax.make_jaxpr(loss)(params, *args)
    leaves, treedef = jax.tree.flatten(params)
    invars = closed.jaxpr.invars[:len(leaves)]
    return treedef.unflatten([_copy_dtype(closed.jaxpr, var, jnp.dtype(leaf.dtype))
                              for var, leaf in zip(invars, leaves, strict=True)])


def cast_copies(params: Any, dtypes: Any) -> Any:
    """``params`` cast leaf by leaf to ``dtypes`` (:func:`copy_dtypes`); None where its dtype is
    None (a tree of ``params``' structure with None leaves)."""
    return jax.tree.map(lambda p, d: None if d is None else p.astype(d), params, dtypes,
                        is_leaf=lambda x: x is None)


def with_copies(params: Any, copies: Any) -> Any:
    """``params`` with each leaf that has a copy replaced by it: what the model consumes."""
    return jax.tree.map(lambda p, c: p if c is None else c, params, copies,
                        is_leaf=lambda x: x is None)
