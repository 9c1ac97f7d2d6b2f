"""Hugging Face / DeepSeek-V3 release checkpoints <-> maxmoe parameters.

    config, variables = load_pretrained("path/to/DeepSeek-V3")      # an HF folder or a maxmoe checkpoint
    convert_from_hf(hf_dir, out)                                       # `python -m maxmoe.convert from-hf`
    tensors = hf_tensors(model_config)            # the mapping: every HF tensor, its maxmoe slots

Import reads config.json (the release's `rope_scaling` + `rope_theta`, or transformers 5.x
`rope_parameters`) into a ModelConfig and the safetensors shards into the stacked maxmoe tree one
tensor at a time (host memory: the outputs plus the largest tensor; with a scratch folder,
outputs of 64 MiB or more are memory-mapped). FP8 weights with a `weight_scale_inv` are
dequantised block-wise (maxmoe.convert.fp8); a release whose rope pairs are not interleaved has
its rope rows permuted into maxmoe's adjacent pairs. Export (maxmoe.convert.hf_export) writes the
release layout back with the same mapping.

docs/ARCHITECTURE.md, "Hugging Face checkpoints" has the tensor mapping, its legend and RoPE's pairs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import struct
import types
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import yaml
from flax import traverse_util

from maxmoe.cli import check_new_folder
from maxmoe.config import Config, ModelConfig, TrainConfig, UserError, build_config
from maxmoe.convert.fp8 import dequantize_fp8_blockwise, scale_grid_shape
from maxmoe.convert.hf_config import model_config_from_hf
from maxmoe.convert.output import quiet_save, removed_on_failure, storage_error
from maxmoe.model.transformer import abstract_variables
from maxmoe.training.checkpoint import latest_step_of, load_params, save_params, saved_model_config

SCRATCH_MIN_BYTES = 64 << 20  # output arrays at least this big are memory-mapped when a scratch folder is given
DEFAULT_SHARD_BYTES = 5 << 30
_DTYPES = {"float32": np.float32, "bfloat16": "bfloat16"}


def _np_dtype(name: str) -> np.dtype:
    if name not in _DTYPES:
        raise UserError(f"dtype {name!r}: allowed values are float32, bfloat16")
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(np.float32)


# ----------------------------------------------------------------------------- the mapping


class Tensor(NamedTuple):
    """One HF tensor: its name and shape, how it splits into maxmoe slots, how it is rebuilt."""

    name: str
    shape: tuple
    split: Callable[[np.ndarray], list]  # W -> [(collection, path, index, array)]
    join: Callable[[Callable], np.ndarray]  # get(collection, path, index) -> W


def _rope_order(m: ModelConfig, interleaved: bool) -> np.ndarray:
    """Rope dims of an HF tensor in maxmoe's order: adjacent pairs; (i, i + R/2) pairs when not interleaved."""
    r = m.qk_rope_head_dim
    return np.arange(r) if interleaved else np.stack([np.arange(r // 2), np.arange(r // 2) + r // 2], 1).reshape(-1)


def _linear(name, out_dim, in_dim, path, prefix=(), index=(), collection="params"):
    """A plain linear weight [out, in] <-> a kernel [in, out]."""
    full = prefix + path
    return Tensor(
        name, (out_dim, in_dim), lambda w: [(collection, full, index, w.T)], lambda get: get(collection, full, index).T
    )


def _vector(name, size, path, prefix=(), index=(), collection="params"):
    full = prefix + path
    return Tensor(name, (size,), lambda w: [(collection, full, index, w)], lambda get: get(collection, full, index))


def _block_tensors(
    m: ModelConfig, hf_prefix: str, prefix: tuple, index: tuple, moe: bool, interleaved: bool
) -> list[Tensor]:
    """The HF tensors of one decoder layer, mapped to the maxmoe block at `prefix` (slot `index`)."""
    d, h, n, r, v = m.hidden_size, m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    q, kv = m.q_lora_rank, m.kv_lora_rank
    a = prefix + ("attention",)
    rope = _rope_order(m, interleaved)
    inverse = np.argsort(rope)
    head_order = np.concatenate([np.arange(n), n + rope])  # per q head: [nope | rope]

    def q_split(path, in_dim):
        def split(w):  # [H*(N+R), in] -> [in, H, N+R]
            return [("params", a + path, index, w.reshape(h, n + r, in_dim)[:, head_order].transpose(2, 0, 1))]

        return split

    def q_join(path, in_dim):
        def join(get):
            return (
                get("params", a + path, index)
                .transpose(1, 2, 0)[:, np.argsort(head_order)]
                .reshape(h * (n + r), in_dim)
            )

        return join

    def kv_a_split(w):  # [L+R, D]
        return [("params", a + ("w_kv_down",), index, w[:kv].T), ("params", a + ("w_k_rope",), index, w[kv:][rope].T)]

    def kv_a_join(get):
        return np.concatenate(
            [get("params", a + ("w_kv_down",), index).T, get("params", a + ("w_k_rope",), index).T[inverse]], 0
        )

    def kv_b_split(w):  # [H*(N+V), L]
        w = w.reshape(h, n + v, kv)
        return [
            ("params", a + ("w_k_up",), index, w[:, :n].transpose(2, 0, 1)),
            ("params", a + ("w_v_up",), index, w[:, n:].transpose(2, 0, 1)),
        ]

    def kv_b_join(get):
        k_up, v_up = get("params", a + ("w_k_up",), index), get("params", a + ("w_v_up",), index)
        return np.concatenate([k_up.transpose(1, 2, 0), v_up.transpose(1, 2, 0)], 1).reshape(h * (n + v), kv)

    def o_split(w):  # [D, H*V] -> [H, V, D]
        return [("params", a + ("w_out",), index, w.T.reshape(h, v, d))]

    def o_join(get):
        return get("params", a + ("w_out",), index).reshape(h * v, d).T

    p = hf_prefix + "self_attn."
    out = [_vector(hf_prefix + "input_layernorm.weight", d, ("attn_norm", "scale"), prefix, index)]
    if q:
        out += [
            _linear(p + "q_a_proj.weight", q, d, ("attention", "w_q_down"), prefix, index),
            _vector(p + "q_a_layernorm.weight", q, ("attention", "q_norm", "scale"), prefix, index),
            Tensor(p + "q_b_proj.weight", (h * (n + r), q), q_split(("w_q_up",), q), q_join(("w_q_up",), q)),
        ]
    else:
        out.append(Tensor(p + "q_proj.weight", (h * (n + r), d), q_split(("w_q",), d), q_join(("w_q",), d)))
    out += [
        Tensor(p + "kv_a_proj_with_mqa.weight", (kv + r, d), kv_a_split, kv_a_join),
        _vector(p + "kv_a_layernorm.weight", kv, ("attention", "kv_norm", "scale"), prefix, index),
        Tensor(p + "kv_b_proj.weight", (h * (n + v), kv), kv_b_split, kv_b_join),
        Tensor(p + "o_proj.weight", (d, h * v), o_split, o_join),
        _vector(hf_prefix + "post_attention_layernorm.weight", d, ("mlp_norm", "scale"), prefix, index),
    ]
    mp = hf_prefix + "mlp."
    if not moe:
        f = m.mlp_dim
        return out + [
            _linear(mp + "gate_proj.weight", f, d, ("mlp", "w_gate"), prefix, index),
            _linear(mp + "up_proj.weight", f, d, ("mlp", "w_up"), prefix, index),
            _linear(mp + "down_proj.weight", d, f, ("mlp", "w_down"), prefix, index),
        ]
    f, e = m.moe_mlp_dim, m.num_experts
    out += [
        _linear(mp + "gate.weight", e, d, ("moe", "router", "w_gate"), prefix, index),
        _vector(mp + "gate.e_score_correction_bias", e, ("moe", "router", "bias"), prefix, index, "router"),
    ]
    for i in range(e):
        ep = f"{mp}experts.{i}."
        out += [
            _linear(ep + "gate_proj.weight", f, d, ("moe", "w_gate"), prefix, index + (i,)),
            _linear(ep + "up_proj.weight", f, d, ("moe", "w_up"), prefix, index + (i,)),
            _linear(ep + "down_proj.weight", d, f, ("moe", "w_down"), prefix, index + (i,)),
        ]
    if m.num_shared_experts:
        fs = f * m.num_shared_experts
        sp = mp + "shared_experts."
        out += [
            _linear(sp + "gate_proj.weight", fs, d, ("moe", "shared", "w_gate"), prefix, index),
            _linear(sp + "up_proj.weight", fs, d, ("moe", "shared", "w_up"), prefix, index),
            _linear(sp + "down_proj.weight", d, fs, ("moe", "shared", "w_down"), prefix, index),
        ]
    return out


def hf_tensors(m: ModelConfig, interleaved: bool = True) -> list[Tensor]:
    """Every HF tensor of the model, in the release's order, with its maxmoe mapping."""
    d, vocab = m.hidden_size, m.vocab_size
    out = [_vector("model.embed_tokens.weight", None, ("embed", "embedding"))._replace(shape=(vocab, d))]
    for i in range(m.num_layers):
        moe = i >= m.first_k_dense
        stack, j = ("moe_layers", i - m.first_k_dense) if moe else ("dense_layers", i)
        out += _block_tensors(m, f"model.layers.{i}.", (stack,), (j,), moe, interleaved)
    for k in range(m.mtp_num_layers):
        hp, mp = f"model.layers.{m.num_layers + k}.", (f"mtp_{k}",)
        out += [
            _vector(hp + "enorm.weight", d, ("emb_norm", "scale"), mp),
            _vector(hp + "hnorm.weight", d, ("hidden_norm", "scale"), mp),
            _linear(hp + "eh_proj.weight", d, 2 * d, ("w_proj",), mp),
        ]
        out += _block_tensors(m, hp, mp + ("block",), (), True, interleaved)
        out += [
            _vector(hp + "shared_head.norm.weight", d, ("out_norm", "scale"), mp),
            Tensor(
                hp + "embed_tokens.weight",
                (vocab, d),
                lambda w: [],
                lambda get: get("params", ("embed", "embedding"), ()),
            ),
            Tensor(
                hp + "shared_head.head.weight", (vocab, d), lambda w: [], lambda get: get("params", ("head",), ()).T
            ),
        ]
    out += [_vector("model.norm.weight", d, ("final_norm", "scale")), _linear("lm_head.weight", vocab, d, ("head",))]
    return out


# ----------------------------------------------------------------------------- import


class _Source:
    """The safetensors files of an HF folder: names, shapes, dtypes; reads one tensor at a time."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            files = _index_files(index)
        elif (folder / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise UserError(f"{folder}: no model.safetensors or model.safetensors.index.json")
        self.paths, self.handles, self.file_of, self.shape, self.dtype = {}, {}, {}, {}, {}
        for file in files:
            path = self.paths[file] = folder / file
            if not path.is_file():
                raise UserError(f"{index}: shard {file} is missing")
            try:
                handle = self.handles[file] = safe_open(str(path), framework="np")
            except Exception as e:  # safetensors raises its own error types for a damaged header
                raise UserError(f"{path}: not a readable safetensors file ({e})") from None
            for name in handle.keys():
                tensor = handle.get_slice(name)
                self.file_of[name], self.shape[name] = file, tuple(tensor.get_shape())
                self.dtype[name] = tensor.get_dtype()

    def read(self, name: str) -> np.ndarray:
        """The tensor as numpy; float8 as its uint8 bytes (numpy has no float8 for safetensors to return)."""
        if not self.dtype[name].startswith("F8"):
            return self.handles[self.file_of[name]].get_tensor(name)
        if self.dtype[name] != "F8_E4M3":
            raise UserError(f"tensor {name}: dtype {self.dtype[name]} is not supported (float8 must be F8_E4M3)")
        path = self.paths[self.file_of[name]]
        with open(path, "rb") as f:
            header_size = struct.unpack("<Q", f.read(8))[0]
            start, end = json.loads(f.read(header_size))[name]["data_offsets"]
        data = np.fromfile(path, dtype=np.uint8, count=end - start, offset=8 + header_size + start)
        return data.reshape(self.shape[name])


def _index_files(index: Path) -> list[str]:
    """The shard file names a model.safetensors.index.json maps tensors to; each must be a file name."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{index}: not a safetensors index (no 'weight_map')") from None
    if not isinstance(weight_map, dict):
        raise UserError(f"{index}: weight_map is a {type(weight_map).__name__}, expected {{tensor: file}}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
            raise UserError(f"{index}: weight_map[{name!r}] = {file!r}; expected a file name in the folder")
    return sorted(set(weight_map.values()))


def _validate(source: _Source, tensors: list[Tensor], block: tuple[int, int]) -> None:
    """Every expected tensor present with its shape, nothing unknown; one line naming the first problem."""
    expected = {t.name: t.shape for t in tensors}
    for name in expected:
        if name not in source.shape:
            raise UserError(f"tensor {name} is missing from the checkpoint")
    for name, shape in source.shape.items():
        if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in expected:
            weight = name[: -len("_scale_inv")]
            want = scale_grid_shape(expected[weight], block) if len(expected[weight]) == 2 else None
            if shape != want:
                raise UserError(
                    f"tensor {name} has shape {list(shape)}, expected {list(want or ())} "
                    f"(one scale per {block[0]}x{block[1]} block of {weight})"
                )
            continue
        if name not in expected:
            raise UserError(f"unknown tensor {name} (shape {list(shape)}) for this config")
        if shape != expected[name]:
            raise UserError(f"tensor {name} has shape {list(shape)}, expected {list(expected[name])}")
        if source.dtype[name].startswith("F8") and name + "_scale_inv" not in source.shape:
            raise UserError(f"tensor {name} is {source.dtype[name]} but {name}_scale_inv is missing")


def _block_size(hf: dict, where: Path) -> tuple[int, int]:
    """The FP8 scale block of `quantization_config.weight_block_size` (default 128 x 128)."""
    quantization = hf.get("quantization_config") or {}
    block = quantization.get("weight_block_size") if isinstance(quantization, dict) else quantization
    if block is None:
        return (128, 128)
    sizes = block if isinstance(block, list) and len(block) == 2 else []
    if not sizes or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes):
        raise UserError(f"{where}: quantization_config weight_block_size {block!r}: expected [rows, columns]")
    return tuple(block)


def import_hf(folder: str | Path, dtype: str = "float32", scratch: Path | None = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, {'params', 'router'} of numpy arrays) from an HF DeepSeek-V3 folder.

    Parameters are `dtype`; router biases stay float32. Tensors are read one at a time into
    their slots of the stacked outputs; with `scratch`, outputs of SCRATCH_MIN_BYTES or more are
    memory-mapped .npy files there (the caller deletes the folder after saving).
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder (expected a Hugging Face model folder)")
    if not config_path.is_file():
        raise UserError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    try:
        hf = json.loads(config_path.read_text())
    except ValueError:
        raise UserError(f"{config_path}: not valid JSON") from None
    m = model_config_from_hf(hf, str(config_path))
    out_dtype = _np_dtype(dtype)
    block = _block_size(hf, config_path)
    tensors = hf_tensors(m, interleaved=bool(hf.get("rope_interleave", True)))
    source = _Source(folder)
    _validate(source, tensors, block)

    targets = traverse_util.flatten_dict(abstract_variables(m))  # (collection, *path) -> ShapeDtypeStruct
    outputs, filled = {}, dict.fromkeys(targets, 0)
    for tensor in tensors:
        weight = source.read(tensor.name)
        if source.dtype[tensor.name].startswith("F8"):
            weight = dequantize_fp8_blockwise(weight, source.read(tensor.name + "_scale_inv"), block)
        for collection, path, index, value in tensor.split(weight):
            key = (collection,) + path
            if key not in outputs:
                kind = np.dtype(np.float32) if collection == "router" else out_dtype
                outputs[key] = _allocate(targets[key].shape, kind, scratch, len(outputs))
            slot = outputs[key][index] if index else outputs[key]
            if slot.shape != value.shape:  # a mapping bug, not bad input: the HF shapes were checked
                raise RuntimeError(f"{tensor.name} -> {'/'.join(key)}{list(index)}: {value.shape} != {slot.shape}")
            outputs[key][index if index else ...] = value
            filled[key] += value.size
        del weight
    for key, count in filled.items():
        if count != math.prod(targets[key].shape):
            raise RuntimeError(f"maxmoe parameter {'/'.join(key)} was not filled by the mapping")
    variables = traverse_util.unflatten_dict(outputs)
    return m, {"params": variables.get("params", {}), "router": variables.get("router", {})}


def _allocate(shape: tuple, dtype: np.dtype, scratch: Path | None, number: int) -> np.ndarray:
    if scratch is not None and math.prod(shape) * dtype.itemsize >= SCRATCH_MIN_BYTES:
        scratch.mkdir(parents=True, exist_ok=True)
        return np.lib.format.open_memmap(scratch / f"{number}.npy", mode="w+", dtype=dtype, shape=shape)
    return np.empty(shape, dtype)


def _sections(m: ModelConfig) -> dict:
    """This model, and train.seq_len where the default is longer than the model's positions."""
    sections = {"model": dataclasses.asdict(m)}
    if TrainConfig().seq_len > m.max_position_embeddings:
        sections["train"] = {"seq_len": m.max_position_embeddings}
    return sections


def full_config(m: ModelConfig) -> Config:
    """Default sections plus this model."""
    return build_config(_sections(m))


def config_yaml(m: ModelConfig, source: str) -> str:
    """A `model:` section that `python -m maxmoe.train --config` accepts, with the house header."""
    return (
        f"# DeepSeek-V3 model converted from {source} by `python -m maxmoe.convert from-hf`.\n"
        f"# Fine-tune: python -m maxmoe.train --config <this file> checkpoint.init_from=<this folder>\n"
        f"# Expect the loss to start at the pretrained model's level, not at ln(vocab_size).\n"
        + yaml.safe_dump(_sections(m), sort_keys=False)
    )


def convert_from_hf(hf_dir: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write `out`/checkpoints (save_params) and `out`/config.yaml from an HF folder.

    The folder's tokenizer files come along, so `python -m maxmoe.generate --checkpoint out` finds them.
    """
    out = Path(out)
    _check_empty(out)
    scratch = out / ".convert-scratch"
    with removed_on_failure(out):
        try:
            m, variables = import_hf(hf_dir, dtype, scratch=scratch)
            with quiet_save():
                save_params(out, variables["params"], variables["router"], full_config(m))
            (out / "config.yaml").write_text(config_yaml(m, str(hf_dir)))
            for name in TOKENIZER_FILES:
                if (Path(hf_dir) / name).is_file():
                    shutil.copyfile(Path(hf_dir) / name, out / name)
        except (OSError, ValueError) as e:  # orbax/tensorstore report a failed write as ValueError
            problem = storage_error(e)
            if problem is None:
                raise
            raise UserError(f"cannot write {out} ({problem}); nothing was kept there") from None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _check_empty(out: Path) -> None:
    check_new_folder(out)


# ----------------------------------------------------------------------------- maxmoe checkpoints


def read_checkpoint(path: str | Path, label: str = "") -> tuple[ModelConfig, dict]:
    """(ModelConfig, {'params', 'router'} as host numpy arrays) from a maxmoe checkpoint or run folder.

    Errors start with `label` (default `checkpoint <path>`).
    """
    label = label or f"checkpoint {path}"
    with latest_step_of(path, label, "config") as (manager, step, where):
        m = saved_model_config(manager, step, where)
    restored = load_params(str(path), types.SimpleNamespace(**abstract_variables(m)), label=label)
    return m, {k: _to_numpy(v) for k, v in restored.items()}


def _to_numpy(tree):
    return jax.tree.map(np.asarray, tree)


def load_pretrained(path: str | Path, dtype: str = "float32", compute_dtype: str | None = None):
    """(Config, {'params', 'router'}) from an HF folder or a maxmoe checkpoint, for notebooks.

    `dtype` is the parameter dtype; the model computes in `compute_dtype` (default: `dtype`).
    Then `maxmoe.model.logits(config.model, variables, tokens)` gives [batch, seq, vocab].
    """
    path = Path(path)
    if (path / "config.json").is_file():
        m, variables = import_hf(path, dtype)
    else:
        m, variables = read_checkpoint(path)
        cast = _np_dtype(dtype)
        variables = {
            "params": jax.tree.map(lambda x: x.astype(cast), variables["params"]),
            "router": variables["router"],
        }
    m = dataclasses.replace(m, compute_dtype=compute_dtype or dtype)
    return full_config(m), jax.tree.map(jnp.asarray, variables)
