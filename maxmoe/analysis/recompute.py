"""What `model.remat` runs again: the GEMMs of a scanned block its policy recomputes, from the values it saves.

    recomputed_gemms("save_moe", moe=True)  ->  {"q_down", "q_up", "kv_down", "kv_up", "core", ...}

A block is a small dataflow (BLOCK, as maxmoe.model.transformer builds it). The backward pass
reads some values (`needs`: a GEMM's input for its weight gradient, a norm's or SwiGLU's input,
the core's inputs and output, the router's scores for the top-k and the dispatch's permutation,
the combine's rows for the routing weights). A needed value is there if the policy saved it
(SAVED; the block input always is), else its op runs again, and that op's inputs become needed
in turn. Policies save by the names of maxmoe.parallel.names (maxmoe.model.transformer's
REMAT_POLICIES); dots without batch dims are the dense projections' outputs. The dispatch and
the combine carry their names only under expert parallelism (a dispatch plan: more than one
device); on one device their rows are a sort, not a saved collective. MTP's block and the head
are not rematerialised. block_gemm_flops gives each GEMM's forward FLOPs per token and class.
"""

from __future__ import annotations

# value: (inputs, the GEMM that makes it or None, the values its op's backward reads)
_ATTENTION = {
    "attn_in": (("x",), None, ("x",)),  # RMSNorm
    "q_a": (("attn_in",), "q_down", ("attn_in",)),
    "q_n": (("q_a",), None, ("q_a",)),
    "q": (("q_n",), "q_up", ("q_n",)),
    "kv_a": (("attn_in",), "kv_down", ("attn_in",)),  # the latent and the shared rope key
    "kv_n": (("kv_a",), None, ("kv_a",)),
    "kv": (("kv_n",), "kv_up", ("kv_n",)),
    "o": (("q", "kv", "kv_a"), "core", ("q", "kv", "kv_a", "o")),  # flash backward: inputs and output
    "attn_out": (("o",), "o_proj", ("o",)),
    "h": (("x", "attn_out"), None, ()),  # the residual add
    "mlp_in": (("h",), None, ("h",)),
}
_PLAIN_QUERY = {"q": (("attn_in",), "q_proj", ("attn_in",))}  # model.q_lora_rank = 0
_MOE = {
    "scores": (("mlp_in",), "router", ("mlp_in",)),
    "weights": (("scores",), None, ("scores",)),  # sigmoid, top-k
    "rows": (("mlp_in", "scores"), None, ("scores",)),  # the dispatch: a permutation (and all-to-all)
    "gate_up": (("rows",), "routed_gate_up", ("rows",)),
    "act": (("gate_up",), None, ("gate_up",)),
    "down": (("act",), "routed_down", ("act",)),
    "back": (("down", "scores"), None, ("scores",)),  # the combine: the permutation back
    "routed": (("back", "weights"), None, ("back", "weights")),  # weighted sum of the copies
    "shared_gate_up": (("mlp_in",), "shared_gate_up", ("mlp_in",)),
    "shared_act": (("shared_gate_up",), None, ("shared_gate_up",)),
    "shared_down": (("shared_act",), "shared_down", ("shared_act",)),
}
_DENSE = {
    "dense_gate_up": (("mlp_in",), "dense_gate_up", ("mlp_in",)),
    "dense_act": (("dense_gate_up",), None, ("dense_gate_up",)),
    "dense_down": (("dense_act",), "dense_down", ("dense_act",)),
}
# Outputs of dots without batch dims (and their FP8 GEMMs', FP8_DENSE_OUT): the dense projections.
_DOTS = ("q_a", "q", "kv_a", "kv", "attn_out", "scores", "shared_gate_up", "shared_down", "dense_gate_up", "dense_down")
_COMM = ("rows", "back")  # COMM_NAMES: DISPATCH_ROWS (or FP8_DISPATCH_ROWS) and COMBINE_ROWS
SAVED = {
    "full": (),
    "save_comm": _COMM,
    "save_moe": (*_COMM, "gate_up", "attn_out"),  # + EXPERT_GATE_UP, ATTENTION_OUT
    "save_matmuls": _DOTS,
    "save_dots_comm": (*_DOTS, *_COMM, "gate_up"),
}
GEMM_CLASS = {
    **dict.fromkeys(("q_down", "q_up", "q_proj", "kv_down", "kv_up", "o_proj"), "attention"),
    "core": "attention_core",
    "router": "router",
    "routed_gate_up": "routed_experts",
    "routed_down": "routed_experts",
    "shared_gate_up": "shared_experts",
    "shared_down": "shared_experts",
    "dense_gate_up": "dense_mlp",
    "dense_down": "dense_mlp",
}


def block(moe: bool, q_lora: bool = True) -> dict:
    """The dataflow of one block: {value: (inputs, GEMM or None, what its backward reads)}."""
    values = dict(_ATTENTION)
    if not q_lora:
        for name in ("q_a", "q_n"):
            del values[name]
        values.update(_PLAIN_QUERY)
    values.update(_MOE if moe else _DENSE)
    return values


def recomputed_gemms(remat: str, moe: bool, q_lora: bool = True, expert_parallel: bool = True) -> frozenset[str]:
    """The GEMMs of one scanned block that `remat` runs forward again in the backward pass.

    expert_parallel: the dispatch and combine rows carry their checkpoint names (a dispatch
    plan); False on one device, where comm-saving policies cannot keep them.
    """
    if remat == "none":
        return frozenset()
    if remat not in SAVED:
        raise ValueError(f"model.remat={remat!r}: no recompute rule")
    values = block(moe, q_lora)
    saved = set(SAVED[remat]) - (set() if expert_parallel else set(_COMM))
    wanted = [v for _, _, needs in values.values() for v in needs]
    again: set[str] = set()
    while wanted:
        value = wanted.pop()
        if value == "x" or value in saved or value in again:
            continue
        again.add(value)
        wanted.extend(values[value][0])
    return frozenset(values[v][1] for v in again if values[v][1])


def block_gemm_flops(m, seq_len: int, moe: bool) -> dict[str, tuple[str, float]]:
    """{GEMM: (class, forward FLOPs per token)} of one block of ModelConfig `m` (core: the causal half)."""
    d, h = m.hidden_size, m.num_heads
    qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    flops = {
        "kv_down": 2.0 * d * (m.kv_lora_rank + m.qk_rope_head_dim),
        "kv_up": 2.0 * m.kv_lora_rank * h * (m.qk_nope_head_dim + v),
        "core": float(seq_len) * h * (qk + v),
        "o_proj": 2.0 * h * v * d,
    }
    if m.q_lora_rank:
        flops.update(q_down=2.0 * d * m.q_lora_rank, q_up=2.0 * m.q_lora_rank * h * qk)
    else:
        flops["q_proj"] = 2.0 * d * h * qk
    if moe:
        f = m.moe_mlp_dim
        flops.update(
            router=2.0 * d * m.num_experts,
            routed_gate_up=4.0 * d * f * m.experts_per_token,
            routed_down=2.0 * d * f * m.experts_per_token,
            shared_gate_up=4.0 * d * f * m.num_shared_experts,
            shared_down=2.0 * d * f * m.num_shared_experts,
        )
    else:
        flops.update(dense_gate_up=4.0 * d * m.mlp_dim, dense_down=2.0 * d * m.mlp_dim)
    return {name: (GEMM_CLASS[name], f) for name, f in flops.items()}


def block_recompute_flops(m, seq_len: int, moe: bool, expert_parallel: bool = True) -> dict[str, float]:
    """FLOPs per token that `m.remat` runs again in one scanned block, by class."""
    again = recomputed_gemms(m.remat, moe, bool(m.q_lora_rank), expert_parallel)
    out: dict[str, float] = {}
    for name, (cls, flops) in block_gemm_flops(m, seq_len, moe).items():
        out[cls] = out.get(cls, 0.0) + (flops if name in again else 0.0)
    return out
