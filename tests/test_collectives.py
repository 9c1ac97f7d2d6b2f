"""Ragged all-to-all emulation and grouped matmul against NumPy oracles.

The oracle for ragged all-to-all is a direct NumPy transcription of the SEND/RECEIVE
pseudocode in the `jax.lax.ragged_all_to_all` docstring, run per group of shards that
share every mesh coordinate except the communication axis.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxmoe.config import GROUPED_MATMUL_BACKENDS
from maxmoe.kernels.grouped_matmul import grouped_matmul, tokamax_problem
from maxmoe.parallel.collectives import has_native_ragged_all_to_all, ragged_all_to_all
from maxmoe.parallel.dispatch_shard import chunk_slices

COMM_AXIS = "expert"


# ----------------------------------------------------------------------------------
# NumPy model of ragged_all_to_all for one group of P peers.


def numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    """Per-peer lists in, per-peer results out; follows the jax docstring pseudocode."""
    num_peers = len(operands)
    num_slices = len(input_offsets[0])
    slices_per_peer = num_slices // num_peers
    results = [np.array(o, copy=True) for o in outputs]
    for src in range(num_peers):
        for i in range(num_slices):
            dst = i // slices_per_peer
            # Receiver dst sees this as its slice j, from peer src.
            j = src * slices_per_peer + i % slices_per_peer
            assert recv_sizes[dst][j] == send_sizes[src][i]
            start, size = output_offsets[src][i], recv_sizes[dst][j]
            rows = operands[src][input_offsets[src][i] : input_offsets[src][i] + size]
            results[dst][start : start + size] = rows
    return results


def numpy_operand_grad(results, input_offsets, send_sizes, output_offsets, num_operand_rows):
    """d sum(results**2) / d operand: each sent row receives 2 * the row it became."""
    num_peers = len(results)
    num_slices = len(input_offsets[0])
    slices_per_peer = num_slices // num_peers
    grads = [np.zeros((num_operand_rows,) + results[0].shape[1:], results[0].dtype) for _ in range(num_peers)]
    for src in range(num_peers):
        for i in range(num_slices):
            dst = i // slices_per_peer
            size, start_in, start_out = (send_sizes[src][i], input_offsets[src][i], output_offsets[src][i])
            grads[src][start_in : start_in + size] += 2 * results[dst][start_out : start_out + size]
    return grads


def _random_layout(rng, sizes, capacity):
    """Offsets placing `sizes` in a buffer of `capacity` rows: random order and gaps."""
    sizes = np.asarray(sizes)
    order = rng.permutation(len(sizes))
    gaps = rng.multinomial(capacity - sizes.sum(), np.ones(len(sizes) + 1) / (len(sizes) + 1))
    offsets = np.zeros(len(sizes), np.int32)
    position = 0
    for n, k in enumerate(order):
        position += gaps[n]
        offsets[k] = position
        position += sizes[k]
    return offsets


def _send_sizes(rng, scenario, num_peers, num_slices):
    """[src, slice] rows sent, shaped by the scenario."""
    if scenario == "uniform":
        sizes = rng.integers(0, 6, size=(num_peers, num_slices))
    elif scenario == "skewed":
        # Most traffic goes to the last peer, as with a hot expert.
        sizes = rng.integers(0, 2, size=(num_peers, num_slices))
        sizes[:, -(num_slices // num_peers) :] += rng.integers(8, 20, size=(num_peers, 1))
    elif scenario == "silent_shards":
        # Peer 0 sends nothing and peer 1 receives nothing.
        sizes = rng.integers(1, 5, size=(num_peers, num_slices))
        sizes[0, :] = 0
        slices_per_peer = num_slices // num_peers
        sizes[:, slices_per_peer : 2 * slices_per_peer] = 0
    elif scenario == "nothing_sent":
        sizes = np.zeros((num_peers, num_slices), np.int64)
    else:
        raise AssertionError(scenario)
    return sizes.astype(np.int32)


def make_case(seed, scenario, num_groups, num_peers, slices_per_peer, trailing_shape):
    """Random ragged all-to-all arguments for `num_groups` independent groups of peers.

    Returns dict of lists [group][peer] of NumPy arrays.
    """
    rng = np.random.default_rng(seed)
    num_slices = num_peers * slices_per_peer
    sends = [_send_sizes(rng, scenario, num_peers, num_slices) for _ in range(num_groups)]

    def recv_sizes_of(send):
        # recv[dst][src*spp + s] = send[src][dst*spp + s]
        recv = np.zeros_like(send)
        for src, dst, s in itertools.product(range(num_peers), range(num_peers), range(slices_per_peer)):
            recv[dst, src * slices_per_peer + s] = send[src, dst * slices_per_peer + s]
        return recv

    recvs = [recv_sizes_of(send) for send in sends]
    # One buffer size for every shard (shard_map blocks are uniform), with slack so
    # that gaps and untouched rows exist.
    num_operand_rows = int(max(s.sum(axis=1).max() for s in sends)) + 5
    num_output_rows = int(max(r.sum(axis=1).max() for r in recvs)) + 3

    case = {k: [] for k in ("operand", "output", "input_offsets", "send_sizes", "output_offsets", "recv_sizes")}
    for send, recv in zip(sends, recvs):
        # Where each receiver puts each incoming slice, in receiver slice order.
        recv_offsets = np.stack([_random_layout(rng, recv[dst], num_output_rows) for dst in range(num_peers)])
        output_offsets = np.zeros_like(send)
        for src, dst, s in itertools.product(range(num_peers), range(num_peers), range(slices_per_peer)):
            output_offsets[src, dst * slices_per_peer + s] = recv_offsets[dst, src * slices_per_peer + s]
        case["operand"].append(
            [rng.standard_normal((num_operand_rows,) + trailing_shape).astype(np.float32) for _ in range(num_peers)]
        )
        case["output"].append(
            [rng.standard_normal((num_output_rows,) + trailing_shape).astype(np.float32) for _ in range(num_peers)]
        )
        case["input_offsets"].append([_random_layout(rng, send[src], num_operand_rows) for src in range(num_peers)])
        case["send_sizes"].append(list(send))
        case["output_offsets"].append(list(output_offsets))
        case["recv_sizes"].append(list(recv))
    return case


# ----------------------------------------------------------------------------------
# Running the emulation inside shard_map.

# (mesh shape, mesh axis names, mesh axes the arguments are sharded over). The last
# layout leaves "tensor" replicated, as the MoE dispatch does with token activations.
MESH_LAYOUTS = {
    "1d": ((8,), ("expert",), ("expert",)),
    "data_expert": ((2, 4), ("data", "expert"), ("data", "expert")),
    "data_expert_tensor": ((2, 2, 2), ("data", "expert", "tensor"), ("data", "expert", "tensor")),
    "tensor_replicated": ((2, 2, 2), ("data", "expert", "tensor"), ("data", "expert")),
}


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _group_keys(mesh, sharded_axes):
    """Mesh coordinates of each independent group: every sharded axis but COMM_AXIS."""
    other = [a for a in sharded_axes if a != COMM_AXIS]
    return other, list(itertools.product(*(range(mesh.shape[a]) for a in other)))


def _to_global(mesh, sharded_axes, per_group_per_peer):
    """Stack [group][peer] arrays into [*sharded mesh dims, ...] global arrays."""
    other, keys = _group_keys(mesh, sharded_axes)
    first = per_group_per_peer[0][0]
    shape = tuple(mesh.shape[a] for a in sharded_axes) + first.shape
    out = np.zeros(shape, first.dtype)
    for group, key in enumerate(keys):
        coords = dict(zip(other, key))
        for peer in range(mesh.shape[COMM_AXIS]):
            coords[COMM_AXIS] = peer
            out[tuple(coords[a] for a in sharded_axes)] = per_group_per_peer[group][peer]
    return out


def _from_global(mesh, sharded_axes, array):
    other, keys = _group_keys(mesh, sharded_axes)
    result = []
    for key in keys:
        coords = dict(zip(other, key))
        peers = []
        for peer in range(mesh.shape[COMM_AXIS]):
            coords[COMM_AXIS] = peer
            peers.append(array[tuple(coords[a] for a in sharded_axes)])
        result.append(peers)
    return result


def sharded_ragged_all_to_all(mesh, sharded_axes, emulate):
    """Global-array function: each shard runs ragged_all_to_all over COMM_AXIS."""
    num_lead = len(sharded_axes)
    spec = P(*sharded_axes)

    def per_shard(*args):
        local = [a.reshape(a.shape[num_lead:]) for a in args]
        result = ragged_all_to_all(*local, axis_name=COMM_AXIS, emulate=emulate)
        return result.reshape((1,) * num_lead + result.shape)

    return jax.shard_map(per_shard, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec)


ARG_NAMES = ("operand", "output", "input_offsets", "send_sizes", "output_offsets", "recv_sizes")


def _case_for_layout(layout, scenario, seed, slices_per_peer=1, trailing_shape=(3,)):
    shape, names, sharded_axes = MESH_LAYOUTS[layout]
    mesh = _mesh(shape, names)
    other, keys = _group_keys(mesh, sharded_axes)
    case = make_case(seed, scenario, len(keys), mesh.shape[COMM_AXIS], slices_per_peer, trailing_shape)
    global_args = [jnp.asarray(_to_global(mesh, sharded_axes, case[n])) for n in ARG_NAMES]
    return mesh, sharded_axes, case, global_args


SCENARIOS = ("uniform", "skewed", "silent_shards", "nothing_sent")


@pytest.mark.parametrize("layout", list(MESH_LAYOUTS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_emulation_matches_numpy_model(layout, scenario):
    seed = SCENARIOS.index(scenario) * 10 + list(MESH_LAYOUTS).index(layout)
    mesh, sharded_axes, case, global_args = _case_for_layout(layout, scenario, seed)
    got = np.asarray(jax.jit(sharded_ragged_all_to_all(mesh, sharded_axes, True))(*global_args))
    got_groups = _from_global(mesh, sharded_axes, got)
    for group, got_peers in enumerate(got_groups):
        want = numpy_ragged_all_to_all(*(case[n][group] for n in ARG_NAMES))
        for peer, (g, w) in enumerate(zip(got_peers, want)):
            np.testing.assert_array_equal(g, w, err_msg=f"group {group} peer {peer}")
    if scenario == "nothing_sent":
        np.testing.assert_array_equal(got, np.asarray(global_args[1]))


# The worked example from the jax.lax.ragged_all_to_all docstring (axis of size 2).
DOCSTRING_EXAMPLE = {
    "operand": [[1, 2, 2], [3, 4, 0]],
    "output": [[0, 0, 0, 0], [0, 0, 0, 0]],
    "input_offsets": [[0, 1], [0, 1]],
    "send_sizes": [[1, 2], [1, 1]],
    "output_offsets": [[0, 0], [1, 2]],
    "recv_sizes": [[1, 1], [2, 1]],
}
DOCSTRING_RESULT = [[1, 3, 0, 0], [2, 2, 4, 0]]


def test_numpy_model_reproduces_docstring_example():
    args = [[np.array(a) for a in DOCSTRING_EXAMPLE[n]] for n in ARG_NAMES]
    got = numpy_ragged_all_to_all(*args)
    np.testing.assert_array_equal(np.stack(got), DOCSTRING_RESULT)


def test_emulation_reproduces_docstring_example():
    # A (4, 2) mesh: four independent copies of the example, exchanged over "expert".
    mesh = _mesh((4, 2), ("data", COMM_AXIS))
    sharded_axes = ("data", COMM_AXIS)
    global_args = []
    for n in ARG_NAMES:
        per_peer = np.array(DOCSTRING_EXAMPLE[n], np.float32 if n in ("operand", "output") else np.int32)
        global_args.append(jnp.asarray(np.broadcast_to(per_peer, (4,) + per_peer.shape)))
    got = jax.jit(sharded_ragged_all_to_all(mesh, sharded_axes, True))(*global_args)
    np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(DOCSTRING_RESULT, (4, 2, 4)))


@pytest.mark.parametrize("layout", ["1d", "data_expert"])
def test_emulation_several_slices_per_peer_and_trailing_dims(layout):
    # K = 2 x axis size: each peer gets two separately placed slices from every sender.
    mesh, sharded_axes, case, global_args = _case_for_layout(
        layout, "uniform", seed=99, slices_per_peer=2, trailing_shape=(2, 3)
    )
    got = np.asarray(jax.jit(sharded_ragged_all_to_all(mesh, sharded_axes, True))(*global_args))
    for group, got_peers in enumerate(_from_global(mesh, sharded_axes, got)):
        want = numpy_ragged_all_to_all(*(case[n][group] for n in ARG_NAMES))
        for g, w in zip(got_peers, want):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("layout", ["1d", "data_expert", "tensor_replicated"])
@pytest.mark.parametrize("scenario", ["skewed", "silent_shards"])
def test_emulation_gradient_matches_numpy(layout, scenario):
    mesh, sharded_axes, case, global_args = _case_for_layout(layout, scenario, seed=7)
    exchange = sharded_ragged_all_to_all(mesh, sharded_axes, True)

    def loss(operand, output, *index_args):
        return jnp.sum(exchange(operand, output, *index_args) ** 2)

    grad_operand, grad_output = jax.jit(jax.grad(loss, argnums=(0, 1)))(*global_args)
    grad_operand_groups = _from_global(mesh, sharded_axes, np.asarray(grad_operand))
    grad_output_groups = _from_global(mesh, sharded_axes, np.asarray(grad_output))
    for group in range(len(grad_operand_groups)):
        args = [case[n][group] for n in ARG_NAMES]
        results = numpy_ragged_all_to_all(*args)
        want_operand = numpy_operand_grad(results, args[2], args[3], args[4], args[0][0].shape[0])
        for g, w in zip(grad_operand_groups[group], want_operand):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
        # Output rows that were overwritten get no gradient; the rest get 2 * value.
        marked = numpy_ragged_all_to_all([np.full_like(o, np.nan) for o in args[0]], args[1], *args[2:])
        for g, m in zip(grad_output_groups[group], marked):
            want = np.where(np.isnan(m), 0.0, 2 * m)
            np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
        # Rows never sent (gaps, slack) must get exactly zero.
        for src, g in enumerate(grad_operand_groups[group]):
            sent = np.zeros(g.shape[0], bool)
            for start, size in zip(args[2][src], args[3][src]):
                sent[start : start + size] = True
            assert not np.any(g[~sent])


def test_chunk_slices_cuts_each_slice_into_consecutive_pieces():
    starts = np.array([0, 3, 3, 10, 17, 40, 41, 60], np.int32)
    sizes = np.array([3, 0, 7, 1, 23, 1, 2, 5], np.int32)
    for chunks in (1, 2, 3, 5):
        got_starts, got_sizes = (np.asarray(a) for a in chunk_slices(jnp.asarray(starts), jnp.asarray(sizes), chunks))
        assert got_starts.shape == got_sizes.shape == (len(starts) * chunks,)
        for i, (start, size) in enumerate(zip(starts, sizes)):
            # NumPy's array_split gives the first size % chunks pieces one row more, in order.
            pieces = np.array_split(np.arange(start, start + size), chunks)
            want_sizes = [len(p) for p in pieces]
            want_starts = start + np.concatenate([[0], np.cumsum(want_sizes)[:-1]])
            np.testing.assert_array_equal(got_sizes[i * chunks : (i + 1) * chunks], want_sizes)
            np.testing.assert_array_equal(got_starts[i * chunks : (i + 1) * chunks], want_starts)


@pytest.mark.parametrize("scenario", ["skewed", "silent_shards"])
def test_emulation_of_chunked_slices_matches_numpy_and_the_unchunked_exchange(scenario):
    # Each (sender, receiver) slice cut in 3 with chunk_slices: uneven pieces, and empty
    # ones wherever a slice has fewer than 3 rows (K = 3 x P slices).
    chunks = 3
    mesh, sharded_axes, case, _ = _case_for_layout("data_expert", scenario, seed=11)
    chunked = {n: case[n] for n in ("operand", "output")}

    def cut(starts_name, sizes_name):
        pairs = [
            [chunk_slices(jnp.asarray(st), jnp.asarray(sz), chunks) for st, sz in zip(group_st, group_sz)]
            for group_st, group_sz in zip(case[starts_name], case[sizes_name])
        ]
        return [[np.asarray(p[0]) for p in g] for g in pairs], [[np.asarray(p[1]) for p in g] for g in pairs]

    chunked["input_offsets"], chunked["send_sizes"] = cut("input_offsets", "send_sizes")
    chunked["output_offsets"], _ = cut("output_offsets", "send_sizes")
    _, chunked["recv_sizes"] = cut("output_offsets", "recv_sizes")  # sizes only: pieces of each received slice
    assert any(np.any(s == 0) for g in chunked["send_sizes"] for s in g)
    global_args = [jnp.asarray(_to_global(mesh, sharded_axes, chunked[n])) for n in ARG_NAMES]
    got = np.asarray(jax.jit(sharded_ragged_all_to_all(mesh, sharded_axes, True))(*global_args))
    for group, got_peers in enumerate(_from_global(mesh, sharded_axes, got)):
        want = numpy_ragged_all_to_all(*(chunked[n][group] for n in ARG_NAMES))
        unchunked = numpy_ragged_all_to_all(*(case[n][group] for n in ARG_NAMES))
        for g, w, u in zip(got_peers, want, unchunked):
            np.testing.assert_array_equal(g, w)
            np.testing.assert_array_equal(g, u)


def test_native_lowers_to_collective_for_cuda_and_emulation_does_not_for_cpu():
    mesh, sharded_axes, _, global_args = _case_for_layout("data_expert", "uniform", seed=3)
    native = jax.jit(sharded_ragged_all_to_all(mesh, sharded_axes, emulate=False))
    native_text = native.trace(*global_args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @ragged_all_to_all" in native_text

    emulated = jax.jit(sharded_ragged_all_to_all(mesh, sharded_axes, emulate=True))
    emulated_text = emulated.trace(*global_args).lower(lowering_platforms=("cpu",)).as_text()
    assert "ragged_all_to_all" not in emulated_text
    assert "all_to_all" in emulated_text


def test_has_native_ragged_all_to_all():
    assert not has_native_ragged_all_to_all("cpu")
    for platform in ("cuda", "rocm", "tpu", "gpu"):
        assert has_native_ragged_all_to_all(platform)
    with pytest.raises(ValueError, match="'metal'.*'cpu'"):
        has_native_ragged_all_to_all("metal")


# ----------------------------------------------------------------------------------
# Grouped matmul.


def numpy_grouped_matmul(x_MD, w_GDF, group_sizes_G):
    out_MF = np.zeros((x_MD.shape[0], w_GDF.shape[2]), np.float64)
    start = 0
    for g, size in enumerate(group_sizes_G):
        out_MF[start : start + size] = x_MD[start : start + size].astype(np.float64) @ w_GDF[g]
        start += size
    return out_MF


GROUP_SIZE_CASES = {
    "full": [3, 5, 2, 6],
    "empty_group": [4, 0, 7, 5],
    "short_of_rows": [2, 0, 3, 1],  # sums to 6 of 16 rows: the rest must be zero
    "all_empty": [0, 0, 0, 0],
}


@pytest.mark.parametrize("case", list(GROUP_SIZE_CASES))
def test_grouped_matmul_backends_match_numpy(case):
    rng = np.random.default_rng(len(case))
    group_sizes = np.array(GROUP_SIZE_CASES[case], np.int32)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    w = rng.standard_normal((4, 8, 5)).astype(np.float32)
    want = numpy_grouped_matmul(x, w, group_sizes)
    # mosaic_gpu needs a GPU (see test_kernels.py); tokamax runs here only where it is installed
    for backend in [
        b for b in GROUPED_MATMUL_BACKENDS if b != "mosaic_gpu" and (b != "tokamax" or not tokamax_problem())
    ]:
        got = jax.jit(grouped_matmul, static_argnames="backend")(x, w, group_sizes, backend=backend)
        assert got.dtype == jnp.float32 and got.shape == (16, 5)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0, err_msg=backend)
        assert not np.any(np.asarray(got)[group_sizes.sum() :])


@pytest.mark.parametrize("case", ["empty_group", "short_of_rows"])
def test_grouped_matmul_gradients_agree(case):
    rng = np.random.default_rng(5)
    group_sizes = jnp.array(GROUP_SIZE_CASES[case], jnp.int32)
    x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 8, 5)), jnp.float32)
    target = jnp.asarray(rng.standard_normal((16, 5)), jnp.float32)

    def loss(x, w, backend):
        return jnp.sum((grouped_matmul(x, w, group_sizes, backend=backend) - target) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnames="backend")
    grad_x_ragged, grad_w_ragged = grad(x, w, "ragged_dot")
    grad_x_dense, grad_w_dense = grad(x, w, "dense_loop")
    np.testing.assert_allclose(grad_x_ragged, grad_x_dense, atol=1e-5, rtol=0)
    np.testing.assert_allclose(grad_w_ragged, grad_w_dense, atol=1e-5, rtol=0)
    # The empty group's weights and the rows past the sum take no gradient.
    assert not np.any(np.asarray(grad_w_ragged)[1])
    assert not np.any(np.asarray(grad_x_ragged)[int(group_sizes.sum()) :])


def test_grouped_matmul_keeps_input_dtype():
    x = jnp.ones((4, 2), jnp.bfloat16)
    w = jnp.ones((2, 2, 3), jnp.bfloat16)
    out = grouped_matmul(x, w, jnp.array([1, 3], jnp.int32))
    assert out.dtype == jnp.bfloat16


def test_grouped_matmul_rejects_unknown_backend():
    with pytest.raises(ValueError, match="'megablox'.*'ragged_dot', 'mosaic_gpu', 'tokamax', 'dense_loop'"):
        grouped_matmul(jnp.ones((2, 2)), jnp.ones((1, 2, 2)), jnp.array([2]), backend="megablox")
