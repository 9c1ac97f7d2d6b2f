"""Expert-parallel dispatch strategies side by side on 8 fake CPU devices: bytes, time, memory.

    PYTHONPATH=. python benchmarks/dispatch.py [--proxy-tokens 512 --proxy-hidden 1024 ...]
    JAX_PLATFORMS=cuda python benchmarks/dispatch.py --devices 8 --chunks 32   # on 8 GPUs

For each strategy on a tiny and a proxy-shaped MoE layer (one forward call, mesh
data=1 x expert=N x tensor=1 with N = --devices, random balanced top-k routing) it prints:

  hlo MB     bytes each device puts on the wire per layer, from the collectives in the
             compiled HLO (`maxmoe.analysis.hlo.collective_bytes`): all-to-all and all-gather move
             (P-1)/P of their buffer, reduce-scatter (P-1) x its output, all-reduce
             2 (P-1)/P of its buffer (ring). On CPU ragged all-to-all is emulated with
             dense [P, M, D] blocks, so this is far above what the GPU moves.
  native MB  ragged_a2a only: what the native collective moves, from the actual send
             sizes of this routing (off-device rows x D x bytes, out and back) plus
             the all-gather of counts.
  min MB     the analytic minimum: n x K x D x bytes, out and back, x (P-1)/P.
  ms/call    wall time per forward call (CPU: only ratios mean anything).
  temp MB    compiled.memory_analysis() temp bytes per device (args + outputs apart).
  dropped    fraction of token copies dropped.

Backward doubles every collective (each has a transposed twin). A second table runs
forward + backward of ragged_a2a under each remat policy (`jax.checkpoint` with the model's
policy around the layer), with and without moe.overlap=batch_split and moe.a2a_chunks:

  fwd MB / bwd MB  bytes on the wire in the forward / backward pass (maxmoe.analysis.hlo.pass_of):
             a policy that recomputes collectives shows them again in bwd
  ms/step    wall time of forward + backward (CPU: ratios only; on GPUs this is where
             batch_split's overlap and the chunks' effect on the one-shot kernel show)
  temp MB    compiled temp memory: what keeping the receive buffers costs
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from results import command_line

from maxmoe import runtime
from maxmoe.analysis.hlo import collective_bytes
from maxmoe.config import MoEConfig
from maxmoe.model.transformer import REMAT_POLICIES
from maxmoe.parallel.dispatch import make_dispatch_plan

WEIGHT_SPECS = {
    "w_gate": P("expert", None, "tensor"),
    "w_up": P("expert", None, "tensor"),
    "w_down": P("expert", "tensor", None),
}


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    tokens: int  # per (data, expert) shard
    hidden: int
    expert_mlp: int
    experts: int
    top_k: int


def native_ragged_bytes(ids_NK, layer, ranks, bytes_per_value):
    """Off-device rows of the real ragged all-to-all for this routing, out and back, mean per device."""
    local = layer.experts // ranks
    shard_NK = ids_NK.reshape(ranks, layer.tokens, layer.top_k)
    off_device = sum(int(np.sum(shard_NK[s] // local != s)) for s in range(ranks)) / ranks
    counts = ranks * layer.experts * 4 * (ranks - 1) / ranks
    return 2 * off_device * layer.hidden * bytes_per_value + counts


def make_inputs(layer, mesh, seed=0):
    shards = mesh.shape["data"] * mesh.shape["expert"]
    n = shards * layer.tokens
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    ids = np.argsort(np.random.default_rng(seed).random((n, layer.experts)), axis=-1)[:, : layer.top_k]

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    tokens = P(("data", "expert"))
    x = put(jax.random.normal(keys[0], (n, 1, layer.hidden)), tokens)
    weights = put(jax.random.uniform(keys[1], (n, 1, layer.top_k)), tokens)
    scale = 1 / np.sqrt(layer.hidden)
    w_gate = put(
        jax.random.normal(keys[2], (layer.experts, layer.hidden, layer.expert_mlp)) * scale, P("expert", None, "tensor")
    )
    w_up = put(
        jax.random.normal(keys[3], (layer.experts, layer.hidden, layer.expert_mlp)) * scale, P("expert", None, "tensor")
    )
    w_down = put(
        jax.random.normal(keys[4], (layer.experts, layer.expert_mlp, layer.hidden)) * scale, P("expert", "tensor", None)
    )
    return ids, (x, put(jnp.asarray(ids, jnp.int32).reshape(n, 1, -1), tokens), weights, w_gate, w_up, w_down)


def measure(layer, variant, moe, mesh, repeats):
    ids, args = make_inputs(layer, mesh)
    plan = make_dispatch_plan(mesh, moe, token_axes=("data", "expert"), weight_specs=WEIGHT_SPECS)
    compiled = jax.jit(plan.routed_experts).lower(*args).compile()
    y, dropped = compiled(*args)
    jax.block_until_ready(y)
    start = time.perf_counter()
    for _ in range(repeats):
        y, _ = compiled(*args)
    jax.block_until_ready(y)
    seconds = (time.perf_counter() - start) / repeats
    by_kind = collective_bytes(compiled.as_text(), device_domain=[0] * mesh.size)["by_kind"]
    ranks = mesh.shape["expert"]
    native = native_ragged_bytes(ids, layer, ranks, 4) if plan.strategy == "ragged_a2a" else None
    minimum = 2 * layer.tokens * layer.top_k * layer.hidden * 4 * (ranks - 1) / ranks
    memory = compiled.memory_analysis()
    return dict(
        layer=layer.name,
        variant=variant,
        hlo=sum(by_kind.values()),
        native=native,
        minimum=minimum,
        ms=seconds * 1e3,
        temp=memory.temp_size_in_bytes,
        dropped=float(dropped),
        kinds=", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(by_kind.items())),
    )


def measure_training(layer, variant, moe, remat, mesh, repeats):
    """Forward + backward of one layer under a remat policy: bytes by pass, time, temp memory."""
    _, args = make_inputs(layer, mesh)
    plan = make_dispatch_plan(mesh, moe, token_axes=("data", "expert"), weight_specs=WEIGHT_SPECS)

    def layer_output(x, w_gate, w_up, w_down):
        return plan.routed_experts(x, args[1], args[2], w_gate, w_up, w_down)[0]

    if remat != "none":
        layer_output = jax.checkpoint(layer_output, policy=REMAT_POLICIES[remat], prevent_cse=False)

    def loss(x, w_gate, w_up, w_down):
        return jnp.sum(layer_output(x, w_gate, w_up, w_down) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    inputs = (args[0], args[3], args[4], args[5])
    compiled = step.lower(*inputs).compile()
    jax.block_until_ready(compiled(*inputs))
    start = time.perf_counter()
    for _ in range(repeats):
        grads = compiled(*inputs)
    jax.block_until_ready(grads)
    by_pass = collective_bytes(compiled.as_text(), device_domain=[0] * mesh.size)["by_pass"]
    return dict(
        layer=layer.name,
        variant=variant,
        remat=remat,
        forward=sum(by_pass["forward"].values()),
        backward=sum(by_pass["backward"].values()),
        ms=(time.perf_counter() - start) / repeats * 1e3,
        temp=compiled.memory_analysis().temp_size_in_bytes,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="expert-axis size (CPU: fake devices)")
    parser.add_argument("--chunks", type=int, default=2, help="moe.a2a_chunks of the chunked variant (GPU: 8, 32)")
    parser.add_argument(
        "--remat", nargs="+", default=["none", "full", "save_comm", "save_dots_comm"], help="policies of table 2"
    )
    parser.add_argument("--proxy-tokens", type=int, default=256, help="tokens per shard (DeepSeek proxy: 4096)")
    parser.add_argument("--proxy-hidden", type=int, default=512, help="D (proxy: 2048)")
    parser.add_argument("--proxy-expert-mlp", type=int, default=128, help="F (proxy: 512)")
    parser.add_argument("--proxy-experts", type=int, default=64)
    parser.add_argument("--proxy-top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runtime.use_cpu_devices(args.devices, force=False)  # fake CPU devices unless JAX_PLATFORMS names a platform
    runtime.use_compile_cache()  # a rerun loads the programs this one compiled
    print(f"$ {command_line()}")
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, float32, "
        f"mesh data=1 x expert={args.devices} x tensor=1, forward only\n"
    )

    mesh = Mesh(np.array(jax.devices()[: args.devices]).reshape(1, args.devices, 1), ("data", "expert", "tensor"))
    layers = [
        Layer("tiny", 64, 64, 32, 8, 2),
        Layer(
            "proxy", args.proxy_tokens, args.proxy_hidden, args.proxy_expert_mlp, args.proxy_experts, args.proxy_top_k
        ),
    ]
    variants = [
        ("ragged_a2a", MoEConfig(dispatch="ragged_a2a")),
        ("ragged_a2a buffer 2.0", MoEConfig(dispatch="ragged_a2a", buffer_factor=2.0)),
        ("allgather", MoEConfig(dispatch="allgather")),
        ("capacity 1.25", MoEConfig(dispatch="capacity", capacity_factor=1.25)),
    ]
    header = (
        f"{'layer':<6} {'variant':<22} {'hlo MB':>9} {'native MB':>9} {'min MB':>8} {'hlo/min':>7} "
        f"{'ms/call':>8} {'temp MB':>8} {'dropped':>7}  collectives (MB on the wire)"
    )
    for layer in layers:
        print(
            f"{layer.name}: {layer.tokens} tokens/shard, D={layer.hidden}, F={layer.expert_mlp}, "
            f"E={layer.experts}, top-{layer.top_k}"
        )
    print()
    print(header)
    print("-" * len(header))
    for layer in layers:
        for variant, moe in variants:
            r = measure(layer, variant, moe, mesh, args.repeats)
            native = f"{r['native'] / 2**20:9.2f}" if r["native"] is not None else f"{'-':>9}"
            print(
                f"{r['layer']:<6} {r['variant']:<22} {r['hlo'] / 2**20:9.2f} {native} {r['minimum'] / 2**20:8.2f} "
                f"{r['hlo'] / r['minimum']:7.1f} {r['ms']:8.1f} {r['temp'] / 2**20:8.1f} {r['dropped']:7.4f}  "
                f"{r['kinds']}",
                flush=True,
            )

    print("\nforward + backward, ragged_a2a, by remat policy and overlap (MB on the wire per step)\n")
    overlaps = [
        ("plain", MoEConfig(dispatch="ragged_a2a")),
        ("batch_split", MoEConfig(dispatch="ragged_a2a", overlap="batch_split")),
        (f"a2a_chunks {args.chunks}", MoEConfig(dispatch="ragged_a2a", a2a_chunks=args.chunks)),
        (
            f"batch_split + chunks {args.chunks}",
            MoEConfig(dispatch="ragged_a2a", overlap="batch_split", a2a_chunks=args.chunks),
        ),
    ]
    header = f"{'layer':<6} {'variant':<24} {'remat':<15} {'fwd MB':>9} {'bwd MB':>9} {'ms/step':>8} {'temp MB':>8}"
    print(header)
    print("-" * len(header))
    for layer in layers:
        for variant, moe in overlaps:
            for remat in args.remat if variant == "plain" else ["save_comm"]:
                r = measure_training(layer, variant, moe, remat, mesh, args.repeats)
                print(
                    f"{r['layer']:<6} {r['variant']:<24} {r['remat']:<15} {r['forward'] / 2**20:9.2f} "
                    f"{r['backward'] / 2**20:9.2f} {r['ms']:8.1f} {r['temp'] / 2**20:8.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
