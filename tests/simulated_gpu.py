"""A CPU process that answers jax's device queries as an NVIDIA GPU (a test fixture, not a maxmoe code path).

On a GPU host every question a program asks about "the device" while it is built, traced and
lowered gets a GPU's answer; on a CPU host the same questions get a CPU's answer, so CUDA
programs lowered there can differ from the ones a GPU process builds (issue: the attention
kernel `auto` picks on a GPU refused the model's 8-token initialisation probe, which no CPU
test could see). `simulated_gpu(kind)` patches the places jax 0.10 - 0.12 answer from:

  jax.devices(), jax.local_devices(), jax.default_backend()
        the process's devices and platform: what maxmoe.kernels.choice.target() reads (hence
        what `auto` resolves to with no layout), Triton's compute-capability lookup in jax 0.10
        (`jax.local_devices(backend="gpu")[0].compute_capability`), the SM count jax's Mosaic
        GPU transposed ragged dot reads (`jax.devices()[0].core_count`) and the shared memory
        per block Mosaic GPU checks (`shared_memory_per_block_optin`)
  jax.extend.backend.get_default_device()
        Mosaic GPU's target architecture (`_infer_arch`: jax 0.10 in mosaic/gpu/core.py, 0.12 in
        mosaic/gpu/utils.py; a device without a compute capability counts as sm_90 there)
  jax._src.pallas.triton.gpu_info.get_gpu_info()
        the GPU jax >= 0.11 lowers a Triton kernel for (from the default device's kind; on a
        CPU host it raises, so without this Triton cannot be lowered there at all)
  jax._src.cudnn.fused_attention_stablehlo (check_cudnn_version, check_compute_capability)
        what cuDNN attention's binding asks while tracing

What each jax needs it for (tests/test_gpu_sim.py, run under 0.10.2 and 0.12):
  jax 0.10   Triton and Mosaic GPU lower for CUDA on a CPU host anyway (both assume sm_90); the
             fixture makes the process's device kind a GPU's, so `auto` and everything that
             asks "what am I on" answer as on the GPU (the init blocker showed only so)
  jax 0.12   as 0.10, and Triton lowers at all only inside the fixture (outside, `auto` falls
             back to chunked attention and blockwise FP8 to XLA's program)
Every Triton module lowered inside it is also verified (MLIR's verifier, as XLA:GPU parses it).
jax 0.11 (the GPU image's) is not installed here: the fixture patches `gpu_info` where that
module exists and the device queries everywhere, the lookups 0.10 and 0.12 use. cuDNN
attention's binding asks cuDNN's version and the compute capability while tracing: answered
as the GPU image's cuDNN 9.19 on `kind`.

Arrays, meshes and compilation still use the CPU devices: pass `cpu_devices` (taken before
the patch) wherever a mesh is built. Nothing here runs a kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

import jax


@dataclasses.dataclass(frozen=True)
class GpuKind:
    """What a GPU reports: jax's device_kind, compute capability "major.minor" and SM count."""

    device_kind: str
    compute_capability: str
    core_count: int

    @property
    def sm(self) -> str:
        """The architecture name, e.g. 'sm_90'."""
        return "sm_" + self.compute_capability.replace(".", "")


H200 = GpuKind("NVIDIA H200", "9.0", 132)
B200 = GpuKind("NVIDIA B200", "10.0", 148)
GB300 = GpuKind("NVIDIA GB300", "10.3", 160)
KINDS = {"sm_90": H200, "sm_100": B200}


@dataclasses.dataclass(frozen=True)
class FakeGpuDevice:
    """The attributes of a jaxlib CUDA device that code reads to learn what it runs on."""

    id: int
    kind: GpuKind
    platform: str = "gpu"
    process_index: int = 0
    host_id: int = 0
    slice_index: int = 0
    shared_memory_per_block_optin: int = 227 * 1024

    @property
    def device_kind(self) -> str:
        return self.kind.device_kind

    @property
    def compute_capability(self) -> str:
        return self.kind.compute_capability

    @property
    def core_count(self) -> int:
        return self.kind.core_count

    def __repr__(self) -> str:
        return f"CudaDevice(id={self.id}, {self.kind.device_kind} simulated)"


def _gpu_info_patch(kind: GpuKind) -> list:
    """jax >= 0.11's Triton lowering asks `gpu_info.get_gpu_info()` (the default device's kind, or
    the abstract mesh's) for the target; answer with jax's own table entry for `kind`."""
    try:
        gpu_info = importlib.import_module("jax._src.pallas.triton.gpu_info")
    except ImportError:  # jax 0.10: Triton reads jax.local_devices(backend="gpu") instead
        return []
    info = gpu_info.get_gpu_info_from_version(gpu_info.gpu_version_from_device_kind(kind.device_kind))
    return [(gpu_info, "get_gpu_info", lambda: info)]


CUDNN_VERSION = 91900  # the GPU image's cuDNN (9.19)


def _cudnn_patch(kind: GpuKind) -> list:
    """jax's cuDNN attention binding asks the process's cuDNN for its version and the backend for
    the GPU's compute capability while tracing; answer as the GPU image would (the custom call
    it lowers to is built into a cuDNN graph only by XLA:GPU's compile, which nothing here runs)."""
    try:
        binding = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    except ImportError:
        return []
    have = tuple(int(x) for x in kind.compute_capability.split("."))

    def at_least(capability):
        return have >= tuple(int(x) for x in capability.split("."))

    def equal(capability):
        return have == tuple(int(x) for x in capability.split("."))

    return [
        (binding, "check_cudnn_version", lambda: CUDNN_VERSION),
        (binding, "check_compute_capability", at_least),
        (binding, "is_cuda_compute_capability_equal", equal),
    ]


def _verified_triton_patch() -> list:
    """Every Triton module lowered inside the fixture is verified as XLA:GPU's parser will: the
    lowering itself does not (an `scf.for` whose bounds differ in type lowered here and failed
    only in XLA:GPU's compile, on the first H200)."""
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError:
        return []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()  # raises MLIRError, naming the op and its source line
        return result

    return [(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)]


@contextlib.contextmanager
def simulated_gpu(kind: GpuKind, count: int | None = None):
    """Within the block this process's device queries answer as `count` GPUs of `kind` (default:
    as many as there are CPU devices); yields the CPU devices to build meshes on."""
    import jax.extend.backend as jex_backend

    from maxmoe.kernels import attention, mosaic_ragged_dot

    cpu_devices = jax.devices("cpu")
    gpus = [FakeGpuDevice(i, kind) for i in range(count or len(cpu_devices))]
    real_devices, real_local = jax.devices, jax.local_devices

    def devices(backend=None):
        return gpus if backend in (None, "gpu", "cuda") else real_devices(backend)

    def local_devices(process_index=None, backend=None, host_id=None):
        return gpus if backend in (None, "gpu", "cuda") else real_local(process_index, backend, host_id)

    patches = [
        (jax, "devices", devices),
        (jax, "local_devices", local_devices),
        (jax, "default_backend", lambda: "gpu"),
        (jex_backend, "get_default_device", lambda: gpus[0]),
        *_gpu_info_patch(kind),
        *_cudnn_patch(kind),
        *_verified_triton_patch(),
    ]
    caches = [attention.triton_lowers_on_host, mosaic_ragged_dot._has_gpu_devices]  # answers of the real process
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for cache in caches:
        cache.cache_clear()
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield cpu_devices
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        for cache in caches:
            cache.cache_clear()
