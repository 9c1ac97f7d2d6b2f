"""The programs a GPU process builds, proven on CPU: initialisation never runs a kernel, and under
a simulated H200 (sm_90) and B200 (sm_100) process (tests/simulated_gpu.py) the train and eval
programs of the GPU suite's variants and of configs/proxy_1gpu.yaml build, initialise
abstractly and lower for CUDA with the kernels `auto` picks there (on sm_100, where `auto` finds
no grouped kernel installed and refuses, with XLA's ragged_dot asked for by name).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from simulated_gpu import KINDS, simulated_gpu

from maxmoe.config import load_config
from maxmoe.kernels import attention as attention_kernels
from maxmoe.model.transformer import abstract_variables, init_variables, logits

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs/tiny.yaml")


def tiny_model(*overrides):
    return load_config([TINY], ["model.num_layers=2", "model.mtp_num_layers=0", *overrides]).model


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """Every attention kernel call, by name and sequence length; the kernels still run (interpreted)."""
    calls = []
    for name in attention_kernels.KERNELS:
        real = getattr(attention_kernels, f"{name}_attention")

        def record(q, k, v, scale, *, interpret=False, _name=name, _real=real):
            calls.append((_name, q.shape[1]))
            return _real(q, k, v, scale, interpret=interpret)

        monkeypatch.setattr(attention_kernels, f"{name}_attention", record)
    return calls


@pytest.mark.smoke
def test_initialisation_runs_no_attention_kernel(kernel_calls):
    """The 8-token probe that creates the variables uses the xla core: the same variables as with
    `xla` for every kernel, even ones that cannot run on this host (cudnn, tokamax)."""
    expected = abstract_variables(tiny_model("model.attention=xla"))
    for attention in attention_kernels.KERNELS:
        got = abstract_variables(tiny_model(f"model.attention={attention}"))
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        assert jax.tree.leaves(got) == jax.tree.leaves(expected)
    assert kernel_calls == []


@pytest.mark.smoke
def test_logits_on_a_length_the_kernel_cannot_take_fall_back_to_xla_and_say_so(kernel_calls):
    """Triton takes lengths divisible by 16: at 8 tokens logits() runs xla (with a warning) and
    equals the xla model; at 16 tokens the kernel is what runs (traced only: its values against
    xla are test_kernels' business)."""
    dense = "model.num_layers=1"  # one dense layer: the attention core is what this is about
    model = tiny_model(dense, "model.attention=triton")
    variables = jax.jit(init_variables, static_argnums=0)(model, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, model.vocab_size)
    oracle = jax.jit(lambda v, t: logits(tiny_model(dense, "model.attention=xla"), v, t))(variables, tokens)
    run = jax.jit(lambda v, t: logits(model, v, t))
    with pytest.warns(UserWarning, match="divisible by 16; got 8"):
        short = run(variables, tokens[:, :8])
    assert kernel_calls == []
    # float32 default: the same xla core on 8 positions, compiled in another program
    np.testing.assert_allclose(short, oracle[:, :8], rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a length the kernel takes: no fallback, no warning
        full = jax.eval_shape(run, variables, tokens)
    assert kernel_calls and set(kernel_calls) == {("triton", 16)}
    assert (full.shape, full.dtype) == (oracle.shape, jnp.float32)


def test_an_unpadded_buffer_builds_one_forward_kernel_per_gemm():
    """padded=False (one device: every row in a group) traces the forward and dx kernels once each,
    on the whole buffer, instead of once per row bucket; values and gradients equal XLA's."""
    from maxmoe.kernels import mosaic_ragged_dot
    from maxmoe.kernels.grouped_matmul import grouped_matmul

    built = []

    def forward(x_MK, w, sizes_G, transpose_rhs=False):
        built.append((x_MK.shape[0], transpose_rhs))
        w_GKN = jnp.swapaxes(w, 1, 2) if transpose_rhs else w
        return jax.lax.ragged_dot(x_MK, w_GKN, sizes_G).astype(x_MK.dtype)

    def weight_grad(x_MK, dy_MN, sizes_G):
        return jax.lax.ragged_dot_general(
            x_MK,
            dy_MN,
            sizes_G,
            jax.lax.RaggedDotDimensionNumbers(
                dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
            ),
        )

    fn = mosaic_ragged_dot.make_grouped_matmul(mosaic_ragged_dot.Kernels(forward, weight_grad))
    x, w = jax.random.normal(jax.random.key(0), (384, 64)), jax.random.normal(jax.random.key(1), (3, 64, 32))
    sizes = jnp.array([100, 0, 284], jnp.int32)

    def loss(fn, x, w):
        return jnp.sum(jnp.sin(fn(x, w)))

    got = jax.jit(jax.value_and_grad(lambda x, w: loss(lambda x, w: fn(x, w, sizes, 1), x, w), argnums=(0, 1)))(x, w)
    assert built == [(384, False), (384, True)]
    built.clear()
    jax.eval_shape(lambda x, w: jax.grad(lambda x, w: loss(lambda x, w: fn(x, w, sizes), x, w))(x, w), x, w)
    assert sorted({rows for rows, _ in built}) == [128, 256, 384]  # padded: one kernel per bucket
    oracle = jax.value_and_grad(
        lambda x, w: loss(lambda x, w: grouped_matmul(x, w, sizes, backend="dense_loop"), x, w), argnums=(0, 1)
    )(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(oracle)):
        # float32 default: the kernel contract's reference sums per group, the dense loop per expert
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.smoke
def test_the_fixture_answers_as_the_gpu_and_lets_triton_lower_on_every_jax():
    """Inside: the process is an sm_90 / sm_100 GPU to maxmoe and to jax's Triton and Mosaic GPU
    lookups, and Triton lowers for CUDA (jax >= 0.11 asks the GPU while lowering: without the
    fixture it cannot, and `auto` falls back to chunked). Outside: the CPU again."""
    import jax.extend.backend as jex_backend

    from maxmoe.kernels.choice import resolve_kernels, target

    config = load_config([PROXY], [])
    for kind in KINDS.values():
        with simulated_gpu(kind) as cpu_devices:
            assert target() == ("cuda", kind.device_kind) and jax.default_backend() == "gpu"
            assert jax.local_devices(backend="gpu")[0].compute_capability == kind.compute_capability
            assert jex_backend.get_default_device().compute_capability == kind.compute_capability
            assert attention_kernels.triton_lowers_here() == "" and attention_kernels.cudnn_problem() == ""
            # auto: H200's measured rates (chunked measured, cuDNN not yet); none for Blackwell: cuDNN
            assert resolve_kernels(named(kind.sm, config)).attention.name == AUTO_ATTENTION[kind.sm]
            assert all(d.platform == "cpu" for d in cpu_devices)
    assert target() == ("cpu", "cpu")
    old_jax = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)
    assert (attention_kernels.triton_lowers_here() == "") == old_jax
    assert attention_kernels.cudnn_problem() != ""  # no cuDNN on this host
    assert resolve_kernels(config, "cuda", "NVIDIA H200").attention.name == "chunked"


# ----------------------------------------------------------------------------------------
# The GPU suite's programs under a simulated H200 (sm_90) and B200 (sm_100) process.

PROXY = str(REPO / "configs/proxy_1gpu.yaml")
SUITE = REPO / "benchmarks/gpu_suite.sh"
# Reduced depth: one dense and one MoE layer (each a scanned stack, so depth changes no kernel)
# plus the MTP block for auto; the one-factor variants leave MTP out (the same Block again).
DEPTH = ["model.num_layers=2"]
SHALLOW = [*DEPTH, "model.mtp_num_layers=0"]
# Variants of the suite's step parts that cannot be lowered here, with the reason.
NOT_LOWERED = {
    "model.attention=tokamax": "tokamax is not in the test extra",
    "moe.grouped_matmul=tokamax": "tokamax is not in the test extra",
}


def suite_variants() -> list[str]:
    """The --variant overrides of gpu_suite.sh's step parts on a GPU (read from the script itself,
    so a variant added there is lowered here), and the model.fp8 recipes the suite does not time."""
    from maxmoe.config import FP8_RECIPES

    text = SUITE.read_text().split("# GPU run", 1)[1].split("# end of GPU run", 1)[0]
    found = [v for v in re.findall(r'--variant "([^"]*)"', text) if v]  # "": auto, lowered on its own
    return list(dict.fromkeys(found + [f"model.fp8={r}" for r in FP8_RECIPES]))


def xla_ragged_dots(stablehlo: str) -> int:
    """How many XLA ragged_dot ops a lowered program holds (not Mosaic's ragged dot kernel)."""
    return len(re.findall(r"\b(?:chlo|stablehlo)\.ragged_dot\b", stablehlo))


def custom_call_targets(stablehlo: str) -> list[str]:
    """The kernels a lowered program calls: its custom-call targets."""
    return sorted(set(re.findall(r"custom_call @([^\s(]+)", stablehlo)))


def named(kind: str, config):
    """`config` as lowered for `kind`: on sm_100, with no grouped kernel installed here, `auto` refuses
    (tests/test_gpu_compile.py), so XLA's ragged_dot is asked for by name."""
    if kind == "sm_100" and config.moe.grouped_matmul == "auto":
        return config.replace(moe={"grouped_matmul": "ragged_dot"})
    return config


def lower_programs(kind: str, overrides: list[str], with_eval: bool) -> dict[str, str]:
    """Build the programs of proxy_1gpu + overrides in a simulated `kind` process, initialise them
    abstractly and lower the train (and eval) step for CUDA; StableHLO text per program."""
    from maxmoe.parallel.layout import build_layout
    from maxmoe.training.programs import build_programs

    with simulated_gpu(KINDS[kind], count=1) as cpu_devices:
        config = named(kind, load_config([PROXY], overrides))
        layout = build_layout(config, devices=cpu_devices[:1])
        programs = build_programs(config, layout)
        state = jax.eval_shape(programs.init, jax.random.key(0))
        assert jax.tree.structure(state) == jax.tree.structure(programs.abstract_state)
        batch = programs.abstract_batch(config)
        texts = {"train": programs.train_step.trace(state, batch).lower(lowering_platforms=("cuda",)).as_text()}
        if with_eval:
            lowered = programs.eval_step.trace(state.params, state.router, batch).lower(lowering_platforms=("cuda",))
            texts["eval"] = lowered.as_text()
        texts["kernels"] = f"{layout.grouped_matmul.name}+{layout.attention.name}"
    return texts


# What `auto` picks for attention under the simulated GPUs: the committed rates measure chunked
# on the H200 and not cuDNN yet; nothing is measured on Blackwell, where the fixed preference is cuDNN.
AUTO_ATTENTION = {"sm_90": "chunked", "sm_100": "cudnn"}
ATTENTION_CALLS = {"triton": ("triton",), "cudnn": ("fmhaSoftmax",), "chunked": ()}


def check_kernels(kind: str, variant: str, texts: dict[str, str]) -> None:
    """The kernels auto picks on `kind` are in every program; on sm_90 none runs XLA's ragged_dot."""
    overrides = dict(o.split("=") for o in variant.split())
    fp8 = overrides.get("model.fp8", "none")
    attention = overrides.get("model.attention", AUTO_ATTENTION[kind])
    for program in ("train", "eval"):
        if program not in texts:
            continue
        targets = custom_call_targets(texts[program])
        print(f"{kind} {variant or 'auto'} {program} ({texts['kernels']}): custom calls {targets}")
        assert texts["kernels"].endswith(f"+{attention}")
        for call in ATTENTION_CALLS[attention]:
            assert any(call in t for t in targets), targets  # the flash attention kernel
        if attention == "cudnn" and program == "train":
            assert any("fmhaSoftmaxBackward" in t for t in targets), targets
        if kind == "sm_90":
            assert texts["kernels"].startswith("mosaic_gpu+")
            assert xla_ragged_dots(texts[program]) == 0, "XLA's ragged_dot in an sm_90 program"
            assert any("mosaic_gpu" in t for t in targets) == (fp8 != "blockwise"), targets
        else:
            assert texts["kernels"].startswith("ragged_dot+")  # no tokamax here: XLA's grouped GEMM, by name
            assert xla_ragged_dots(texts[program]) > 0  # the detector finds what sm_90 must not have
            assert not any("mosaic_gpu" in t for t in targets), targets
        if fp8 == "mxfp8":
            assert any("block_scaled_dot" in t for t in targets), targets


def variant_params():
    params = [pytest.param(kind, "", id=f"{kind}-auto") for kind in KINDS]
    for variant in suite_variants():
        marks = [pytest.mark.skip(reason=NOT_LOWERED[variant])] if variant in NOT_LOWERED else []
        params += [pytest.param(kind, variant, id=f"{kind}-{variant}", marks=marks) for kind in KINDS]
    return params


@pytest.mark.slow
@pytest.mark.smoke
@pytest.mark.parametrize(("kind", "variant"), variant_params())
def test_suite_programs_lower_for_cuda_with_the_kernels_auto_picks(kind, variant):
    """auto: train and eval programs with MTP; each variant changes one factor and is lowered as a
    train program (the eval program is the same forward pass, which the train program holds)."""
    texts = lower_programs(kind, [*(DEPTH if not variant else SHALLOW), *variant.split()], with_eval=not variant)
    check_kernels(kind, variant, texts)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cudnn_attention_takes_mla_head_dims_as_they_are(kind):
    """qk 192 / v 128 reach cuDNN unpadded, forward and backward: no pad in the program, and the
    kernels' outputs and dv at v's head dim (jax.nn's entry would have padded v to 192)."""
    q = jax.ShapeDtypeStruct((2, 256, 4, 192), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(attention_kernels.kernel("cudnn")(q, k, v, 0.07).astype(jnp.float32))

    with simulated_gpu(KINDS[kind], count=1):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, v).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    calls = [line for line in text.splitlines() if "custom_call @__cudnn$fmha" in line]
    assert len(calls) == 2 and "stablehlo.pad" not in text
    assert re.search(r"tensor<2x(256x4|4x256)x128xbf16>", calls[0].split("->")[-1])  # the output at v's dim
    assert "attention_core" in lowered.as_text(debug_info=True)  # the profile's class (maxmoe.analysis.trace_breakdown)


def test_the_mosaic_forward_kernel_takes_its_tiles_from_the_table():
    """A GEMM listed in TILES lowers with those tiles (the kernel module differs from the rule's);
    one not listed keeps pick_blocks' rule."""
    from maxmoe.kernels import mosaic_ragged_dot as mrd

    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, 128, 256), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((2,), jnp.int32)
    assert mrd.forward_blocks(128, 256, False) == mrd.pick_blocks(128, 256)
    tiled = mrd.Blocks(m=64, n=256, k=128, stages=2)
    assert mrd.forward_blocks(128, 256, False, {(128, 256, False): tiled}) == tiled

    def lowered(tiles):
        kernels = mrd.mosaic_kernels(tiles)
        with simulated_gpu(KINDS["sm_90"], count=1):
            return jax.jit(kernels.forward).trace(x, w, sizes).lower(lowering_platforms=("cuda",)).as_text()

    rule, table = lowered({}), lowered({(128, 256, False): tiled})
    assert "mosaic_gpu" in rule and "mosaic_gpu" in table and rule != table
