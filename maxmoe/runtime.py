"""Process setup before the backend starts: host device count, XLA flags, jax.distributed, cache.

XLA reads its flags and JAX fixes the CPU device count when the first backend starts, and
`jax.distributed` must connect before that: entry points call one of these from main() before
any jax computation.

  setup(config)          a training job: run.cpu_devices host devices, the config's XLA flag
                         profile, jax.distributed, the compilation cache
  set_host_device_count  N host CPU devices, nothing else (lowering for another platform)
  use_cpu_devices        N fake CPU devices and the CPU backend only (dry runs, CPU benchmarks)
  use_compile_cache      jax's persistent compilation cache (run.compile_cache)

docs/ARCHITECTURE.md, "Process setup", has why the order matters.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache

from maxmoe import distributed, xla_flags
from maxmoe.cli import backend_failure, check_xla_flags_environment
from maxmoe.config import MAX_CPU_DEVICES, Config, UserError

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
COMPILE_CACHE_MAX_BYTES = 10 * 10**9  # least recently used programs go first past this
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_cache_hits = 0
_listening = False


def _cpu_device_count() -> int | None:
    """This process's CPU devices, once a backend is up; None when there is no CPU backend."""
    try:
        return len(jax.local_devices(backend="cpu"))
    except RuntimeError:
        return None


def set_host_device_count(count: int) -> None:
    """Ask the CPU backend for `count` devices (0: leave as is); must run before jax starts a backend.

    Once JAX has started, the count is fixed: asking for the count it has is fine, asking
    for another is a UserError (JAX would ignore it and the mesh would not fit).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count > MAX_CPU_DEVICES:
        raise UserError(f"host device count {count!r}: expected an integer up to {MAX_CPU_DEVICES} (0: leave as is)")
    if count <= 0:
        return
    if xla_flags.backends_initialised():
        current = _cpu_device_count()
        if current is not None and current != count:
            fewer = f" (for fewer, leave it at 0 and pass devices=jax.devices()[:{count}])" if count < current else ""
            raise UserError(
                f"run.cpu_devices={count} comes too late: JAX has already started its CPU backend with {current} "
                f"device(s), a count fixed for the life of the process; set it before any jax computation "
                f"(in a notebook: restart the kernel and call maxmoe.set_host_device_count({count}) first){fewer}"
            )
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_COUNT_FLAG}={count}"])
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except (AttributeError, RuntimeError):
        pass  # older jax reads the XLA flag above


def check_inputs(config: Config, devices) -> list | None:
    """A Trainer's arguments checked: `config` a Config, `devices` distinct jax devices or None (all).

    Returns the devices as a list (or None). Checked before the backend starts or a run.dir
    is claimed, so `Trainer(config, devices=["x"])` is one clear UserError, not a failure
    deep inside the mesh.
    """
    if not isinstance(config, Config):
        raise UserError(f"config: expected a maxmoe Config (maxmoe.load_config(...)), got {type(config).__name__}")
    if devices is None:
        return None
    if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
        raise UserError(f"devices={devices!r}: expected a list of jax devices (e.g. jax.devices()[:4])")
    devices = list(devices)
    bad = next((d for d in devices if not isinstance(d, jax.Device)), None)
    if bad is not None:
        raise UserError(f"devices: {bad!r} is not a jax device (expected e.g. jax.devices()[:4])")
    if not devices:
        raise UserError("devices=[]: give at least one jax device, or None for all of them")
    if len({(d.platform, d.id) for d in devices}) != len(devices):
        raise UserError("devices: a device appears more than once")
    return devices


def use_cpu_devices(count: int, *, force: bool = True) -> None:
    """`count` host CPU devices and only the CPU backend, whatever accelerators the host has.

    With `force=False` a platform named in JAX_PLATFORMS wins (a script meant for fake CPU
    devices that may also be pointed at real ones).
    """
    set_host_device_count(count)
    if force or "JAX_PLATFORMS" not in os.environ:
        jax.config.update("jax_platforms", "cpu")


def setup(config: Config, *, distributed_init: bool = True) -> list[str]:
    """Set up this process for `config`: host devices, XLA flags, then jax.distributed.

    Returns the effective XLA flags (see `maxmoe.xla_flags.apply`). `distributed_init=False`
    skips jax.distributed (single-process tools that run beside a launcher's environment).
    The backend starts last: one jax cannot start (JAX_PLATFORMS=cuda on a CPU machine) is a
    UserError line.
    """
    if not xla_flags.backends_initialised():
        check_xla_flags_environment()  # XLA would abort on a word that is not a flag
    set_host_device_count(config.run.cpu_devices)
    use_compile_cache(config.run.compile_cache)
    flags = xla_flags.apply(config)
    if distributed_init:
        distributed.initialize(config.dist)
    try:
        jax.devices()
    except (RuntimeError, AssertionError) as e:
        line = backend_failure(e)
        if line is None:
            raise
        raise UserError(line) from None
    return flags


def compile_cache_dir(setting: str = "auto") -> Path | None:
    """The persistent compilation cache's folder for a `run.compile_cache` value; None when it is off.

    `auto`: $JAX_COMPILATION_CACHE_DIR when set, else `maxmoe/jax` under the user cache folder
    ($XDG_CACHE_HOME, default ~/.cache); `none`: off (as is JAX_ENABLE_COMPILATION_CACHE=false with
    `auto`); anything else names the folder.
    """
    if setting == "none":
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    if os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "maxmoe" / "jax"


def use_compile_cache(setting: str = "auto") -> Path | None:
    """Turn jax's persistent compilation cache on in `compile_cache_dir(setting)` (or off); its folder.

    A second run of the same program (same XLA flags, jax and jaxlib) loads it instead of
    compiling; programs that compile in under a second are not kept. The cache keeps up to
    COMPILE_CACHE_MAX_BYTES ($JAX_COMPILATION_CACHE_MAX_SIZE wins), dropping the least recently
    used (a limit needs the `filelock` package; without it the cache is unbounded).
    """
    global _listening
    path = compile_cache_dir(setting)
    if not _listening:
        jax.monitoring.register_event_listener(_count_cache_hit)
        _listening = True
    wanted = {"jax_enable_compilation_cache": path is not None}
    if path is not None:
        wanted["jax_compilation_cache_dir"] = str(path)
        if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ and _has_filelock():
            wanted["jax_compilation_cache_max_size"] = COMPILE_CACHE_MAX_BYTES
    if any(getattr(jax.config, name) != value for name, value in wanted.items()):
        compilation_cache.reset_cache()  # jax opens its cache once: one opened earlier (a notebook) is let go
        for name, value in wanted.items():
            jax.config.update(name, value)
    if path is not None and jax.config.jax_compilation_cache_max_size != -1:  # jax's size limit is on
        _adopt_orphans(path)
    return path


def _adopt_orphans(path: Path) -> None:
    """Give each cached program without its access-time file one, dated now.

    jax's size-limited cache reads every entry's access time before it adds one, and adds
    nothing while one is missing; a process killed between writing a program and its access
    time (or one writing without a size limit) leaves such an entry.
    """
    try:
        for entry in path.glob("*-cache"):
            atime = entry.with_name(entry.name.removesuffix("-cache") + "-atime")
            if not atime.exists():
                atime.write_bytes(time.time_ns().to_bytes(8, "little"))
    except OSError:
        pass  # an unreadable cache folder: jax says so when it uses it


def _has_filelock() -> bool:
    try:
        import filelock  # noqa: F401 - jax's size-bounded cache locks its folder with it
    except ImportError:
        return False
    return True


def _count_cache_hit(event: str, **_) -> None:
    global _cache_hits
    if event == _CACHE_HIT_EVENT:
        _cache_hits += 1


def compile_cache_hits() -> int:
    """Programs this process has loaded from the persistent compilation cache so far."""
    return _cache_hits
