"""Checkpoints on orbax's CheckpointManager: asynchronous, atomic, resumable on any mesh.

    run.dir/checkpoints/<step>/state    params, optimizer state, router biases, step, counters
                              /data     the data iterator's position (JSON)
                              /config   the resolved config (JSON)
                              /digest   each array's digest, the newest proven step (JSON)

Orbax writes `<step>.orbax-checkpoint-tmp` and renames it when every item is complete, so a
step cut short is never read. Arrays are restored straight into the current mesh's shardings;
layer stacks are stored in model order (maxmoe.training.stage_state), so pipeline and
non-pipeline runs resume each other. A stored tree that does not fit this config's state (another
model), cannot be read, or whose arrays' digests differ (damaged; maxmoe.training.integrity)
stops the job with one line naming the step folder (and the newest step that passes); nothing
is deleted. `checkpoint.keep` never deletes the newest proven step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shlex
import sys
import threading
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec
from orbax.checkpoint import checkpoint_managers, checkpoint_utils

from maxmoe.config import Config, ConfigError, ModelConfig, UserError, build_model_config
from maxmoe.model.transformer import abstract_variables
from maxmoe.training import stage_state
from maxmoe.training import step as step_lib
from maxmoe.training.integrity import KeepProven, Proof, first_difference, leaf_paths, state_digest
from maxmoe.training.optim import make_optimizer
from maxmoe.training.preemption import hold
from maxmoe.training.resume import check_init_from, check_resume, optimizer_hint
from maxmoe.training.run_dir import LOCK_NAME

STEP_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's in-progress step folders
CHUNK_AXES = ("layers", "expert")  # logical axes stored one index per chunk


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore_latest` returns: the step folder's number, state and data position."""

    step: int
    state: Any
    data: dict


def _handlers(*names: str) -> dict:
    kinds = {
        "state": ocp.StandardCheckpointHandler,
        "params": ocp.PyTreeCheckpointHandler,
        "data": ocp.JsonCheckpointHandler,
        "config": ocp.JsonCheckpointHandler,
        "digest": ocp.JsonCheckpointHandler,
    }
    # "params" reads the state item with the handler that can restore part of a tree.
    return {("state" if name == "params" else name): kinds[name]() for name in names}


class _MainThreadOnly:
    """A stderr that drops writes from other threads.

    When a read fails, orbax gives up on it while tensorstore's I/O threads still hold
    callbacks for the other reads; they later find orbax's event loop closed and print
    tracebacks from their own threads. The user should see our one line only.
    """

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        if threading.current_thread() is threading.main_thread():
            return self.stream.write(text)
        return len(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


class _DropBackgroundErrors(logging.Filter):
    """Drops error records that orbax's background save threads log: the failure reaches the
    main thread through `wait_until_finished` and is reported there once, as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or threading.current_thread() is threading.main_thread()


_BACKGROUND_ERRORS = _DropBackgroundErrors()


class _DropOrphanedTasks(logging.Filter):
    """After a failed save (already reported): drops asyncio's "Task exception was never
    retrieved" records, the same failure once more from each of orbax's abandoned write tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Task exception was never retrieved")


_ORPHANED_TASKS = _DropOrphanedTasks()


@contextlib.contextmanager
def _quiet_orbax():
    """Hold back orbax's absl error logs while reading: a step that cannot be read becomes our one line.

    On a failed read, stderr keeps dropping other threads' writes for the rest of the process.
    """
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.CRITICAL)
    stderr = sys.stderr
    sys.stderr = _MainThreadOnly(stderr)
    try:
        yield
    finally:
        absl_logger.setLevel(level)
    sys.stderr = stderr  # reached only when the read succeeded


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


def _model_differences(saved_config: Any, config: Config) -> str:
    """' (model.hidden_size: 128 there, 64 here; ...)' from the configs, or ''."""
    if not isinstance(saved_config, dict) or not isinstance(saved_config.get("model"), dict):
        return ""
    here, there = config.to_dict()["model"], saved_config["model"]
    diffs = [
        f"model.{k}: {there.get(k)!r} there, {here.get(k)!r} here"
        for k in sorted(set(here) | set(there))
        if there.get(k) != here.get(k)
    ]
    return f" ({'; '.join(diffs[:4])}{'; ...' if len(diffs) > 4 else ''})" if diffs else ""


def check_fits(stored_tree: Any, target_tree: Any, where: str, hint: str = "", *, exact: bool = False) -> None:
    """UserError unless every array of `target_tree` is in `stored_tree` with the same shape.

    With `exact`, arrays of `stored_tree` that `target_tree` lacks (a model with fewer parts:
    no MTP, fewer layers) are an error too; without it they are left unread.
    """
    stored, target = leaf_paths(stored_tree), leaf_paths(target_tree)
    missing = [p for p in target if p not in stored]
    if missing:
        raise UserError(
            f"{where} does not fit this model: it has no {missing[0]}"
            f"{f' (and {len(missing) - 1} more arrays)' if len(missing) > 1 else ''}{hint}"
        )
    # Parameters first: they say more than their optimizer moments.
    extra = (
        sorted((p for p in stored if p not in target), key=lambda p: (not p.startswith("params"), p)) if exact else []
    )
    if extra:
        raise UserError(
            f"{where} does not fit this model: it has {extra[0]}"
            f"{f' (and {len(extra) - 1} more arrays)' if len(extra) > 1 else ''}, which this model lacks{hint}"
        )
    for path, leaf in target.items():
        shape = tuple(getattr(stored[path], "shape", None) or ())
        if shape != tuple(leaf.shape):
            raise UserError(
                f"{where} does not fit this model: {path} has shape {shape} there, {tuple(leaf.shape)} here{hint}"
            )


def chunked_save_args(boxed_tree: Any) -> Any:
    """ocp.SaveArgs per array of a logically-boxed tree: stored one layer (and one expert) per chunk.

    Stacked arrays split on their CHUNK_AXES, so a reader that wants one expert's matrix (the
    Hugging Face export) decodes that matrix and nothing else; other arrays keep orbax's chunks.
    """
    specs = nn.get_partition_spec(boxed_tree)
    return jax.tree.map(
        lambda spec: ocp.SaveArgs(shard_axes=tuple(i for i, name in enumerate(spec or ()) if name in CHUNK_AXES)),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec) or x is None,
    )


class Checkpointer:
    """Saves every `checkpoint.every` steps (and when forced), restores the latest complete step.

    Every process calls every method (orbax coordinates the processes); only orbax writes.
    """

    def __init__(self, config: Config, run_dir: Path):
        self.config = config
        self.directory = (Path(run_dir) / "checkpoints").absolute()
        self._manager = None
        self._chunking = None  # save arguments per array, made at the first save
        self._failed = False  # a write failed and was reported
        self.changes: list[str] = []  # config changes a resume accepted (checkpoint.allow_config_change)
        self.proof = Proof()  # the newest proven step, kept through deletions

    def _open(self):
        if self._manager is None:
            c = self.config.checkpoint
            policies = [checkpoint_managers.LatestN(c.keep), KeepProven(self.proof)]
            if c.keep_every:
                policies.append(checkpoint_managers.EveryNSteps(c.keep_every))
            options = ocp.CheckpointManagerOptions(
                preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
                create=True,
                enable_async_checkpointing=c.async_save,
            )
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=_handlers("state", "data", "config", "digest")
            )
            logging.getLogger("absl").addFilter(_BACKGROUND_ERRORS)
        return self._manager

    def check_start(self) -> None:
        """Refuse to start over a non-empty run.dir when resume is off; nothing is deleted."""
        run_dir = self.directory.parent
        if self.config.checkpoint.resume or not run_dir.exists():
            return
        if any(p.name != LOCK_NAME for p in run_dir.iterdir()):
            raise UserError(
                f"run.dir {run_dir} is not empty and checkpoint.resume=false; "
                f"choose a new run.dir or set checkpoint.resume=true"
            )

    def latest_step(self) -> int | None:
        """The newest complete step folder (in-progress `*.orbax-checkpoint-tmp` folders never count)."""
        if not self.directory.is_dir():
            return None
        with _quiet_orbax():
            return self._open().latest_step()

    def saved_config(self) -> tuple[int, dict] | None:
        """(the latest complete step, the config saved with it), or None: resume off, no step, or unreadable
        (restore_latest then says why). Read before the programs are built: a continued run's
        learning-rate schedule depends on it (maxmoe.training.optim.continued_schedule)."""
        if not self.config.checkpoint.resume:
            return None
        step = self.latest_step()
        if step is None:
            return None
        with _quiet_orbax():
            try:
                saved = self._open().restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
            except Exception:  # noqa: BLE001 - restore_latest reports an unreadable step
                return None
        return (step, saved) if isinstance(saved, dict) else None

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """The latest complete step restored into `abstract_state`'s shardings, or None when there is none.

        A step that does not fit this model or cannot be read is a UserError (not a fallback
        to an older step: the user decides which checkpoint to trust).
        """
        if not self.config.checkpoint.resume:
            return None
        stage_abstract, abstract_state = abstract_state, stage_state.model_order_abstract(self.config, abstract_state)
        step = self.latest_step()
        if step is None:
            return None
        where = f"checkpoint {self.directory / str(step)}"
        manager = self._open()
        with _quiet_orbax():
            try:
                metadata = manager.item_metadata(step)
                saved_config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
            except Exception as e:  # noqa: BLE001 - any unreadable file means the same thing to the user
                raise UserError(
                    f"{where} cannot be read ({_first_line(e)}){self._older(step, abstract_state)}"
                ) from None
            stored_state = metadata.get("state") if metadata is not None else None
            if stored_state is None or not (self.directory / str(step) / "data").is_dir():
                raise UserError(
                    f"{where} is not a maxmoe training checkpoint (no state or data item)"
                    f"{self._older(step, abstract_state)}"
                )
            check_init_from(saved_config, self.config, self.directory.parent, step)
            stored_tree = getattr(stored_state, "tree", stored_state)
            model_hint = _model_differences(saved_config, self.config)
            if not model_hint:  # the parameters fit: a mismatch is in the optimizer's state
                stored_params = {"params": stored_tree.get("params")} if isinstance(stored_tree, dict) else {}
                check_fits(stored_params, {"params": abstract_state.params}, where, exact=True)
                model_hint = optimizer_hint(saved_config, self.config)
            check_fits(stored_tree, abstract_state, where, model_hint, exact=True)
            # Arrays that fit can still belong to another run: another seed, router, batch or data.
            self.changes = check_resume(saved_config, self.config, self.directory.parent, step)
            try:
                restored = self._restore_checked(manager, step, abstract_state)
            except Exception as e:  # noqa: BLE001 - see above
                raise UserError(
                    f"{where} cannot be read ({_first_line(e)}){self._older(step, abstract_state)}"
                ) from None
            damaged = first_difference((restored.get("digest") or {}).get("arrays"), restored["state"])
            if damaged:
                raise UserError(
                    f"{where} is damaged: {damaged} is not the array that was saved (its digest differs)"
                    f"{self._older(step, abstract_state)}"
                )
        self.proof.steps.update(self.complete_steps())
        self.proof.inherit(restored.get("digest"))
        state = stage_state.to_stage_order(self.config, restored["state"], stage_abstract)
        return Restored(step=step, state=state, data=restored["data"])

    def _restore_checked(self, manager: Any, step: int, abstract_state: Any) -> dict:
        """A step's state and data position, with its digest record when it has one."""
        items = {"state": ocp.args.StandardRestore(abstract_state), "data": ocp.args.JsonRestore()}
        if (self.directory / str(step) / "digest").is_dir():  # steps saved before digests have none
            items["digest"] = ocp.args.JsonRestore()
        return dict(manager.restore(step, args=ocp.args.Composite(**items)))

    def _older(self, step: int, abstract_state: Any) -> str:
        """'; step N passes its check: move step M away to resume from it ...': the newest step
        before `step` that restores and matches its digest (each tried in turn, newest first)."""
        manager = self._open()
        for older in reversed([s for s in self.complete_steps() if s < step]):
            try:
                restored = self._restore_checked(manager, older, abstract_state)
            except Exception:  # noqa: BLE001 - that one cannot be read either: try the one before
                continue
            if not first_difference((restored.get("digest") or {}).get("arrays"), restored["state"]):
                return (
                    f"; step {older} passes its check: move step folder {step} away to resume from it "
                    f"(nothing was deleted)"
                )
        return "; no step before it passes its check: use a new run.dir (nothing was deleted)"

    def complete_steps(self) -> list[int]:
        """The step folders on disk that a resume would accept (from the names: no orbax call)."""
        if not self.directory.is_dir():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and p.is_dir())

    @contextlib.contextmanager
    def _writing(self):
        """A failed write (disk full, a read-only or immutable folder) as one UserError line.

        A save runs in the background, so its failure shows at the next save or wait, and the
        error's path names the step. Every step folder that was complete before stays as it
        was; orbax leaves the failed one as a temporary folder, which a resume never reads.
        """
        absl_logger = logging.getLogger("absl")
        level = absl_logger.level
        absl_logger.setLevel(logging.CRITICAL)  # orbax logs the failure with its traceback first
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any failed write means the same thing to the user
            self._failed = True
            if not isinstance(sys.stderr, _MainThreadOnly):  # tensorstore's threads still report, later
                sys.stderr = _MainThreadOnly(sys.stderr)
            logging.getLogger("asyncio").addFilter(_ORPHANED_TASKS)
            done = self.complete_steps()
            kept = f"the last complete checkpoint, step {done[-1]}, stands" if done else "no complete checkpoint yet"
            raise UserError(f"cannot write a checkpoint in {self.directory} ({_first_line(e)}); {kept}") from None
        finally:
            absl_logger.setLevel(level)

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        """Start an asynchronous save when the interval says so or `force`; returns whether it did.

        Returns once the arrays are copied off the device (the state may then be donated);
        the files are written in the background and the step folder appears when complete.
        A save that fails (now or in the background) is a UserError at this or the next call.
        """
        every = self.config.checkpoint.every
        if not force and not (every and step % every == 0):
            return False
        with self._writing():
            manager = self._open()
            if manager.latest_step() == step:
                return False  # already saved (or being saved) at this step
            return self._start_save(manager, step, state, data_state)

    def _start_save(self, manager: Any, step: int, state: Any, data_state: dict) -> bool:
        stored = stage_state.to_model_order(self.config, state)
        self.proof.steps.add(step)
        return manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(stored, save_args=self._save_args()),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(self.config.to_dict()),
                digest=ocp.args.JsonSave({"arrays": state_digest(stored), "proven": self.proof.proven}),
            ),
            force=True,
        )

    def _save_args(self) -> Any:
        if self._chunking is None:
            boxed = step_lib.abstract_state(self.config, make_optimizer(self.config.train), boxed=True)
            self._chunking = chunked_save_args(boxed)
        return self._chunking

    def wait(self) -> None:
        """Block until every started save is complete on disk (UserError if one failed)."""
        if self._manager is not None:
            with self._writing():
                self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the saves in flight, then let go of the folder (a failure already reported is not raised again)."""
        if self._manager is not None:
            hold("checkpoint-close")
            manager, self._manager = self._manager, None
            reported = self._failed
            try:
                with self._writing():
                    manager.wait_until_finished()
            except UserError:
                if not reported:
                    raise
            finally:
                with contextlib.suppress(Exception):
                    manager.close()
            logging.getLogger("absl").removeFilter(_BACKGROUND_ERRORS)


@contextlib.contextmanager
def latest_step_of(path: str | Path, label: str, *items: str):
    """(manager, step, where) of the latest complete step under `path`, read-only, orbax kept quiet.

    `path` is a run.dir, its checkpoints/ or a `save_params` folder; `label` is how the user
    named it (`checkpoint.init_from=X`, `--checkpoint X`) and starts every error. `items` are
    the handlers to register ("params" reads the state item in part). Closed on exit.
    """
    folder = Path(path).expanduser().absolute()
    if not folder.is_dir():
        raise UserError(f"{label}: no such folder")
    directory = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
    with _quiet_orbax():  # read_only makes orbax warn about the options it turns off
        manager = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(read_only=True), item_handlers=_handlers(*items)
        )
    try:
        with _quiet_orbax():
            step = manager.latest_step()
        if step is None:
            hf = (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
            hint = (
                f"; it holds a Hugging Face model: convert it first, python -m maxmoe.convert from-hf --hf-dir "
                f"{shlex.quote(str(path))} --out OUT, and name OUT"
                if hf
                else ""
            )
            raise UserError(f"{label}: no complete checkpoint step in {directory}{hint}")
        yield manager, step, f"{label} (step {step})"
    finally:
        manager.close()


def stored_arrays(manager: Any, step: int, where: str) -> Any:
    """The tree of array metadata (shape, dtype) of a step's state item; UserError if unreadable."""
    with _quiet_orbax():
        try:
            metadata = manager.item_metadata(step)
            stored = metadata.get("state") if metadata is not None else None
        except Exception as e:  # noqa: BLE001 - any unreadable file means the same thing to the user
            raise UserError(f"{where} cannot be read ({_first_line(e)})") from None
    if stored is None:
        raise UserError(f"{where}: not a maxmoe checkpoint (no state item)")
    return getattr(stored, "tree", stored)


def saved_model_config(manager: Any, step: int, where: str) -> ModelConfig:
    """The model of the config saved with a step (needs the "config" handler)."""
    with _quiet_orbax():
        try:
            raw = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        except Exception as e:  # noqa: BLE001 - see above
            raise UserError(f"{where}: cannot read its config ({_first_line(e)})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise UserError(f"{where}: its saved config has no model section")
    try:
        return build_model_config(raw["model"])
    except ConfigError as e:
        raise UserError(f"{where}: its saved model config is not valid here ({e})") from None


def load_params(path: str, abstract_state: Any, label: str = "", config: Config | None = None) -> dict:
    """{'params', 'router'} from the latest step under `path` (a run.dir, its checkpoints/ or a
    `save_params` folder), placed on the shardings of `abstract_state` (the current mesh).

    Errors start with `label` (default `checkpoint.init_from=<path>`). With `config`, the layer
    stack is laid out for its pipeline stages (abstract_state's layout).
    """
    label = label or f"checkpoint.init_from={path}"
    stage_target = {"params": abstract_state.params, "router": abstract_state.router}
    target = stage_target if config is None else stage_state.model_order_abstract(config, stage_target)
    with latest_step_of(path, label, "params", "config", "digest") as (manager, step, where):
        check_fits(stored_arrays(manager, step, where), target, where)
        items = {
            "state": ocp.args.PyTreeRestore(
                item=target, restore_args=checkpoint_utils.construct_restore_args(target), partial_restore=True
            )
        }
        if (Path(manager.directory) / str(step) / "digest").is_dir():  # a training step: its digests are checked
            items["digest"] = ocp.args.JsonRestore()
        with _quiet_orbax():
            try:
                restored = manager.restore(step, args=ocp.args.Composite(**items))
            except Exception as e:  # noqa: BLE001 - any unreadable file means the same thing to the user
                raise UserError(f"{where} cannot be read ({_first_line(e)})") from None
    loaded = {"params": restored["state"]["params"], "router": restored["state"]["router"]}
    damaged = first_difference((restored.get("digest") or {}).get("arrays"), loaded)
    if damaged:
        raise UserError(f"{where} is damaged: {damaged} is not the array that was saved (its digest differs)")
    return loaded if config is None else stage_state.to_stage_order(config, loaded, stage_target)


def save_params(folder: str | Path, params: Any, router: Any, config: Config, step: int = 0) -> Path:
    """Write parameters and router biases as a checkpoint that `checkpoint.init_from` accepts."""
    directory = Path(folder).absolute() / "checkpoints"
    boxed = abstract_variables(config.model, boxed=True)
    save_args = chunked_save_args({"params": boxed["params"], "router": boxed.get("router", {})})
    with ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(create=True), item_handlers=_handlers("state", "config")
    ) as manager:
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "router": router}, save_args=save_args),
                config=ocp.args.JsonSave(config.to_dict()),
            ),
        )
        manager.wait_until_finished()
    return directory
