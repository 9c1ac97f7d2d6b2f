"""Every shipped config parses; bad input is one named, located error; files and overrides merge in order."""

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from maxmoe.config import (
    ATTENTION_IMPLEMENTATIONS,
    DISPATCH_STRATEGIES,
    GROUPED_MATMUL_BACKENDS,
    XLA_PROFILES,
    Config,
    ConfigError,
    ModelConfig,
    load_config,
)
from maxmoe.parallel.dispatch import EXPERT_WEIGHT_AXES
from maxmoe.parallel.names import MESH_AXES

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_configs_folder_is_not_empty():
    names = {p.name for p in CONFIGS}
    assert {"tiny.yaml", "deepseek_v3_671b.yaml"} <= names


@pytest.mark.smoke
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    # mesh_* (a cluster) and context_ext_* (a training stage) are overlays: they parse on top of
    # the model they were made for.
    base = [str(REPO / "configs/deepseek_v3_671b.yaml")] if path.name.startswith(("mesh_", "context_ext_")) else []
    config = load_config(base + [str(path)])
    assert isinstance(config, Config)
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), f"{path.name} must start with a comment saying what it is for"


def test_shipped_values_arrive():
    tiny = load_config([str(REPO / "configs/tiny.yaml")])
    assert tiny.model.hidden_size == 64 and tiny.model.num_experts == 8 and tiny.train.seq_len == 128
    big = load_config([str(REPO / "configs/deepseek_v3_671b.yaml")])
    m = big.model
    assert (m.hidden_size, m.num_layers, m.num_experts, m.experts_per_token) == (7168, 61, 256, 8)
    assert isinstance(m.rope_theta, float) and m.rope_theta == 10000.0  # YAML int coerced to float
    # Pre-training at 4K with plain RoPE; YaRN (the release's rope_scaling) with the context extension.
    assert (m.rope_scaling, m.max_position_embeddings, big.train.seq_len) == ("none", 4096, 4096)
    configs = [str(REPO / "configs" / name) for name in ("deepseek_v3_671b.yaml", "mesh_256_gb300.yaml")]
    extended = load_config(configs + [str(REPO / "configs/context_ext_yarn.yaml")])
    e = extended.model
    assert (e.rope_scaling, e.rope_factor, e.rope_original_max_position, e.max_position_embeddings) == (
        "yarn",
        40.0,
        4096,
        163840,
    )
    assert (extended.train.seq_len, extended.train.lr, extended.moe.bias_update_rate) == (32768, 7.3e-6, 0.001)
    assert (big.moe.bias_update_rate, big.moe.seq_aux_alpha) == (0.001, 0.0001)  # DeepSeek-V3's own values


def test_defaults_without_files():
    assert load_config().model == ModelConfig()


def error_of(files=(), overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(list(files), list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_override_key_names_the_nearest_key():
    message = error_of(overrides=["model.hiden=3"])
    assert "model.hiden" in message and "'model.hidden_size'" in message


def test_unknown_key_in_yaml_names_the_nearest_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  stepz: 3\n")
    message = error_of([path])
    assert "train.stepz" in message and "'train.steps'" in message


def test_unknown_section():
    message = error_of(overrides=["modle.hidden_size=3"])
    assert "modle.hidden_size" in message and "model.hidden_size" in message


@pytest.mark.parametrize(
    "override,fragments",
    [
        ("model.hidden_size=abc", ["model.hidden_size", "abc", "integer"]),
        ("model.hidden_size=1.5", ["model.hidden_size", "1.5", "integer"]),
        ("model.norm_topk_prob=yes please", ["model.norm_topk_prob", "yes please", "true or false"]),
        ("train.lr=fast", ["train.lr", "fast", "number"]),
        ("model.hidden_size=0", ["model.hidden_size", "0", "> 0"]),
        ("model.num_shared_experts=-1", ["model.num_shared_experts", "-1", ">= 0"]),
        ("train.lr=-0.1", ["train.lr", "-0.1", "> 0"]),
        ("model.score_func=relu", ["model.score_func", "relu", "sigmoid", "softmax"]),
        ("model.compute_dtype=float16", ["model.compute_dtype", "float16", "bfloat16", "float32"]),
        ("mesh.rules=3", ["mesh.rules", "3"]),
    ],
)
def test_bad_values_name_key_and_value(override, fragments):
    message = error_of(overrides=[override])
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize(
    "overrides,fragments",
    [
        (["model.num_heads=4", "mesh.tensor=3"], ["model.num_heads=4", "mesh.tensor=3"]),
        (["model.num_experts=8", "mesh.expert=3"], ["model.num_experts=8", "mesh.expert=3"]),
        (
            ["train.batch_size=12", "mesh.data=2", "mesh.expert=4", "model.num_experts=8"],
            ["train.batch_size=12", "mesh.data", "mesh.expert"],
        ),
        (["train.batch_size=12", "mesh.data=8"], ["train.batch_size=12", "mesh.data"]),
        (["model.first_k_dense=4", "model.num_layers=3"], ["model.first_k_dense=4", "model.num_layers=3"]),
        (["model.num_experts=8", "model.num_expert_groups=3"], ["model.num_experts=8", "model.num_expert_groups=3"]),
        (["model.topk_groups=5", "model.num_expert_groups=4"], ["model.topk_groups=5", "model.num_expert_groups=4"]),
        (["model.qk_rope_head_dim=7"], ["model.qk_rope_head_dim=7"]),
        (["mesh.data=-1", "mesh.expert=-1"], ["mesh.data", "mesh.expert", "-1"]),
        (["train.seq_len=512"], ["train.seq_len=512", "model.max_position_embeddings=256"]),
        (["run.dir="], ["run.dir is empty"]),
        (["run.dir=  "], ["run.dir is empty"]),
        # dist.* keys are never silently ignored: an address makes the launch explicit and needs the rest.
        (["dist.coordinator_address=10.0.0.1:1234"], ["dist.coordinator_address", "dist.num_processes", "process_id"]),
        (["dist.num_processes=2", "dist.process_id=0"], ["dist.num_processes", "needs dist.coordinator_address"]),
        (["dist.mode=none", "dist.process_id=1"], ["dist.mode=none ignores dist.process_id"]),
        (["dist.mode=explicit", "dist.num_processes=2"], ["dist.mode=explicit", "dist.coordinator_address"]),
        (
            ["dist.coordinator_address=h:1", "dist.num_processes=2", "dist.process_id=2"],
            ["dist.process_id=2", "0..1"],
        ),
    ],
)
def test_cross_field_checks(overrides, fragments):
    message = error_of(overrides=overrides)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_valid_mesh_divisibility_passes():
    config = load_config(
        [], ["model.num_heads=4", "mesh.tensor=2", "mesh.expert=4", "mesh.data=2", "train.batch_size=16"]
    )
    assert (config.mesh.data, config.mesh.expert, config.mesh.tensor) == (2, 4, 2)


def test_merge_order_files_then_overrides(tmp_path):
    first = tmp_path / "a.yaml"
    second = tmp_path / "b.yaml"
    first.write_text("model:\n  hidden_size: 32\n  num_heads: 2\ntrain:\n  lr: 0.5\n")
    second.write_text("model:\n  hidden_size: 48\ntrain:\n  steps: 7\n")
    merged = load_config([str(first), str(second)])
    assert merged.model.hidden_size == 48  # later file wins
    assert merged.model.num_heads == 2  # earlier file's keys survive
    assert merged.train.lr == 0.5 and merged.train.steps == 7
    assert merged.model.vocab_size == ModelConfig().vocab_size  # untouched: default
    reversed_ = load_config([str(second), str(first)])
    assert reversed_.model.hidden_size == 32
    overridden = load_config([str(first), str(second)], ["model.hidden_size=96", "train.steps=9"])
    assert overridden.model.hidden_size == 96 and overridden.train.steps == 9
    # Later overrides of the same key win too.
    assert load_config([str(first)], ["model.hidden_size=8", "model.hidden_size=16"]).model.hidden_size == 16


def test_override_values_are_typed():
    config = load_config(
        [],
        [
            "train.lr=0.001",
            "model.norm_topk_prob=false",
            "run.profile_steps=[3, 5]",
            "train.warmup_steps=0",
            "model.rope_theta=50000",
        ],
    )
    assert config.train.lr == pytest.approx(1e-3) and isinstance(config.train.lr, float)
    assert config.model.norm_topk_prob is False
    assert config.run.profile_steps == [3, 5]
    assert config.model.rope_theta == 50000.0 and isinstance(config.model.rope_theta, float)


@pytest.mark.parametrize("text", ["1e-3", "3e-4", "1E-3"])
def test_float_in_exponent_notation_without_a_dot_is_a_number(text, tmp_path):
    """PyYAML (YAML 1.1) reads `1e-3` as a string; a float key must still accept it."""
    assert load_config([], [f"train.lr={text}"]).train.lr == pytest.approx(float(text))
    path = tmp_path / "lr.yaml"
    path.write_text(f"train:\n  lr: {text}\n")
    assert load_config([str(path)]).train.lr == pytest.approx(float(text))


def test_missing_file_and_bad_yaml(tmp_path):
    assert "nope.yaml" in error_of([tmp_path / "nope.yaml"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hidden_size: [1,\n")
    assert "bad.yaml" in error_of([bad])


def test_unreadable_and_non_utf8_config_files(tmp_path, monkeypatch):
    latin = tmp_path / "latin.yaml"
    text = "train:\n  lr: 0.1  # caf\xe9\n".encode("latin-1")
    latin.write_bytes(text)
    assert error_of([latin]) == f"config file {latin}: not UTF-8 text (byte {text.index(0xE9)})"
    locked = tmp_path / "locked.yaml"
    locked.write_text("train:\n  lr: 0.1\n")
    if os.geteuid() == 0:  # root reads any file whatever its mode: make the read fail as it would
        real = Path.read_bytes

        def refuse(path, *args, **kwargs):
            if path == locked:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *args, **kwargs)

        monkeypatch.setattr(Path, "read_bytes", refuse)
    else:
        locked.chmod(0)
    assert error_of([locked]) == f"config file {locked}: cannot read it (Permission denied)"


def test_an_address_alone_with_its_count_and_id_is_an_explicit_launch():
    dist = load_config([], ["dist.coordinator_address=h:1", "dist.num_processes=2", "dist.process_id=1"]).dist
    assert (dist.mode, dist.coordinator_address, dist.num_processes, dist.process_id) == ("auto", "h:1", 2, 1)


def test_config_is_frozen():
    config = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model.hidden_size = 3  # type: ignore[misc]


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "maxmoe.info", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.smoke
def test_cli_bad_key_is_one_line_exit_2():
    result = run_cli("--config", "configs/tiny.yaml", "model.hiden=3")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("maxmoe: error:")
    assert "model.hidden_size" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "args,fragment",
    [
        (("--config", "configs/missing.yaml"), "configs/missing.yaml"),
        (("--config", "configs/tiny.yaml", "model.hidden_size=abc"), "model.hidden_size"),
        (("--config", "configs/tiny.yaml", "--bogus-flag"), "--bogus-flag"),
    ],
)
def test_cli_other_bad_input_is_one_line_exit_2(args, fragment):
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("maxmoe: error:") and fragment in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def _spelled_out(names) -> re.Pattern:
    """The names as a literal sequence in source: "a", "b", ... (either quote, any spacing)."""
    return re.compile(r"\s*,\s*".join(f"[\"']{re.escape(name)}[\"']" for name in names))


@pytest.mark.parametrize(
    "names, home",
    [
        (MESH_AXES, "parallel/names.py"),
        (DISPATCH_STRATEGIES, "config/moe.py"),
        (GROUPED_MATMUL_BACKENDS, "config/moe.py"),
        (ATTENTION_IMPLEMENTATIONS, "config/model.py"),
        (XLA_PROFILES, "config/xla.py"),
        (EXPERT_WEIGHT_AXES["w_gate"], "parallel/dispatch.py"),
        (EXPERT_WEIGHT_AXES["w_down"], "parallel/dispatch.py"),
    ],
)
def test_shared_names_are_written_once(names, home):
    """Name lists other modules need are imported from one place, never spelled out again."""
    pattern = _spelled_out(names)
    package = REPO / "maxmoe"
    writers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if pattern.search(p.read_text()))
    assert writers == [home]


def _help_of(main, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_key_with_type_default_and_doc(capsys):
    from maxmoe import info, sweep, train

    for main in (train.main, info.main, sweep.main):
        text = _help_of(main, capsys)
        for section, cls in typing.get_type_hints(Config).items():
            for field in dataclasses.fields(cls):
                assert field.metadata["doc"], f"{section}.{field.name} has no doc"
                default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
                # "  section.key: type = default" and, on the next line, the doc.
                line = next(x for x in text.splitlines() if x.startswith(f"  {section}.{field.name}: "))
                assert yaml.safe_load(line.rsplit(" = ", 1)[1]) == default, line
                assert f"{line}\n      {field.metadata['doc']}\n" in text
    assert "  moe.dispatch: auto|ragged_a2a|allgather|capacity = auto\n" in text
    assert "  checkpoint.every: int >= 0 = 100\n" in text
    assert "  model.vocab_size: int > 0 or auto = 260\n" in text


def test_print_config_prints_the_resolved_yaml_and_exits(capsys, tmp_path):
    from maxmoe import train

    args = ["--config", str(REPO / "configs/tiny.yaml"), "model.vocab_size=auto", "train.steps=7", "--print-config"]
    with pytest.raises(SystemExit) as done:
        train.main(args + [f"run.dir={tmp_path / 'run'}"])
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = load_config([str(REPO / "configs/tiny.yaml")], ["train.steps=7", f"run.dir={tmp_path / 'run'}"])
    assert printed == expected.to_dict()  # auto resolved: the stdlib corpus has 260 tokens
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_run_config_of_an_earlier_version_reads_with_its_keys_translated(tmp_path):
    """A run's own config.yaml holds every key: one written before mesh.zero1_gather and
    mesh.zero1_reduce still loads where maxmoe reads it back (generate --run), the removed keys
    meaning what they meant; given by a user, the same file is refused naming the replacement."""
    path = tmp_path / "config.yaml"
    path.write_text(
        "mesh:\n  across_domains: zero1\n  gather_once: true\n  reduce_per_layer: false\n  sum_per_layer: true\n"
    )
    mesh = load_config(path, stored=True).mesh
    assert (mesh.zero1_gather, mesh.zero1_reduce) == ("per_step", "per_step")
    with pytest.raises(ConfigError, match="mesh.gather_once was removed; set mesh.zero1_gather=per_step instead"):
        load_config(path)
