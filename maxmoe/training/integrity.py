"""Trusting a checkpoint: a digest of its arrays checked at restore, and the last step proven good.

Digest: per array, two 32-bit sums computed on the devices as the step is saved: of its
elements' bit patterns, and of each pattern times a weight from its position. One flipped bit
changes the first, two swapped elements the second. Integer sums do not depend on the order
of their terms, so an array has one digest on any mesh, device count or number of processes.
It is stored with the step ({"arrays": {path: hex}, "proven": step}) and a restored state
whose digest differs is refused: a damaged file must not be trained on.

Proven: a saved step is proven once a step trained from it (or from a later save) has a finite
loss and gradient norm. `Proof` tracks the newest proven step of a run, and `KeepProven` keeps
it through `checkpoint.keep`'s deletions, so while newer steps are unproven (a run that went
non-finite) the last step that trained cleanly stays on disk.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# Odd multipliers of the position along each axis (golden-ratio and xxhash primes).
_AXIS_WEIGHTS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1, 0xD3A2646D, 0xFD7046C5, 0xB55A4F09)


def leaf_paths(tree: Any) -> dict[str, Any]:
    """{'params/embed/embedding': leaf, ...} with dict keys, attributes and indices alike as names."""

    def name(key) -> str:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(name(k) for k in path): leaf for path, leaf in leaves}


def _bits(x: jax.Array) -> jax.Array:
    """An array's elements as their bit patterns, uint32."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize > 4:  # 64-bit: two words per element
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _array_digest(x: jax.Array) -> jax.Array:
    bits = _bits(x)
    weight = jnp.ones(bits.shape, jnp.uint32)
    for axis in range(bits.ndim):
        position = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis)
        weight = weight + position * jnp.uint32(_AXIS_WEIGHTS[axis % len(_AXIS_WEIGHTS)] + 2 * (axis // 8))
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(bits * weight, dtype=jnp.uint32)])


def _replicated(leaves: list) -> Any:
    """A replicated sharding on the mesh of the first leaf that has one (every process gets the digest)."""
    mesh = next((x.sharding.mesh for x in leaves if isinstance(getattr(x, "sharding", None), NamedSharding)), None)
    return NamedSharding(mesh, PartitionSpec()) if mesh is not None else None


@functools.lru_cache(maxsize=8)
def _digest_program(out_sharding: Any):
    """The jitted digest of a list of arrays (one per output sharding: jit keeps its compilations)."""
    return jax.jit(lambda xs: jnp.stack([_array_digest(x) for x in xs]), out_shardings=out_sharding)


def state_digest(tree: Any) -> dict[str, str]:
    """{array path: 16 hex digits} of every array of `tree` (device arrays on any mesh, or host arrays)."""
    paths = leaf_paths(tree)
    if not paths:
        return {}
    leaves = list(paths.values())
    digests = _digest_program(_replicated(leaves))(leaves)
    host = np.asarray(digests.addressable_data(0) if hasattr(digests, "addressable_data") else digests)
    return {path: f"{int(a):08x}{int(b):08x}" for path, (a, b) in zip(paths, host)}


def first_difference(stored: Any, tree: Any) -> str | None:
    """The path of the first array of `tree` whose digest is not the `stored` one, or None.

    Arrays `stored` does not name are not compared (a part restored from a larger state).
    """
    if not isinstance(stored, dict):
        return None
    digests = state_digest({key: leaf for key, leaf in leaf_paths(tree).items() if key in stored})
    return next((path for path, digest in digests.items() if stored[path] != digest), None)


class Proof:
    """The newest proven step of a run, from the steps it saved or restored and the clean steps since."""

    def __init__(self):
        self.proven: int | None = None  # the newest step a finite step trained from
        self.steps: set[int] = set()  # steps saved or found on disk

    def inherit(self, record: Any) -> None:
        """Take the proven step stored with a restored step (the run that wrote it proved it)."""
        proven = record.get("proven") if isinstance(record, dict) else None
        if isinstance(proven, int) and not isinstance(proven, bool) and proven in self.steps:
            self.proven = proven

    def trained_cleanly(self, step: int) -> None:
        """Step `step` had a finite loss and gradient norm: the newest saved step before it is proven."""
        before = [s for s in self.steps if s < step]
        if before and (self.proven is None or max(before) > self.proven):
            self.proven = max(before)


@dataclasses.dataclass
class KeepProven:
    """An orbax preservation policy: keep the newest proven step (newer steps are unproven)."""

    proof: Proof

    def should_preserve(self, checkpoints, *, context) -> list[bool]:  # noqa: ARG002 - orbax's protocol
        return [c.step == self.proof.proven for c in checkpoints]
