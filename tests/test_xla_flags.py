"""XLA flag profiles: composition and precedence, and every GPU flag accepted by this jaxlib."""

import os
import subprocess
import sys

import jax
import pytest

from maxmoe import xla_flags
from maxmoe.config import XLA_PROFILES, ConfigError, UserError, load_config

# A tiny jit: XLA parses XLA_FLAGS when the backend starts and aborts on an unknown flag
# or a value it cannot parse, so exit status 0 means every flag was accepted.
_TINY_JIT = "import jax, jax.numpy as jnp; assert float(jax.jit(lambda x: 2 * x)(jnp.ones(3)).sum()) == 6.0"


def _start_xla(flags: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-c", _TINY_JIT], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_every_gpu_profile_flag_is_accepted_by_xla():
    # One process per profile, all at once; plus a bogus flag proving the method can fail.
    runs = {name: _start_xla(xla_flags.profile_flags(name)) for name in XLA_PROFILES}
    runs["(bogus flag)"] = _start_xla(["--xla_gpu_no_such_flag_for_maxmoe=true"])
    results = {name: (proc.wait(timeout=120), proc.stdout.read()) for name, proc in runs.items()}
    for name in XLA_PROFILES:
        code, output = results[name]
        assert code == 0, f"profile {name}: XLA rejected its flags:\n{output[-2000:]}"
    code, output = results["(bogus flag)"]
    assert code != 0 and "Unknown flag" in output


@pytest.mark.parametrize("name", XLA_PROFILES)
def test_profiles_are_documented_and_unique(name):
    pairs = xla_flags.describe(name)
    assert pairs and all(reason.strip() for _, reason in pairs)
    names = [xla_flags.flag_name(flag) for flag, _ in pairs]
    assert len(names) == len(set(names))
    assert "xla_gpu_enable_latency_hiding_scheduler" in names
    assert all(flag.startswith("--xla_gpu_") for flag, _ in pairs)


def test_nvl72_profiles_take_larger_combine_thresholds():
    def threshold(name):
        flag = next(f for f in xla_flags.profile_flags(name) if "all_gather_combine_threshold" in f)
        return int(flag.split("=")[1])

    assert threshold("gb200") > threshold("b200") and threshold("gb300") > threshold("h200") > threshold("h100")
    assert any("parallel_collective_overlap_limit" in f for f in xla_flags.profile_flags("gb300"))
    assert not any("parallel_collective_overlap_limit" in f for f in xla_flags.profile_flags("h100"))


def test_none_adds_nothing():
    assert xla_flags.profile_flags("none") == []
    assert xla_flags.compose("", "none", []) == ""
    assert xla_flags.compose(" --xla_dump_to=/tmp/x ", "none", []) == "--xla_dump_to=/tmp/x"
    assert xla_flags.compose("", "auto", []) == ""  # conftest: JAX_PLATFORMS=cpu, so auto is none


def test_compose_adds_profile_to_unrelated_user_flags():
    composed = xla_flags.compose("--xla_force_host_platform_device_count=8", "h100", []).split()
    assert composed[0] == "--xla_force_host_platform_device_count=8"
    assert composed[1:] == xla_flags.profile_flags("h100")


def test_user_flags_win_over_profile_and_extra():
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_enable_command_buffer=FUSION"
    composed = xla_flags.compose(user, "gb300", ["--xla_gpu_enable_command_buffer=", "--xla_dump_to=/tmp/d"]).split()
    by_name = {}
    for flag in composed:
        by_name.setdefault(xla_flags.flag_name(flag), []).append(flag)
    assert by_name["xla_gpu_enable_latency_hiding_scheduler"] == ["--xla_gpu_enable_latency_hiding_scheduler=false"]
    assert by_name["xla_gpu_enable_command_buffer"] == ["--xla_gpu_enable_command_buffer=FUSION"]
    assert by_name["xla_dump_to"] == ["--xla_dump_to=/tmp/d"]
    assert composed[:2] == user.split()  # the user's string is kept verbatim, first


def test_extra_flags_win_over_profile():
    composed = xla_flags.compose("", "h200", ["--xla_gpu_all_gather_combine_threshold_bytes=1"]).split()
    gathers = [f for f in composed if xla_flags.flag_name(f) == "xla_gpu_all_gather_combine_threshold_bytes"]
    assert gathers == ["--xla_gpu_all_gather_combine_threshold_bytes=1"]
    assert len(composed) == len(xla_flags.profile_flags("h200")) + 0  # replaced, not appended


def test_absl_no_prefix_counts_as_the_same_flag():
    composed = xla_flags.compose("--noxla_gpu_enable_pipelined_all_gather", "h100", []).split()
    assert not any(f.startswith("--xla_gpu_enable_pipelined_all_gather") for f in composed)


def test_bad_extra_flag_is_a_config_error():
    with pytest.raises(ConfigError, match="xla.extra_flags"):
        xla_flags.compose("", "none", ["xla_gpu_foo=1"])


@pytest.mark.parametrize(
    "kind, profile",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H800", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA GB200", "gb200"),
        ("NVIDIA GB300", "gb300"),
        ("cpu", "none"),
        ("", "none"),
    ],
)
def test_auto_picks_by_device_kind(kind, profile):
    assert xla_flags.resolve_profile("auto", kind) == profile


def test_auto_warns_on_unknown_gpu():
    with pytest.warns(UserWarning, match="no XLA flag profile"):
        assert xla_flags.resolve_profile("auto", "NVIDIA GH200 480GB") == "none"


def test_auto_without_nvidia_smi_is_none(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(xla_flags.shutil, "which", lambda _: None)
    assert xla_flags.detect_gpu_name() is None
    assert xla_flags.resolve_profile("auto") == "none"


def test_auto_reads_nvidia_smi(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA GB300'\necho 'NVIDIA GB300'\n")
    fake.chmod(0o755)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert xla_flags.detect_gpu_name() == "NVIDIA GB300"
    assert xla_flags.resolve_profile("auto") == "gb300"
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # a CPU-only run never asks the driver
    assert xla_flags.resolve_profile("auto") == "none"


def test_apply_sets_environment_before_backend(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    monkeypatch.setattr(xla_flags, "backends_initialised", lambda: False)
    config = load_config([], ["xla.profile=b200", "xla.extra_flags=[--xla_dump_to=/tmp/dump]"])
    flags = xla_flags.apply(config)
    assert os.environ["XLA_FLAGS"].split() == flags
    assert flags[0] == "--xla_gpu_enable_command_buffer=FUSION" and flags[1] == "--xla_dump_to=/tmp/dump"
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags


def test_apply_after_backend_start_is_an_error_unless_nothing_changes(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    jax.devices()  # the test session's backend is up
    assert xla_flags.backends_initialised()
    with pytest.raises(UserError, match="before JAX starts its backends"):
        xla_flags.apply(load_config([], ["xla.profile=h100"]))
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert xla_flags.apply(load_config([], ["xla.profile=none"])) == ["--xla_force_host_platform_device_count=8"]


def test_write_effective(tmp_path):
    flags = xla_flags.profile_flags("gb300")
    path = xla_flags.write_effective(tmp_path / "run", flags)
    assert path == tmp_path / "run" / "xla_flags.txt"
    assert path.read_text().splitlines() == flags


def test_memory_fraction_from_config_environment_wins(tmp_path, monkeypatch):
    config = load_config([], ["xla.memory_fraction=0.9"])
    assert xla_flags.memory_fraction(config, {}) == "0.9"
    assert xla_flags.memory_fraction(config, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}) == ".5"
    assert xla_flags.memory_fraction(load_config([], ["xla.memory_fraction=0"]), {}) is None
    with pytest.raises(UserError, match="xla.memory_fraction=1.5"):
        load_config([], ["xla.memory_fraction=1.5"])
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.8")
    xla_flags.write_effective(tmp_path, [])
    assert (tmp_path / "allocator.env").read_text() == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.8\n"
