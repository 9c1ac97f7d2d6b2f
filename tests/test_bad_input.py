"""Bad input at every entry point is one line, `maxmoe: error: ...`, and exit status 2 (never a
traceback), found before any work where the input is known then; nothing is left half-written.

The command lines run in this process (their main functions, stderr through capsys); only the
XLA flag check, which must run before a backend starts, needs a process of its own.
"""

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT, job_env

import maxmoe
from maxmoe import generate as generate_module
from maxmoe import xla_flags
from maxmoe.config import MAX_CPU_DEVICES, ConfigError, UserError, load_config
from maxmoe.convert import hf, hf_export
from maxmoe.convert.__main__ import main as convert_main
from maxmoe.data import prepare as prepare_module
from maxmoe.data.__main__ import main as data_main
from maxmoe.generate import generate, generate_text
from maxmoe.generate import main as generate_main
from maxmoe.info import main as info_main
from maxmoe.model.transformer import Transformer, abstract_variables, shift_left
from maxmoe.report import figure, write_report
from maxmoe.report import main as report_main
from maxmoe.sweep import main as sweep_main
from maxmoe.train import main as train_main

TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = [
    "model.num_layers=2",
    "train.batch_size=2",
    "train.seq_len=32",
    "data.source=synthetic",
    "run.progress=none",
]
FIXTURE = ROOT / "tests" / "fixtures" / "hf_tiny_deepseek_v3"


def one_line(capsys, status: int, *words: str) -> str:
    """The single stderr line of a command that exited `status` 2, checked to name `words`."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("maxmoe: error: "), (status, err)
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------- config (train, --print-config)

CONFIG_CASES = {
    "mtp deeper than the sequence": (["model.mtp_num_layers=32"], "must be below train.seq_len=32"),
    "eval_fraction 1, as training refuses": (["data.eval_fraction=1"], "data.eval_fraction=1.0: must be below 1"),
    "wsd decays over twice the steps": (
        ["train.schedule=wsd", "train.decay_fraction=2"],
        "train.decay_fraction=2.0: must be <= 1",
    ),
    "min lr above the peak": (["train.min_lr_ratio=1.5"], "train.min_lr_ratio=1.5: must be <= 1"),
    "100,000 fake devices": (["run.cpu_devices=100000"], f"must be <= {MAX_CPU_DEVICES}"),
    "coordinator not host:port": (
        ["dist.coordinator_address=not_an_address", "dist.num_processes=2", "dist.process_id=0"],
        "expected host:port",
    ),
    "coordinator port out of range": (
        ["dist.coordinator_address=h:70000", "dist.num_processes=2", "dist.process_id=0"],
        "expected host:port",
    ),
    "seed past 32 bits (would repeat seed 0)": (["train.seed=4294967296"], "must be <= 4294967295"),
    "integer past int64": (["train.steps=18446744073709551616"], "out of range"),
    "nan learning rate": (["train.lr=.nan"], "expected a finite number"),
    "token ids past int32": (["model.vocab_size=2147483649"], "token ids are int32"),
    "2**40 sequences per step (hung building the batch)": (["train.batch_size=1099511627776"], "tokens per step"),
    "extra flag without dashes": (["xla.extra_flags=[xla_foo=1]"], "is not an XLA flag"),
    "list where a number goes": (["train.steps=[1]"], "expected an integer"),
    # What context parallelism does not run.
    "context not dividing the sequence's zigzag chunks": (["mesh.context=3"], "not divisible by 2 x mesh.context"),
    "context with pipeline stages": (
        ["mesh.context=2", "mesh.pipeline=2", "train.grad_accum=2"],
        "pipeline stages do not run",
    ),
    "context with the xla attention core": (["mesh.context=2", "model.attention=xla"], "latent attention core"),
    "sequence sharded over data too": (
        ["mesh.context=2", "mesh.rules.seq=[data]"],
        "the sequence is sharded over context alone",
    ),
    "vocab over context": (["mesh.context=2", "mesh.rules.vocab=[context]"], "only seq and expert may use the context"),
    "experts not dividing context x expert": (["mesh.context=16"], "num_experts=8 is not divisible by mesh.context"),
    "weights gathered once without the two-tier step": (
        ["mesh.zero1_gather=per_step"],
        "set mesh.across_domains=zero1",
    ),
    "per-layer reduction without the two-tier step": (["mesh.zero1_reduce=per_layer"], "set mesh.across_domains=zero1"),
    "a removed key": (["mesh.gather_once=true"], "mesh.gather_once was removed; set mesh.zero1_gather=per_step"),
    "a removed key with no replacement": (["mesh.sum_per_layer=true"], "mesh.sum_per_layer was removed"),
    "a removed key, its default": (["mesh.reduce_per_layer=false"], "set mesh.zero1_reduce (or leave it out) instead"),
}


@pytest.mark.parametrize("print_config", [True, False], ids=["--print-config", "train"])
@pytest.mark.parametrize("case", CONFIG_CASES, ids=list(CONFIG_CASES))
def test_config_values_training_rejects_are_rejected_by_print_config_too(case, print_config, tmp_path, capsys):
    overrides, message = CONFIG_CASES[case]
    run_dir = tmp_path / "run"
    argv = ["--config", TINY, *SMALL, *overrides, f"run.dir={run_dir}"] + (["--print-config"] if print_config else [])
    one_line(capsys, train_main(argv), message)
    assert not run_dir.exists()


def test_config_file_inputs(tmp_path, capsys):
    (tmp_path / "latin1.yaml").write_bytes(b"train:\n  steps: 3 # \xe9\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "deep.yaml").write_text("[" * 5000 + "]" * 5000)
    cases = {
        str(tmp_path): "is a folder",
        str(tmp_path / "missing.yaml"): "not found",
        "/dev/null": "not a regular file",
        str(tmp_path / "latin1.yaml"): "not UTF-8",
        str(tmp_path / "list.yaml"): "expected a mapping of sections",
        str(tmp_path / "deep.yaml"): "not valid YAML",
    }
    for path, message in cases.items():
        one_line(capsys, train_main(["--config", path, "--print-config"]), message)


def test_mtp_depth_past_the_init_length_builds_and_runs_the_model():
    # Init traces the model on 8 tokens: depth 9 used to fail there (TypeError in concatenate).
    config = load_config(TINY, [*SMALL, "model.mtp_num_layers=9"]).model
    params = abstract_variables(config)
    assert len([k for k in params["params"] if k.startswith("mtp_")]) == 9
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    logits, mtp = jax.eval_shape(lambda v, t: Transformer(config).apply(v, t, mutable=["moe_stats"])[0], params, tokens)
    assert logits.shape == (2, 32, config.vocab_size) and len(mtp) == 9
    x = jnp.arange(1, 6)[None]
    expected = {2: [3, 4, 5, 0, 0], 5: [0] * 5, 7: [0] * 5}  # x[t + k], zero past the end
    for k, want in expected.items():
        assert shift_left(x, k).tolist() == [want]


# ----------------------------------------------------------------------------- Python API


def test_load_config_takes_none_and_one_override_string():
    assert load_config(None) == load_config()
    assert load_config(TINY, "train.steps=5").train.steps == 5
    assert load_config(TINY, None) == load_config(TINY)
    for files, overrides, message in [
        (5, (), "expected a path or a list of paths"),
        (b"configs/tiny.yaml", (), "expected a path or a list of paths"),
        (TINY, 5, "expected a list of 'section.key=value' strings"),
        (TINY, [5], "not of the form section.key=value"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(files, overrides)


@pytest.mark.parametrize(
    "devices, message",
    [
        (["x"], "'x' is not a jax device"),
        ([], "give at least one jax device"),
        ("cpu", "expected a list of jax devices"),
        (5, "expected a list of jax devices"),
        ("twice", "appears more than once"),
    ],
)
def test_trainer_refuses_bad_devices_before_touching_run_dir(devices, message, tmp_path):
    config = load_config(TINY, [*SMALL, f"run.dir={tmp_path / 'run'}"])
    devices = jax.devices()[:1] * 2 if devices == "twice" else devices
    with pytest.raises(UserError, match=message):
        maxmoe.Trainer(config, devices=devices)
    with pytest.raises(UserError, match="expected a maxmoe Config"):
        maxmoe.Trainer(TINY)
    assert not (tmp_path / "run").exists()


def test_host_device_count_is_bounded():
    for count in (MAX_CPU_DEVICES + 1, "8", 2.0):
        with pytest.raises(UserError, match="host device count"):
            maxmoe.set_host_device_count(count)


# ----------------------------------------------------------------------------- XLA flags


@pytest.mark.smoke  # reads XLA's own flag parser, which each jaxlib may word differently
def test_extra_flags_are_checked_against_the_installed_jaxlib():
    xla_flags.check_extra_flags(["--xla_backend_optimization_level=0"])  # known and readable: passes
    for flags, message in [
        (["--xla_gpu_enable_latency_hiding_scheduler=maybe"], "cannot read this value"),
        (["--xla_gpu_enable_command_buffer=BOGUS"], "--xla_gpu_enable_command_buffer=BOGUS: the installed jaxlib"),
        (["--xla_backend_optimization_level=0", "--xla_no_such_flag_for_maxmoe=1"], "not a flag of the installed"),
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            xla_flags.check_extra_flags(flags)
        assert "\n" not in str(error.value)


def test_unknown_extra_flag_stops_training_before_the_backend_in_one_line(tmp_path):
    # Its own process: in this one the backend is up, and XLA reads its flags only at start-up.
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "maxmoe.train", "--config", TINY, *SMALL, f"run.dir={run_dir}"]
        + ["xla.extra_flags=[--xla_gpu_enable_latency_hidng_scheduler=true]"],
        capture_output=True,
        text=True,
        env=job_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "did you mean --xla_gpu_enable_latency_hiding_scheduler?" in result.stderr
    assert not run_dir.exists()


# ----------------------------------------------------------------------------- data prepare


def _damaged_gzip(path: Path) -> None:
    """A .jsonl.gz whose deflate stream breaks half-way (zlib.error, not a short file)."""
    data = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(20000)))
    for offset in range(len(data) // 2, len(data) - 16):
        damaged = bytearray(data)
        damaged[offset] ^= 0x55
        try:
            zlib.decompress(bytes(damaged), wbits=31)
        except zlib.error:
            path.write_bytes(bytes(damaged))
            return
    raise AssertionError("no damaging byte found")


def test_prepare_bad_inputs(tmp_path, capsys):
    (tmp_path / "ok.txt").write_text("hello")
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    _damaged_gzip(tmp_path / "damaged.jsonl.gz")
    (tmp_path / "a_file").write_text("x")
    ok = ["--input", str(tmp_path / "ok.txt")]
    cases = [
        (["--input", str(tmp_path / "deep.jsonl")], "deep.jsonl:1: JSON nested too deeply"),
        (["--input", str(tmp_path / "damaged.jsonl.gz")], "not a readable gzip file"),
        ([*ok, "--out", str(tmp_path / "a_file" / "tokens")], "a_file is a file, not a folder"),
        ([*ok, "--out", str(tmp_path / "a_file")], "is a file; choose a new folder"),
        ([*ok, "--out", str(tmp_path)], "already exists"),
        ([*ok, "--eval-fraction", "nan"], "--eval-fraction nan"),
        ([*ok, "--eval-fraction", "1"], "--eval-fraction 1.0"),
        ([*ok, "--workers", "100000"], "--workers 100000"),
        (["--input", str(tmp_path)], "is a folder; give a glob"),
        ([*ok, "--tokenizer", str(tmp_path)], "expected 'byte' or the path of a tokenizer.json"),
        ([*ok, "--tokenizer", str(tmp_path / "ok.txt")], "cannot load it"),
        ([*ok, "--workers", "x"], "invalid int value"),
    ]
    if Path("/proc").is_dir():
        cases.append(([*ok, "--out", "/proc/maxmoe-tokens"], "--out /proc/maxmoe-tokens: cannot create a folder"))
    for extra, message in cases:
        out = ["--out", str(tmp_path / "tokens")] if "--out" not in extra else []
        one_line(capsys, data_main(["prepare", "--workers", "1", *out, *extra]), message)
        assert not (tmp_path / "tokens").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch folder left


def test_sigterm_during_prepare_removes_the_unfinished_folder(tmp_path, monkeypatch, capsys):
    (tmp_path / "in").mkdir()
    for i in range(4):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i} " * 50)
    real = prepare_module.read_documents

    def read_then_terminated(path, text_key):
        yield from real(path, text_key)
        if path.endswith("1.txt"):  # two documents are in the scratch file: the signal lands mid-write
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(prepare_module, "read_documents", read_then_terminated)
    before = signal.getsignal(signal.SIGTERM)
    status = data_main(["prepare", "--input", str(tmp_path / "in" / "*.txt"), "--out", str(tmp_path / "tokens")])
    assert status == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "maxmoe: stopped by SIGTERM; nothing was written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no .tokens.tmp-* folder
    assert signal.getsignal(signal.SIGTERM) is before


# ----------------------------------------------------------------------------- convert


def _hf_copy(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(FIXTURE, folder)
    return folder


def test_convert_bad_inputs(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    index_cases = {
        "int": {"weight_map": {"model.norm.weight": 5}},
        "outside": {"weight_map": {"model.norm.weight": "../other/model.safetensors"}},
        "list": {"weight_map": ["model.safetensors"]},
    }
    for name, index in index_cases.items():
        folder = _hf_copy(tmp_path, f"index_{name}")
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        out = tmp_path / f"out_{name}"
        one_line(capsys, convert_main(["from-hf", "--hf-dir", str(folder), "--out", str(out)]), "weight_map")
        assert not out.exists()
    cases = [
        (["to-hf", "--checkpoint", str(tmp_path), "--shard-gb", "nan"], "--shard-gb nan"),
        (["to-hf", "--checkpoint", str(tmp_path), "--shard-gb", "inf"], "--shard-gb inf"),
        (["to-hf", "--checkpoint", str(tmp_path), "--shard-gb", "-1"], "--shard-gb -1.0"),
        (["to-hf", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "a_file" / "x")], "is a file, not a folder"),
        (["from-hf", "--hf-dir", str(FIXTURE), "--out", str(tmp_path / "a_file" / "x")], "is a file, not a folder"),
        (["from-hf", "--hf-dir", str(FIXTURE), "--out", str(tmp_path / "a_file")], "is a file; choose a new folder"),
        (["from-hf", "--hf-dir", str(tmp_path / "a_file")], "no such folder"),
        (["to-hf", "--checkpoint", str(tmp_path / "a_file")], "no such folder"),
    ]
    if Path("/proc").is_dir():
        cases.append((["to-hf", "--checkpoint", str(tmp_path), "--out", "/proc/maxmoe-hf"], "cannot create a folder"))
    for argv, message in cases:
        out = [] if "--out" in argv else ["--out", str(tmp_path / "hf")]
        one_line(capsys, convert_main([*argv, *out]), message)
        assert not (tmp_path / "hf").exists()


def _full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_from_hf_on_a_full_disk_keeps_nothing_and_the_rerun_goes_through(tmp_path, monkeypatch, capsys):
    out = tmp_path / "ckpt"
    real_save = hf.save_params

    def save_half_then_fail(folder, *args, **kwargs):
        # What orbax leaves when the disk fills: a temporary step folder, and tensorstore's message.
        (Path(folder) / "checkpoints" / "0.orbax-checkpoint-tmp").mkdir(parents=True)
        raise ValueError("RESOURCE_EXHAUSTED: Error writing ...: No space left on device [os_error_code='28']")

    monkeypatch.setattr(hf, "save_params", save_half_then_fail)
    one_line(capsys, convert_main(["from-hf", "--hf-dir", str(FIXTURE), "--out", str(out)]), "No space left on device")
    assert not out.exists()
    out.mkdir()  # an empty folder given as --out is emptied again, not removed
    one_line(capsys, convert_main(["from-hf", "--hf-dir", str(FIXTURE), "--out", str(out)]), "No space left on device")
    assert out.is_dir() and not any(out.iterdir())
    monkeypatch.setattr(hf, "save_params", real_save)
    assert convert_main(["from-hf", "--hf-dir", str(FIXTURE), "--out", str(out)]) == 0  # not refused
    assert (out / "config.yaml").is_file()


def test_to_hf_on_a_full_disk_keeps_nothing(tmp_path, monkeypatch):
    model, variables = hf.import_hf(FIXTURE)
    real_write = hf_export.write_safetensors
    calls = []

    def write_one_then_fail(path, *args):
        calls.append(path.name)
        if len(calls) > 1:
            path.write_bytes(b"partial")
            _full_disk()
        return real_write(path, *args)

    monkeypatch.setattr(hf_export, "write_safetensors", write_one_then_fail)
    out = tmp_path / "hf"
    with pytest.raises(UserError, match=r"cannot write .*hf \(No space left on device\); nothing was kept"):
        hf_export.export_hf(model, variables, out, shard_bytes=1 << 16)  # several shards: one written, one not
    assert len(calls) == 2 and not out.exists()


# ----------------------------------------------------------------------------- generate, info, report, sweep


def test_generate_run_from_another_directory_names_tokenizer(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    config = load_config(TINY, ["data.source=shards", "data.path=data/corpus"])  # relative to where it trained
    (run / "config.yaml").write_text(config.to_yaml())
    monkeypatch.chdir(tmp_path)
    one_line(capsys, generate_main(["--run", str(run), "--prompt", "x"]), "data.path=data/corpus", "--tokenizer")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-new-tokens", "-1"], "max_new_tokens=-1"),
        (["--temperature", "nan"], "temperature=nan"),
        (["--temperature", "inf"], "temperature=inf"),
        (["--top-p", "nan"], "top_p=nan"),
        (["--top-k", "-2"], "top_k=-2"),
        (["--seed", "-1"], "--seed -1"),
        (["--seed", str(2**32)], f"--seed {2**32}"),
        (["--tokenizer", "/nonexistent/tokenizer.json"], "--tokenizer /nonexistent/tokenizer.json"),
        (["--dtype", "int8"], "invalid choice"),
    ],
)
def test_generate_flags(argv, message, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(TINY).to_yaml())
    one_line(capsys, generate_main(["--run", str(run), "--prompt", "x", *argv]), message)


def test_generate_folders(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    for argv, message in [
        (["--run", str(tmp_path / "missing")], "no such folder"),
        (["--run", str(tmp_path / "a_file")], "no such folder"),
        (["--run", str(tmp_path)], "not a training run folder"),
        (["--checkpoint", str(tmp_path), "--tokenizer", "byte"], "no complete checkpoint step"),
    ]:
        one_line(capsys, generate_main([*argv, "--prompt", "x"]), message)


def test_info_platform_and_report_inputs(tmp_path, capsys):
    one_line(capsys, info_main(["--config", TINY, "--platform", "garbage"]), "--platform", "invalid choice")
    one_line(capsys, info_main(["--config", TINY, "model.hidden_size=-1"]), "model.hidden_size=-1")
    run = tmp_path / "run"
    run.mkdir()
    one_line(capsys, report_main([str(tmp_path / "missing")]), "no such run folder")
    one_line(capsys, report_main([str(run)]), "metrics.jsonl not found")
    (run / "metrics.jsonl").write_bytes(b"\xff\xfe not utf-8\n")
    one_line(capsys, report_main([str(run)]), "holds no metrics records")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    one_line(capsys, report_main([str(run)]), "metrics.jsonl", "is a folder")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--devices", "0"], "--devices 0"),
        (["--devices", str(MAX_CPU_DEVICES + 1), "--dry-run"], f"--devices {MAX_CPU_DEVICES + 1}"),
        (["--hbm-gb", "nan"], "--hbm-gb"),
        (["--hbm-gb", "inf"], "--hbm-gb"),
        (["--pipeline", "x"], "--pipeline 'x'"),
        (["--mesh", "data=2,bogus=1"], "--mesh"),
        (["--dry-run"], "--dry-run needs --devices N"),
        (["--json", "/proc/maxmoe/sweep.json", "--devices", "1"], "--json /proc/maxmoe/sweep.json"),
        (["--plot", "/proc/maxmoe/sweep.png", "--devices", "1"], "--plot /proc/maxmoe/sweep.png"),
    ],
)
def test_sweep_arguments(argv, message, capsys):
    one_line(capsys, sweep_main(["--config", TINY, *argv]), message)


def test_generate_takes_a_prompt_that_is_not_utf8_as_its_bytes(tmp_path, monkeypatch, capsysbinary):
    # argv holds undecodable bytes as surrogates (it was a UnicodeEncodeError); a byte-level model
    # continues the bytes themselves. The model is stubbed: this is about the prompt's way in and out.
    config = load_config(TINY)
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    monkeypatch.setattr(generate_module, "load_pretrained", lambda folder, dtype, compute_dtype: (config, {}))
    monkeypatch.setattr(generate_module, "checkpoint_step", lambda folder, args: str(folder))
    seen = []
    monkeypatch.setattr(generate_module, "generate", lambda model, variables, ids, **kw: seen.append(ids) or [ord("c")])
    assert generate_main(["--run", str(tmp_path), "--prompt", os.fsdecode(b"\xffab"), "--max-new-tokens", "1"]) == 0
    assert seen == [[0xFF, ord("a"), ord("b")]]
    assert capsysbinary.readouterr().out == b"\xffabc\n"


def test_python_api_inputs_of_generate_and_report(tmp_path):
    model = load_config(TINY).model
    variables = {"params": {}, "router": {}}
    for prompt in ("abc", [1.5], [True], b"ab"):
        with pytest.raises(UserError, match="must be token ids"):
            generate(model, variables, prompt)
    with pytest.raises(UserError, match="variables: expected"):
        generate(model, {}, [1, 2])
    with pytest.raises(UserError, match="the prompt must be text"):
        generate_text(model, variables, 5)
    for source in (5, [1, 2]):
        with pytest.raises(UserError, match="expected a run folder, a Trainer or a list of metrics records"):
            figure(source)
    with pytest.raises(UserError, match="not supported"):
        write_report([{"step": 1, "loss": 2.0}], tmp_path / "report.xyz")
