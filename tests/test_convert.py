"""Hugging Face <-> maxmoe conversion against the golden transformers fixture (tests/fixtures)."""

import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util

pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

from maxmoe.config import ModelConfig, UserError, load_config  # noqa: E402
from maxmoe.convert import fp8, hf, hf_export  # noqa: E402
from maxmoe.convert.__main__ import main as convert_main  # noqa: E402
from maxmoe.convert.hf_config import hf_config_from_model  # noqa: E402
from maxmoe.model import transformer  # noqa: E402
from maxmoe.training import checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "hf_tiny_deepseek_v3"


@pytest.fixture(scope="module")
def golden():
    return dict(np.load(FIXTURE / "logits.npz"))


@pytest.fixture(scope="module")
def fixture_tensors():
    return load_file(str(FIXTURE / "model.safetensors"))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The fixture converted by the command line: its folder, and its ModelConfig and variables read back."""
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    assert convert_main(["from-hf", "--hf-dir", str(FIXTURE), "--out", str(out)]) == 0
    return out, *hf.read_checkpoint(out)


def write_hf_folder(folder: Path, tensors: dict, config_updates: dict | None = None) -> Path:
    """An HF folder with the fixture's config.json (plus updates) and these tensors."""
    folder.mkdir(parents=True)
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(config_updates or {})
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def forward(model_config, variables, tokens):
    """(logits, mtp_logits) of the maxmoe model, jitted (one compile instead of op-by-op dispatch)."""
    apply = jax.jit(lambda v, t: transformer.build_model(model_config).apply(v, t, mutable=["moe_stats"])[0])
    return apply(variables, tokens)


def assert_trees_equal(a, b):
    flat_a, flat_b = traverse_util.flatten_dict(a), traverse_util.flatten_dict(b)
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        x, y = np.asarray(flat_a[key]), np.asarray(flat_b[key])
        assert x.dtype == y.dtype and x.shape == y.shape, key
        np.testing.assert_array_equal(x, y, err_msg="/".join(key))


@pytest.mark.smoke
def test_imported_logits_match_transformers(golden):
    config, variables = hf.load_pretrained(FIXTURE, dtype="float32")
    assert config.model.compute_dtype == "float32"
    logits, mtp_logits = forward(config.model, variables, golden["tokens"])
    # float32 through 3 layers + MTP with logits of size ~10; measured 4e-6 (the fixture's float64 check: 7e-6).
    np.testing.assert_allclose(np.asarray(logits), golden["logits"], rtol=0, atol=1e-4)
    # maxmoe's MTP at position t reads h[t] and token t+1, as the fixture's; its last position has no t+1.
    assert len(mtp_logits) == 1 and golden["mtp_logits"].shape == (2, 11, 64)
    np.testing.assert_allclose(np.asarray(mtp_logits[0])[:, :11], golden["mtp_logits"], rtol=0, atol=1e-4)


def test_checkpoint_logits_match_and_config_yaml_is_a_train_config(imported, golden):
    out, model, _ = imported
    config = load_config([str(out / "config.yaml")], ["model.compute_dtype=float32"])
    assert config.model == dataclasses.replace(model, compute_dtype="float32")
    loaded_config, variables = hf.load_pretrained(out)
    logits = jax.jit(functools.partial(transformer.logits, loaded_config.model))(variables, golden["tokens"])
    # The same fp32 comparison as above (measured 4e-6); 1e-4 is the required bound.
    np.testing.assert_allclose(np.asarray(logits), golden["logits"], rtol=0, atol=1e-4)


def test_export_reproduces_the_fixture_and_reimports_bit_exactly(imported, fixture_tensors, tmp_path):
    out, model, variables = imported
    assert convert_main(["to-hf", "--checkpoint", str(out), "--out", str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in fixture_tensors.items()}
    for name, value in fixture_tensors.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    assert hf.model_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text())) == model
    again = tmp_path / "again"
    assert convert_main(["from-hf", "--hf-dir", str(tmp_path / "hf"), "--out", str(again)]) == 0
    assert_trees_equal(hf.read_checkpoint(again)[1], variables)


def test_scratch_memory_maps_give_the_same_checkpoint(imported, tmp_path, monkeypatch):
    monkeypatch.setattr(hf, "SCRATCH_MIN_BYTES", 0)  # every output array memory-mapped
    hf.convert_from_hf(FIXTURE, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / ".convert-scratch").exists()
    assert_trees_equal(hf.read_checkpoint(tmp_path / "ckpt")[1], imported[2])


def test_sharded_bfloat16_export_reimports(imported, tmp_path):
    _, model, variables = imported
    names = hf_export.export_hf(model, variables, tmp_path / "hf", dtype="bfloat16", shard_bytes=40_000)
    assert len(names) > 1 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    m, again = hf.import_hf(tmp_path / "hf", dtype="bfloat16")
    assert m == model
    expected = jax.tree.map(lambda x: x.astype(hf._np_dtype("bfloat16")), variables["params"])
    assert_trees_equal(again["params"], expected)
    assert_trees_equal(again["router"], variables["router"])  # correction biases stay float32


def test_plain_query_no_shared_experts_no_mtp_round_trip(tmp_path):
    m = ModelConfig(q_lora_rank=0, num_shared_experts=0, mtp_num_layers=0, rope_scaling="none", num_layers=2)
    rng = np.random.default_rng(1)  # random values for every slot; the model itself is not run
    variables = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), transformer.abstract_variables(m))
    hf_export.export_hf(m, variables, tmp_path / "hf", dtype="float32")
    assert "model.layers.0.self_attn.q_proj.weight" in load_file(str(tmp_path / "hf" / "model.safetensors"))
    m2, again = hf.import_hf(tmp_path / "hf")
    assert m2 == m
    assert_trees_equal(again, variables)


def test_non_interleaved_rope_is_permuted_into_adjacent_pairs(fixture_tensors, golden, tmp_path):
    # transformers' rope_interleave=True on rope dims x equals rope_interleave=False on x[0, 2, .., 1, 3, ..].
    rope, nope, heads, lora = 4, 8, 4, 16
    half_split = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    tensors = dict(fixture_tensors)
    for name, value in fixture_tensors.items():
        if name.endswith("q_b_proj.weight"):
            per_head = value.reshape(heads, nope + rope, -1)
            tensors[name] = np.concatenate([per_head[:, :nope], per_head[:, nope:][:, half_split]], 1).reshape(
                value.shape
            )
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            tensors[name] = np.concatenate([value[:lora], value[lora:][half_split]], 0)
    folder = write_hf_folder(tmp_path / "hf", tensors, {"rope_interleave": False})
    config, variables = hf.load_pretrained(folder)
    logits, _ = forward(config.model, variables, golden["tokens"])
    # Permuting rows is exact; what remains is the fp32 difference measured above (4e-6).
    np.testing.assert_allclose(np.asarray(logits), golden["logits"], rtol=0, atol=1e-4)


def test_fp8_block_scaled_weight_is_dequantised(fixture_tensors, tmp_path):
    name = "model.layers.1.self_attn.q_b_proj.weight"  # [48, 16]: 32 x 8 blocks, a partial edge block
    weight, scale_inv = fp8.quantize_fp8_blockwise(fixture_tensors[name], block=(32, 8))
    tensors = dict(fixture_tensors)
    tensors[name], tensors[name + "_scale_inv"] = weight, scale_inv
    folder = write_hf_folder(
        tmp_path / "hf",
        tensors,
        {
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [32, 8],
            }
        },
    )
    reference = fp8.dequantize_fp8_blockwise(weight, scale_inv, block=(32, 8))
    assert not np.array_equal(reference, fixture_tensors[name])  # the quantisation is visible
    _, variables = hf.import_hf(folder)
    w_q_up = variables["params"]["moe_layers"]["attention"]["w_q_up"][0]
    np.testing.assert_array_equal(w_q_up, reference.reshape(4, 12, 16).transpose(2, 0, 1))


def test_release_style_config_keys():
    release = {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    }
    m = hf.model_config_from_hf(release)
    assert (m.num_layers, m.first_k_dense, m.num_experts, m.num_expert_groups, m.topk_groups) == (61, 3, 256, 8, 4)
    assert (m.rope_scaling, m.rope_factor, m.rope_original_max_position, m.mtp_num_layers) == ("yarn", 40.0, 4096, 1)
    assert hf.model_config_from_hf(hf_config_from_model(m, "bfloat16")) == m
    assert hf.model_config_from_hf({**release, "q_lora_rank": None, "rope_scaling": None}).q_lora_rank == 0
    with pytest.raises(UserError, match="rope type 'linear'"):
        hf.model_config_from_hf({**release, "rope_scaling": {"type": "linear", "factor": 2}})


def _drop(tensors):
    tensors = dict(tensors)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    return tensors


def _reshape(tensors):
    return {**tensors, "model.layers.0.self_attn.o_proj.weight": np.zeros((32, 31), np.float32)}


def _rename(tensors):
    return {**tensors, "model.layers.1.mlp.experts.8.up_proj.weight": np.zeros((16, 32), np.float32)}


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_drop, "tensor model.layers.2.mlp.experts.5.up_proj.weight is missing"),
        (_reshape, "tensor model.layers.0.self_attn.o_proj.weight has shape [32, 31], expected [32, 32]"),
        (_rename, "unknown tensor model.layers.1.mlp.experts.8.up_proj.weight"),
    ],
)
def test_bad_tensors_are_one_line_exit_2(corrupt, message, fixture_tensors, tmp_path):
    folder = write_hf_folder(tmp_path / "hf", corrupt(fixture_tensors))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "maxmoe.convert", "from-hf", "--hf-dir", str(folder), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("maxmoe: error: ")
    assert message in result.stderr
    assert not out.exists()


@pytest.mark.slow  # a training subprocess: compiles the train and eval steps
def test_train_runs_from_imported_weights(imported, tmp_path):
    out = imported[0]
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "maxmoe.train",
            "--config",
            str(out / "config.yaml"),
            f"checkpoint.init_from={out}",
            "train.steps=2",
            "data.source=synthetic",
            f"run.dir={run_dir}",
            "model.compute_dtype=float32",
            "train.batch_size=2",
            "train.seq_len=16",
            "train.eval_batches=1",
            "train.warmup_steps=1",
            "run.cpu_devices=1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (run_dir / "config.yaml").is_file()
    shutil.rmtree(run_dir)


def _fixture_config(drop=(), **updates) -> dict:
    config = {**json.loads((FIXTURE / "config.json").read_text()), **updates}
    return {k: v for k, v in config.items() if k not in drop}


@pytest.mark.parametrize(
    "config_json, message",
    [
        ([1, 2], "config.json: expected a JSON object of config keys, not a list"),
        (
            _fixture_config(drop=("rope_parameters",), rope_scaling="yarn"),
            "config.json: 'rope_scaling' is 'yarn', expected an object",
        ),
        (
            _fixture_config(rope_parameters={**_fixture_config()["rope_parameters"], "factor": "forty"}),
            "config.json rope_parameters: 'factor' is 'forty', expected a number",
        ),
        (_fixture_config(num_hidden_layers="3"), "config.json: 'num_hidden_layers' is '3', expected an integer"),
        (_fixture_config(quantization_config="fp8"), "weight_block_size 'fp8': expected [rows, columns]"),
    ],
)
def test_malformed_config_json_is_one_line_exit_2(config_json, message, tmp_path, capsys):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config_json))
    shutil.copy(FIXTURE / "model.safetensors", folder / "model.safetensors")
    assert convert_main(["from-hf", "--hf-dir", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("maxmoe: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def _run_convert(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "maxmoe.convert", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )


def test_to_hf_errors_name_the_option_and_print_nothing_else(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run_convert("to-hf", "--checkpoint", str(empty), "--out", str(tmp_path / "hf"))
    assert result.returncode == 2
    assert result.stderr == f"maxmoe: error: --checkpoint {empty}: no complete checkpoint step in {empty}\n"
    assert not (tmp_path / "hf").exists()


# Runs a command and prints its peak RSS. A small parent of its own, because Linux carries a
# process's peak across fork + exec: measured straight from pytest, the child would report
# pytest's size.
_PEAK_RSS = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * (1 if sys.platform == "darwin" else 1024))
sys.exit(code)
"""


def _max_rss_bytes(*args) -> tuple[int, subprocess.CompletedProcess]:
    """Peak resident memory of `python -m maxmoe.convert ARGS` in bytes, and the finished run."""
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, sys.executable, "-m", "maxmoe.convert", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    return int(result.stdout.strip().splitlines()[-1]), result


@pytest.mark.slow
def test_to_hf_streams_without_holding_the_model(imported, tmp_path):
    # ~400 MB of float32 parameters, nearly all in 2 x 64 experts of 512 x 512 x 3.
    m = ModelConfig(hidden_size=512, moe_mlp_dim=512, num_experts=64, num_layers=3, first_k_dense=1, mtp_num_layers=0)
    flat = traverse_util.flatten_dict(transformer.abstract_variables(m))
    value = {key: 0.5 * (i + 1) for i, key in enumerate(flat)}  # each array one constant: cheap, checkable
    model_bytes = sum(math.prod(s.shape) * s.dtype.itemsize for s in flat.values())
    assert model_bytes > 380e6
    variables = traverse_util.unflatten_dict({k: np.full(s.shape, value[k], s.dtype) for k, s in flat.items()})
    checkpoint.save_params(tmp_path / "big", variables["params"], variables["router"], hf.full_config(m))
    del variables

    # Oracle for the baseline: the same command on the tiny fixture (imports, runtime, no model to speak of).
    baseline, small = _max_rss_bytes("to-hf", "--checkpoint", str(imported[0]), "--out", str(tmp_path / "small"))
    peak, big = _max_rss_bytes(
        "to-hf", "--checkpoint", str(tmp_path / "big"), "--out", str(tmp_path / "hf"), "--dtype", "float32"
    )
    assert small.returncode == 0 and big.returncode == 0, (small.stderr, big.stderr)
    assert big.stderr == ""  # no warnings either
    print(
        f"to-hf max RSS: {peak / 1e6:.0f} MB for a {model_bytes / 1e6:.0f} MB model; baseline {baseline / 1e6:.0f} MB"
    )
    # Holding the model would add at least its size; streaming adds about one tensor (1 MiB here)
    # plus the reader's caches.
    assert peak - baseline < model_bytes / 8 and peak < model_bytes

    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="np") as exported:
        assert len(list(exported.keys())) == len(hf.hf_tensors(m))
        for name, key in [
            ("model.layers.2.mlp.experts.63.down_proj.weight", ("params", "moe_layers", "moe", "w_down")),
            ("model.layers.1.mlp.experts.0.gate_proj.weight", ("params", "moe_layers", "moe", "w_gate")),
            ("model.layers.2.mlp.gate.e_score_correction_bias", ("router", "moe_layers", "moe", "router", "bias")),
            ("lm_head.weight", ("params", "head")),
        ]:
            tensor = exported.get_tensor(name)
            assert tensor.dtype == np.float32 and (tensor == value[key]).all(), name
