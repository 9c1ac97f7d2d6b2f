"""maxmoe parameters -> a Hugging Face DeepSeek-V3 folder, streamed one tensor at a time.

    convert_to_hf(checkpoint, out)        `python -m maxmoe.convert to-hf`: from a checkpoint on disk
    export_hf(model, variables, out)      from parameters in memory (a notebook)

Both write config.json in the release's key style and model.safetensors (or numbered shards and
model.safetensors.index.json) that transformers' DeepseekV3ForCausalLM loads: each shard's
header first, from the shapes the mapping (maxmoe.convert.hf.hf_tensors) knows, then each tensor
built, cast, appended and dropped before the next. From a checkpoint the model is never held:
`CheckpointArrays` reads each HF tensor's slices straight from the stored arrays, so host memory
is one HF tensor plus the storage chunks it touches.

docs/ARCHITECTURE.md, "Hugging Face checkpoints" has the storage chunks' part in that.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from maxmoe.config import ModelConfig, UserError
from maxmoe.convert.hf import DEFAULT_SHARD_BYTES, _check_empty, _np_dtype, hf_tensors
from maxmoe.convert.hf_config import hf_config_from_model
from maxmoe.convert.output import removed_on_failure, storage_error
from maxmoe.model.transformer import abstract_variables
from maxmoe.training.checkpoint import check_fits, latest_step_of, saved_model_config, stored_arrays

# Getter of one maxmoe slot: get(collection, path, index) -> the array at variables[collection][path...][index].
Getter = Callable[[str, tuple, tuple], np.ndarray]

_SAFETENSORS_DTYPES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16"}


def write_safetensors(
    path: Path, entries: list[tuple[str, np.dtype, tuple]], build: Callable[[int], np.ndarray], metadata: dict
) -> int:
    """Write a safetensors file of `entries` (name, dtype, shape), building tensor i with `build(i)`.

    The header comes first (its offsets follow from the shapes), then each tensor's bytes in
    order, so only one tensor is in memory at a time. Returns the bytes of tensor data.
    """
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensor data starts 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)))
        file.write(text)
        for i, (name, dtype, shape) in enumerate(entries):
            array = np.ascontiguousarray(build(i))
            if array.dtype != dtype or array.shape != tuple(shape):  # a mapping bug, not bad input
                raise RuntimeError(f"{name}: built {array.dtype} {array.shape}, expected {dtype} {tuple(shape)}")
            file.write(array.reshape(-1).view(np.uint8).data)
            del array
    return offset


def write_hf_folder(
    m: ModelConfig, get: Getter, out: str | Path, dtype: str = "bfloat16", shard_bytes: int = DEFAULT_SHARD_BYTES
) -> list[str]:
    """config.json and the safetensors shards of model `m`, each tensor built from slots read by `get`.

    Router correction biases stay float32 (as in the release). Returns the safetensors file names.
    `out` must be new or empty; if writing fails, what was written there is removed.
    """
    out = Path(out)
    _check_empty(out)
    cast = _np_dtype(dtype)
    tensors = hf_tensors(m, interleaved=True)

    def kind(tensor):
        return np.dtype(np.float32) if tensor.name.endswith("e_score_correction_bias") else cast

    shards, size = [[]], 0
    for tensor in tensors:
        nbytes = math.prod(tensor.shape) * kind(tensor).itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    try:
        with removed_on_failure(out):
            out.mkdir(parents=True, exist_ok=True)
            weight_map, total = {}, 0
            for name, shard in zip(names, shards):
                entries = [(t.name, kind(t), t.shape) for t in shard]
                total += write_safetensors(
                    out / name,
                    entries,
                    lambda i, shard=shard: shard[i].join(get).astype(kind(shard[i])),
                    {"format": "pt"},
                )
                weight_map.update(dict.fromkeys((t.name for t in shard), name))
            if len(names) > 1:
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
            (out / "config.json").write_text(json.dumps(hf_config_from_model(m, dtype), indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {out} ({storage_error(e) or e}); nothing was kept there") from None
    return names


def export_hf(
    m: ModelConfig, variables: dict, out: str | Path, dtype: str = "bfloat16", shard_bytes: int = DEFAULT_SHARD_BYTES
) -> list[str]:
    """Write in-memory {'params', 'router'} of model `m` as an HF folder; returns the safetensors names."""

    def get(collection, path, index):
        node = variables[collection]
        for key in path:
            node = node[key]
        return np.asarray(node[index] if index else node)

    return write_hf_folder(m, get, out, dtype, shard_bytes)


class CheckpointArrays:
    """The parameter and router arrays of a checkpoint's latest step, read one slice at a time.

    Use `CheckpointArrays.open(path, label)`; `model` is the saved ModelConfig and
    `get(collection, path, index)` reads `variables[collection][path...][index]` from disk.
    """

    def __init__(self, model: ModelConfig, state_dir: Path, where: str):
        self.model, self.where = model, where
        self._state_dir = epath.Path(state_dir)
        try:
            stored = json.loads((state_dir / "_METADATA").read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{where}: cannot read {state_dir / '_METADATA'} ({e})") from None
        self._use_ocdbt = bool(stored.get("use_ocdbt", True))
        self._use_zarr3 = bool(stored.get("use_zarr3", False))
        self._context = ocp.type_handlers.get_ts_context(use_ocdbt=self._use_ocdbt)
        self._stores: dict[str, ts.TensorStore] = {}

    @classmethod
    @contextlib.contextmanager
    def open(cls, path: str | Path, label: str) -> Iterator[CheckpointArrays]:
        """The arrays of the latest complete step under `path`; errors start with `label`."""
        with latest_step_of(path, label, "state", "config") as (manager, step, where):
            model = saved_model_config(manager, step, where)
            abstract = abstract_variables(model)
            target = {"params": abstract["params"], "router": abstract.get("router", {})}
            check_fits(stored_arrays(manager, step, where), target, where)
            state_dir = Path(manager.directory) / str(step) / "state"
            if not state_dir.is_dir():
                raise UserError(f"{where}: no state folder {state_dir}")
            yield cls(model, state_dir, where)

    def get(self, collection: str, path: tuple, index: tuple) -> np.ndarray:
        """variables[collection][path...][index], read from disk (only the chunks it overlaps)."""
        key = ".".join((collection, *path))
        try:
            if key not in self._stores:
                info = ocp.type_handlers.ParamInfo(
                    name=key, parent_dir=self._state_dir, use_zarr3=self._use_zarr3, ts_context=self._context
                )
                spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._use_ocdbt)
                self._stores[key] = ts.open(spec, open=True, read=True, context=self._context).result()
            return self._stores[key][index].read().result()
        except Exception as e:  # noqa: BLE001 - tensorstore reports missing or damaged data in its own types
            detail = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise UserError(f"{self.where}: cannot read {key} ({detail})") from None


def convert_to_hf(
    checkpoint: str | Path,
    out: str | Path,
    dtype: str = "bfloat16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    label: str = "",
) -> list[str]:
    """Export a maxmoe checkpoint (converted or trained) as an HF DeepSeek-V3 folder, streamed.

    Errors start with `label` (default `checkpoint <path>`; the command line says `--checkpoint <path>`).
    """
    _check_empty(Path(out))
    _np_dtype(dtype)
    with CheckpointArrays.open(checkpoint, label or f"checkpoint {checkpoint}") as arrays:
        return write_hf_folder(arrays.model, arrays.get, out, dtype, shard_bytes)
