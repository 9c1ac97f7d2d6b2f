"""Which manual mesh axes a value varies over inside `shard_map`, and making values vary alike.

Inside shard_map (check_vma) every value's type says which manual axes it varies over. A custom
VJP must return each cotangent varying as its input, and a kernel's output (which carries no
mark of its own) must be given one. Operands are brought to the union of their axes first, so
that an operand replicated over an axis (the weights, over the data axes) gets its gradient
summed over that axis, as jax does for its own ops. Outside shard_map every set is empty.
A sum folded by a scan needs its carry to vary as the summands do: `sum_over_blocks`.
"""

from __future__ import annotations

import jax


def varying_axes(x) -> tuple[str, ...]:
    """The manual mesh axes x varies over, sorted (empty outside shard_map)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    axes = manual.varying if manual is not None else getattr(aval, "vma", ())
    return tuple(sorted(axes))


def vary_over(x, axes: tuple[str, ...]):
    """x marked as varying over the manual axes `axes` (those it does not already vary over)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_as(x, *like, axes: str | tuple[str, ...] = ()):
    """x marked as varying over every manual axis the arrays `like` vary over, and over `axes`:
    for an output whose type jax takes from elsewhere (a kernel's, a collective's buffer)."""
    extra = (axes,) if isinstance(axes, str) else tuple(axes)
    return vary_over(x, tuple(sorted(set(extra).union(*(varying_axes(a) for a in like)))))


def vary_alike(*arrays) -> list:
    """The arrays made to vary over the same manual axes: the union of theirs."""
    union = tuple(sorted(set().union(*(varying_axes(a) for a in arrays))))
    return [vary_over(a, union) for a in arrays]


def sum_over_blocks(add_block, blocks_in):
    """add_block(acc, inputs of one block) -> (acc, None) folded over the leading axis of every
    input. The first block starts the sum (a zeros carry would not vary over a shard_map's axes
    as the blocks do); a scan adds the others."""
    first, _ = add_block(0.0, jax.tree.map(lambda a: a[0], blocks_in))
    acc, _ = jax.lax.scan(add_block, first, jax.tree.map(lambda a: a[1:], blocks_in))
    return acc
