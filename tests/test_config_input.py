"""A config means what its text says: text keys keep the text as written, duplicate keys and
values too large or too deep to be a config are refused in one line, `~` is expanded once,
and the Python API takes the values the command line takes (numpy scalars, paths).

Every case here loads a config in this process; none starts jax.
"""

import os
from pathlib import Path

import numpy as np
import pytest

from maxmoe.config import ConfigError, load_config
from maxmoe.training.resume import resume_changes

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def refused(files, overrides, *words: str) -> str:
    """The one-line ConfigError of loading `files` with `overrides`, checked to name `words`."""
    with pytest.raises(ConfigError) as error:
        load_config(files, overrides)
    message = str(error.value)
    assert "\n" not in message and len(message) < 400, message[:1000]
    for word in words:
        assert word in message, (word, message)
    return message


# --------------------------------------------------------------------------- text keys keep their text


@pytest.mark.parametrize("text", ["010", "1:20", "0x1F", "a # b", "1e3", "0o17", "2001-12-14", "null", "yes"])
def test_a_text_key_keeps_the_text_as_written(text, tmp_path):
    assert load_config(TINY, [f"run.dir={text}"]).run.dir == text
    assert load_config(TINY, [f"data.path={text}"]).data.path == text
    config = tmp_path / "c.yaml"
    if "#" not in text and text not in ("null",):  # in a file, `# b` is a comment and null is no value
        config.write_text(f"run:\n  dir: {text}\ndata:\n  text_key: {text}\n")
        loaded = load_config(config)
        assert (loaded.run.dir, loaded.data.text_key) == (text, text)


def test_numbers_are_read_as_written_not_as_yaml_1_1():
    assert load_config(TINY, ["train.steps=010"]).train.steps == 10  # decimal, not octal 8
    assert load_config(TINY, ["train.steps=0x10"]).train.steps == 16  # hex is explicit
    assert load_config(TINY, ["train.lr=1e-3"]).train.lr == 1e-3
    refused(TINY, ["train.steps=1:20"], "train.steps='1:20'", "expected an integer")  # not 80


def test_a_choice_that_reads_like_a_boolean_takes_the_boolean(tmp_path):
    for value in ("false", "true"):
        assert load_config(TINY, [f"moe.emulate_ragged_a2a={value}"]).moe.emulate_ragged_a2a == value
    assert load_config(TINY, {"moe.emulate_ragged_a2a": False}).moe.emulate_ragged_a2a == "false"
    (tmp_path / "c.yaml").write_text("moe:\n  emulate_ragged_a2a: true\n")
    assert load_config(tmp_path / "c.yaml").moe.emulate_ragged_a2a == "true"
    refused(TINY, {"run.dir": True}, "run.dir=True", "expected a string")  # no choice to read it as


def test_a_key_given_twice_in_a_file_is_refused(tmp_path):
    (tmp_path / "keys.yaml").write_text("train:\n  steps: 3\n  lr: 0.1\n  steps: 5\n")
    refused(tmp_path / "keys.yaml", (), "keys.yaml (line 4)", "train.steps is given twice")
    (tmp_path / "sections.yaml").write_text("train:\n  steps: 3\nrun:\n  dir: x\ntrain:\n  lr: 0.1\n")
    refused(tmp_path / "sections.yaml", (), "sections.yaml (line 5)", "section train is given twice")


# --------------------------------------------------------------------------- size, depth, huge numbers


def alias_bomb(levels: int) -> str:
    """A YAML list whose last element expands to 10**levels strings through anchors."""
    rows = ["&l0 [x, x, x, x, x, x, x, x, x, x]"]
    rows += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "[" + ", ".join(rows) + "]"


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path):
    (tmp_path / "bomb.yaml").write_text(f"xla:\n  extra_flags: {alias_bomb(6)}\n")
    refused(tmp_path / "bomb.yaml", (), "xla.extra_flags", "more than 100,000 values")
    (tmp_path / "bomb9.yaml").write_text(f"run:\n  profile_steps: {alias_bomb(9)}\n")
    refused(tmp_path / "bomb9.yaml", (), "run.profile_steps", "more than 100,000 values")
    refused(TINY, [f"run.profile_steps={alias_bomb(9)}"], "run.profile_steps", "more than 100,000 values")


def test_values_nested_too_deeply_are_one_line():
    refused(TINY, ["train.steps=" + "[" * 5000 + "]" * 5000], "train.steps", "nested too deeply")
    refused(TINY, ["run.profile_steps=" + "[" * 200 + "]" * 200], "run.profile_steps", "nested more than")
    deep = []
    for _ in range(5000):
        deep = [deep]
    refused(TINY, {"run.profile_steps": deep}, "run.profile_steps", "nested more than")
    loop = []
    loop.append(loop)
    refused(TINY, {"xla.extra_flags": loop}, "xla.extra_flags")


def test_integers_of_thousands_of_digits_are_out_of_range(tmp_path):
    digits = "1" + "0" * 5000
    refused(TINY, [f"train.steps={digits}"], "train.steps=", "out of range")
    refused(TINY, {"train.steps": 10**5000}, "train.steps=", "out of range")
    (tmp_path / "big.yaml").write_text(f"train:\n  steps: {digits}\n")
    refused(tmp_path / "big.yaml", (), "big.yaml", "out of range")


# --------------------------------------------------------------------------- paths: ~ once, everywhere


def test_home_in_a_path_is_expanded_once_in_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(TINY, ["run.dir=~/x", "data.path=~/corpus/*.txt", f"data.cache_dir={tmp_path}/c"])
    assert config.run.dir == str(tmp_path / "x")
    assert config.data.path == str(tmp_path / "corpus" / "*.txt")
    assert load_config(TINY, {"data.mixture": {"~/a": 1}}).data.mixture == {str(tmp_path / "a"): 1}
    assert load_config(TINY, ["run.dir=a~b"]).run.dir == "a~b"  # only a leading ~ names a home
    stored = load_config(TINY, ["data.path=x"]).to_dict()
    stored["data"]["path"] = "~/corpus/*.txt"  # a run stored before ~ was expanded in the config
    assert resume_changes(stored, config) == []
    refused(TINY, ["run.dir=~nosuchuser-maxmoe/x"], "run.dir=~nosuchuser-maxmoe/x", "no user")
    monkeypatch.setenv("HOME", "")
    refused(TINY, ["run.dir=~/x"], "run.dir=~/x", "HOME is empty")
    monkeypatch.delenv("HOME")
    refused(TINY, ["checkpoint.init_from=~/ckpt"], "checkpoint.init_from=~/ckpt", "HOME is not set")


# --------------------------------------------------------------------------- the Python API's values


def test_the_api_takes_numpy_scalars_and_paths(tmp_path):
    config = load_config(
        Path(TINY),
        {
            "train.steps": np.int64(7),
            "train.lr": np.float32(0.5),
            "run.tensorboard": np.bool_(False),
            "run.dir": tmp_path / "run",
            "mesh.data": np.int32(1),
        },
    )
    assert config.train.steps == 7 and type(config.train.steps) is int
    assert config.train.lr == 0.5 and type(config.train.lr) is float
    assert config.run.tensorboard is False and config.run.dir == str(tmp_path / "run")
    refused(TINY, {"train.steps": np.float64(2.5)}, "train.steps=2.5", "expected an integer")
    refused(TINY, {"train.steps": np.arange(3)}, "train.steps", "expected an integer")
    assert os.fspath(tmp_path) in load_config(TINY, {"data.path": tmp_path}).data.path
