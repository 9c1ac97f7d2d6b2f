"""Checkpoints on orbax's CheckpointManager: asynchronous, atomic, resumable on any mesh.

A checkpoint step folder holds `state` (params, optimizer state, router biases, step and
counters), `data` (the data iterator's position, JSON) and `config` (the resolved
config, JSON). Orbax writes each step into a temporary folder and renames it when
complete, so a half-written step is never picked up. Arrays are restored straight into
the shardings of the current mesh, whatever mesh wrote them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from maxmoe.config import Config, UserError


class Checkpointer:
    """Saves every `checkpoint.every` steps (and when forced), restores the latest complete step."""

    def __init__(self, config: Config, run_dir: Path, *, is_main: bool):
        self.config = config
        self.directory = (Path(run_dir) / "checkpoints").absolute()
        self.is_main = is_main
        self._manager = None

    def _open(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            c = self.config.checkpoint
            options = ocp.CheckpointManagerOptions(
                max_to_keep=c.keep, keep_period=c.keep_every or None, create=True,
                enable_async_checkpointing=c.async_save)
            self._manager = ocp.CheckpointManager(self.directory, options=options)
        return self._manager

    def check_start(self) -> None:
        """Refuse to start over a non-empty run.dir when resume is off; nothing is deleted."""
        run_dir = self.directory.parent
        if self.config.checkpoint.resume or not run_dir.exists():
            return
        if any(run_dir.iterdir()):
            raise UserError(f"run.dir {run_dir} is not empty and checkpoint.resume=false; "
                            f"choose a new run.dir or set checkpoint.resume=true")

    def latest_step(self) -> int | None:
        if not self.directory.exists():
            return None
        return self._open().latest_step()

    def restore_latest(self, abstract_state: Any):
        """(state, data_state) from the latest complete step, or None when there is none."""
        if not self.config.checkpoint.resume:
            return None
        step = self.latest_step()
        if step is None:
            return None
        import orbax.checkpoint as ocp

        try:
            restored = self._open().restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        except (ValueError, KeyError, FileNotFoundError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot restore checkpoint step {step} from {self.directory}: {first}") from None
        return restored["state"], restored["data"]

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        """Start an asynchronous save when the interval says so or `force`; returns whether it did."""
        every = self.config.checkpoint.every
        if not force and not (every and step % every == 0):
            return False
        import orbax.checkpoint as ocp

        manager = self._open()
        if manager.latest_step() == step:
            return False
        return manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(self.config.to_dict())), force=True)

    def wait(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None


def load_params(path: str, abstract_state: Any) -> dict:
    """Parameters and router biases only (for converted weights), placed on the current mesh."""
    import orbax.checkpoint as ocp

    folder = Path(path).absolute()
    if not folder.exists():
        raise UserError(f"checkpoint.init_from={path}: no such folder")
    manager = ocp.CheckpointManager(folder / "checkpoints" if (folder / "checkpoints").exists() else folder)
    step = manager.latest_step()
    if step is None:
        raise UserError(f"checkpoint.init_from={path}: no complete checkpoint step found")
    target = {"params": abstract_state.params, "router": abstract_state.router}
    try:
        restored = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=target, partial_restore=True)))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"checkpoint.init_from={path}: {str(e).splitlines()[0]}") from None
    return {"params": restored["state"]["params"], "router": restored["state"]["router"]}


def save_params(folder: str | Path, params: Any, router: Any, config: Config, step: int = 0) -> Path:
    """Write parameters and router biases as a checkpoint that `checkpoint.init_from` accepts."""
    import orbax.checkpoint as ocp

    directory = Path(folder).absolute() / "checkpoints"
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True)) as manager:
        manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "router": router}),
            config=ocp.args.JsonSave(config.to_dict())))
        manager.wait_until_finished()
    return directory
