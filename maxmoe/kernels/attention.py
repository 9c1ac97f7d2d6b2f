"""Causal flash-attention kernels for MLA's shapes, and the shard_map that runs them on a mesh.

Kernels (`kernel(name)`; the model picks one through its layout, `auto` in maxmoe.kernels.choice):
  triton  jax's Pallas Triton flash attention; v zero-padded to the qk head dim and sliced back
          (same values and gradients, 1.6x the work); Pallas interpret mode on CPU
  cudnn   cuDNN's flash attention through jax's binding, v at its own head dim (cuDNN >= 9.10);
          needs cuDNN at trace time
  tokamax tokamax.dot_product_attention (optional package)
`sharded_attention(name, mesh, spec_BTHK)` runs one inside `jax.shard_map` over the batch and
heads axes (GSPMD does not partition custom calls; no collective is needed); the sequence axis
must not be sharded. How each kernel runs: docs/KERNELS.md, "Attention kernels".

Axis legend: B batch, T query time, S key time, H heads, K head dim.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxmoe.parallel.names import ATTENTION_CORE_SCOPE
from maxmoe.parallel.shard_context import shard_map_in_context

KERNELS = ("triton", "cudnn", "tokamax")
# Triton pads the head dim to a power of two (192 -> 256); 64 x 64 forward tiles of 256
# columns fit the shared memory of Hopper with two pipeline stages, 128 x 128 would not.
TRITON_BLOCK = 64
TRITON_BACKWARD_BLOCK = 32
TRITON_MIN_BLOCK = 16  # the smallest tile the kernel takes: sequence lengths must be multiples of it
CUDNN_MLA_VERSION = 91000  # the first cuDNN (9.10) whose flash attention takes a value head dim of its own


def _triton_module():
    with warnings.catch_warnings():
        # jax >= 0.11 marks the module deprecated in favour of tokamax; the kernel is unchanged.
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention

    return attention


def triton_available() -> str:
    """'' when jax ships the Pallas Triton attention kernel, else why not."""
    try:
        _triton_module()
    except Exception as e:  # noqa: BLE001 - any import failure means the kernel is unavailable
        return f"jax {jax.__version__} has no jax.experimental.pallas.ops.gpu.attention ({type(e).__name__})"
    return ""


def triton_lowers_here() -> str:
    """'' when this process can lower the Triton kernel for CUDA, else why not.

    Under a mesh of a GPU's devices (`jax.set_mesh`; the compile-only devices of
    maxmoe.analysis.gpu_compile too) jax lowers Pallas kernels for that GPU; elsewhere
    `triton_lowers_on_host` answers.
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if device is not None and device.platform in ("gpu", "cuda"):
        return triton_available()
    return triton_lowers_on_host()


@functools.cache
def triton_lowers_on_host() -> str:
    """'' when this process lowers the Triton kernel for CUDA outside a GPU mesh, else why not.

    jax 0.10 lowers Pallas Triton kernels for CUDA on a CPU host; newer jax asks the local
    GPU for its compute capability while lowering, so without a GPU it cannot.
    """
    problem = triton_available()
    if problem:
        return problem
    if jax.default_backend() == "gpu":
        return ""
    spec = jax.ShapeDtypeStruct((1, 16, 1, 16), jnp.bfloat16)
    try:
        jax.jit(functools.partial(triton_attention, scale=1.0)).trace(spec, spec, spec).lower(
            lowering_platforms=("cuda",)
        )
    except Exception as e:  # noqa: BLE001 - the reason is reported, the caller falls back
        return f"jax {jax.__version__} cannot lower the Pallas Triton kernel without a GPU ({type(e).__name__})"
    return ""


def _pad_value_dim(q_BTHK, v_BSHK):
    extra = q_BTHK.shape[-1] - v_BSHK.shape[-1]
    if extra < 0:
        raise ValueError(f"value head dim {v_BSHK.shape[-1]} exceeds the query head dim {q_BTHK.shape[-1]}")
    return jnp.pad(v_BSHK, ((0, 0), (0, 0), (0, 0), (0, extra)))


def _block(size: int, preferred: int) -> int:
    """The largest power-of-two tile <= preferred that divides size (at least TRITON_MIN_BLOCK)."""
    problem = length_problem("triton", size)
    if problem:
        raise ValueError(problem)
    block = preferred
    while block > TRITON_MIN_BLOCK and size % block:
        block //= 2
    return block


def length_problem(name: str, seq_len: int) -> str:
    """Why attention kernel `name` cannot take a sequence of `seq_len` tokens ('' when it can)."""
    if name == "triton" and seq_len % TRITON_MIN_BLOCK:
        return f"flash attention needs a sequence length divisible by {TRITON_MIN_BLOCK}; got {seq_len}"
    return ""


def triton_attention(q_BTHK, k_BSHK, v_BSHK, scale: float, *, interpret: bool = False):
    """Causal softmax(q k^T * scale) v with jax's Pallas Triton kernels (forward and backward)."""
    attention = _triton_module()
    t = q_BTHK.shape[1]
    forward, backward = _block(t, TRITON_BLOCK), _block(t, TRITON_BACKWARD_BLOCK)
    blocks = attention.BlockSizes(
        block_q=forward,
        block_k=forward,
        block_q_dkv=backward,
        block_kv_dkv=backward,
        block_q_dq=backward,
        block_kv_dq=backward,
    )
    v_dim = v_BSHK.shape[-1]
    out = attention.mha(
        q_BTHK,
        k_BSHK,
        _pad_value_dim(q_BTHK, v_BSHK).astype(q_BTHK.dtype),
        None,
        sm_scale=scale,
        causal=True,
        block_sizes=blocks,
        interpret=interpret,
    )
    return out[..., :v_dim].astype(v_BSHK.dtype)


def _cudnn_binding():
    """jax's cuDNN attention binding (jax.nn.dot_product_attention's implementation="cudnn")."""
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def cudnn_problem() -> str:
    """'' when this process can build cuDNN attention with its own value head dim, else why not."""
    try:
        version = _cudnn_binding().check_cudnn_version()
    except Exception as e:  # noqa: BLE001 - no cuDNN (a CPU host), or a jax without the binding
        return f"cuDNN attention cannot be built in this process ({type(e).__name__}: {str(e)[:80]})"
    if version < CUDNN_MLA_VERSION:
        return f"cuDNN {version} takes no value head dim of its own (needs >= {CUDNN_MLA_VERSION})"
    return ""


def cudnn_attention(q_BTHK, k_BSHK, v_BSHK, scale: float, *, interpret: bool = False):
    """Causal attention on cuDNN's fused kernel (GPU only; bf16/f16), v at its own head dim."""
    del interpret
    v_dim = v_BSHK.shape[-1]
    if v_dim != q_BTHK.shape[-1] and not cudnn_problem():
        binding = _cudnn_binding()
        out = binding.dot_product_attention(
            q_BTHK, k_BSHK, v_BSHK.astype(q_BTHK.dtype), scale=scale, mask_type=binding.MaskType.CAUSAL
        )
        return out.astype(v_BSHK.dtype)
    # jax.nn's public entry: one head dim for q, k and v.
    out = jax.nn.dot_product_attention(
        q_BTHK,
        k_BSHK,
        _pad_value_dim(q_BTHK, v_BSHK).astype(q_BTHK.dtype),
        scale=scale,
        is_causal=True,
        implementation="cudnn",
    )
    return out[..., :v_dim].astype(v_BSHK.dtype)


def tokamax_attention(q_BTHK, k_BSHK, v_BSHK, scale: float, *, interpret: bool = False):
    """Causal attention from tokamax (the library picks its kernel for the device)."""
    del interpret
    import tokamax

    return tokamax.dot_product_attention(q_BTHK, k_BSHK, v_BSHK, scale=scale, is_causal=True).astype(v_BSHK.dtype)


def kernel(name: str):
    """The kernel function for a name in KERNELS."""
    functions = {"triton": triton_attention, "cudnn": cudnn_attention, "tokamax": tokamax_attention}
    if name not in functions:
        raise ValueError(f"unknown attention kernel {name!r}; expected one of {KERNELS}")
    fn = functions[name]

    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with jax.named_scope(ATTENTION_CORE_SCOPE):  # a profile's attention class (maxmoe.analysis.trace_breakdown)
            return fn(*args, **kwargs)

    return scoped


def sharded_attention(name: str, mesh, spec_BTHK: PartitionSpec, *, interpret: bool = False):
    """fn(q, k, v, scale) running kernel `name` on local (batch, heads) shards of a mesh.

    `spec_BTHK` is the sharding of q, k, v and the output (as the layout's rules give it
    for [batch, seq, heads, head_dim]); only batch and heads may be sharded.
    """
    spec = tuple(spec_BTHK) + (None,) * (4 - len(tuple(spec_BTHK)))
    if spec[1] is not None or spec[3] is not None:
        raise ValueError(
            f"attention kernel {name!r} needs whole sequences and head dims on every device; sharding is {spec}"
        )
    fn = kernel(name)

    def run(q_BTHK, k_BSHK, v_BSHK, scale):
        body = functools.partial(fn, scale=scale, interpret=interpret)
        return shard_map_in_context(
            body, mesh=mesh, in_specs=(PartitionSpec(*spec),) * 3, out_specs=PartitionSpec(*spec), check_vma=False
        )(q_BTHK, k_BSHK, v_BSHK)

    return run
