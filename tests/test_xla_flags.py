"""XLA flag profiles: composition and precedence, every GPU flag accepted by this jaxlib and
named in the DebugOptions of every supported jaxlib."""

import os
import re
import subprocess
import sys
from pathlib import Path

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


# Expert-axis sizes that select different ragged all-to-all flags: HGX nodes hold at most 8
# ranks; NVL72 racks up to 64, past the one-shot kernel's 32.
EXPERT_SIZES = {"h100": (8,), "h200": (8,), "b200": (8,), "gb200": (8, 64), "gb300": (8, 64)}
DEBUG_OPTIONS = Path(__file__).parent / "fixtures" / "xla_debug_options"


@pytest.mark.smoke
def test_every_gpu_profile_flag_is_accepted_by_xla():
    # One process per profile and expert size, all at once, with the flags for the running
    # jaxlib (CI runs this under 0.10.2 and, as smoke, the newest jax); plus a bogus flag
    # proving the method can fail.
    runs = {
        (name, size): _start_xla(xla_flags.profile_flags(name, expert_size=size))
        for name, sizes in EXPERT_SIZES.items()
        for size in sizes
    }
    runs["(bogus flag)"] = _start_xla(["--xla_gpu_no_such_flag_for_maxmoe=true"])
    results = {key: (proc.wait(timeout=120), proc.stdout.read()) for key, proc in runs.items()}
    for key, (code, output) in results.items():
        if key != "(bogus flag)":
            assert code == 0, f"profile {key}: XLA rejected its flags:\n{output[-2000:]}"
    code, output = results["(bogus flag)"]
    assert code != 0 and "Unknown flag" in output


def supported_jaxlibs():
    """{version tuple: DebugOptions field names}, from the lists made for each supported jaxlib."""
    out = {}
    for path in sorted(DEBUG_OPTIONS.glob("jaxlib-*.txt")):
        version = tuple(int(p) for p in re.findall(r"\d+", path.stem))
        out[version] = set(path.read_text().split())
    return out


def test_every_profile_flag_is_a_debug_option_of_every_supported_jaxlib():
    # Stricter than acceptance, which is all a process can check, and only for its own
    # jaxlib: XLA also accepts a few old names as deprecated aliases, which are no fields.
    jaxlibs = supported_jaxlibs()
    assert {v[:3] for v in jaxlibs} >= {(0, 10, 2), (0, 11, 2), (0, 12, 0)}
    assert xla_flags.jaxlib_version() in jaxlibs  # the running jaxlib has its list too
    for version, fields in jaxlibs.items():
        for name, sizes in EXPERT_SIZES.items():
            for size in sizes + (1,):
                for flag in xla_flags.profile_flags(name, expert_size=size, jaxlib=version):
                    assert xla_flags.flag_name(flag) in fields, (version, name, size, flag)
    # The check can fail: jaxlib 0.10's pipelining booleans are no fields from 0.11 on.
    assert "xla_gpu_enable_pipelined_all_gather" in jaxlibs[(0, 10, 2)]
    assert "xla_gpu_enable_pipelined_all_gather" not in jaxlibs[(0, 11, 2)]


def test_ragged_all_to_all_transport_by_expert_size_and_jaxlib():
    def names(size, version):
        return {xla_flags.flag_name(f) for f in xla_flags.profile_flags("gb300", expert_size=size, jaxlib=version)}

    one_shot = "xla_gpu_experimental_ragged_all_to_all_use_barrier_with_nccl"
    device_kernel = "xla_gpu_experimental_ragged_all_to_all_use_device_kernel"
    for version in ((0, 10, 2), (0, 11, 2), (0, 12, 0, 1)):
        assert one_shot in names(32, version) and device_kernel not in names(32, version)
        assert one_shot not in names(64, version)
    assert device_kernel in names(64, (0, 11, 2)) and device_kernel not in names(64, (0, 10, 2))
    assert xla_flags.transport_warning(64, (0, 10, 2)) and not xla_flags.transport_warning(64, (0, 11, 2))
    assert not xla_flags.transport_warning(32, (0, 10, 2))


def test_apply_warns_when_no_transport_fits(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(xla_flags, "backends_initialised", lambda: False)
    monkeypatch.setattr(xla_flags, "jaxlib_version", lambda: (0, 10, 2))
    overrides = ["xla.profile=gb300", "mesh.expert=64", "model.num_experts=64", "train.batch_size=64"]
    config = load_config([], overrides)
    with pytest.warns(UserWarning, match="mesh.expert=64"):
        flags = xla_flags.apply(config)
    assert "--xla_gpu_enable_pipelined_all_gather=true" in flags  # the 0.10 names for a 0.10 jaxlib


@pytest.mark.parametrize("name", XLA_PROFILES)
@pytest.mark.parametrize("expert_size", [1, 64])
def test_profiles_are_documented_and_unique(name, expert_size):
    pairs = xla_flags.describe(name, expert_size)
    assert pairs and all(reason.strip() for _, reason in pairs)
    names = [xla_flags.flag_name(flag) for flag, _ in pairs]
    assert len(names) == len(set(names))
    assert "xla_gpu_enable_latency_hiding_scheduler" in names
    assert all(flag.startswith("--xla_") for flag, _ in pairs)


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
    composed = xla_flags.compose("--noxla_gpu_enable_latency_hiding_scheduler", "h100", []).split()
    assert not any(f.startswith("--xla_gpu_enable_latency_hiding_scheduler") for f in composed)


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
