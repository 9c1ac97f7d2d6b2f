"""SIGTERM, SIGINT and SIGHUP: save after the current step and stop; with several processes, the same step on all.

    stop = StopSignal(jax.process_count())
    with stop.installed():                    # handlers only while the loop runs
        ... after each step:  if stop.should_stop(step): save step; leave the loop

One process: handlers note the signal (SIGHUP is a SIGTERM), say so at once, and the loop stops
after the step in flight; a second Ctrl-C exits at once (130; a notebook: KeyboardInterrupt).
`installed()` nests, and puts back the handlers that were there. jax is imported on first use,
so the command line installs the handlers before jax starts (a signal then is not lost).
Several processes: JAX's preemption service (its C++ SIGTERM notifier) picks a step every process
reaches, where `multihost_utils.reached_preemption_sync_point` is true on all; no Python SIGTERM
handler is installed then, and SIGINT and SIGHUP are forwarded to this process as SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _preemption_service() -> bool:
    """Whether JAX's multi-process preemption service is running in this process."""
    import jax

    return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)


HOLD_ENV = "MAXMOE_HOLD"


def hold(point: str) -> None:
    """Wait at a named point of a run while MAXMOE_HOLD=point:FIFO says so, until FIFO is written to.

    Tests land a signal or change a file at an exact point this way (the writer's `open` returns
    once the run waits here); unset, this does nothing.
    """
    spec = os.environ.get(HOLD_ENV, "")
    for entry in spec.split(","):
        name, _, fifo = entry.partition(":")
        if name == point and fifo:
            with Path(fifo).open("rb") as held:
                held.read()


def interruptible(fn: Callable[[], Any]) -> Any:
    """fn() in a worker thread while this one waits: signal handlers (Python runs them in the main
    thread only, between bytecodes) run at once rather than when a long XLA call returns."""
    outcome = {}

    def work():
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=work, name="maxmoe-worker", daemon=True)
    worker.start()
    worker.join()  # interruptible: handlers run in this thread meanwhile
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _say(text: str) -> None:
    """A line on stderr from a signal handler (os.write: the stream may be in the middle of a write)."""
    try:
        os.write(2, f"{text}\n".encode())
    except OSError:
        pass


class StopSignal:
    """Turns SIGTERM/SIGINT/SIGHUP into "save and stop after this step", agreed across processes.

    `requested` names the reason once a stop is due; `clear()` forgets it once acted on.
    With `exit_on_second_interrupt` (the command line) a SIGINT while a stop is pending exits
    the process at once (status 130); otherwise it raises KeyboardInterrupt (a notebook).
    """

    def __init__(self, process_count: int = 1, *, exit_on_second_interrupt: bool = False):
        self.requested: str | None = None
        self.exit_on_second_interrupt = exit_on_second_interrupt
        self._seen = False  # a signal came and is not yet acted on
        self._depth = 0
        self._previous: dict = {}
        self.bind(process_count)

    def bind(self, process_count: int) -> StopSignal:
        """Set the process count once jax.distributed is up (a StopSignal may be made before); returns self."""
        self.process_count = process_count
        self.synced = process_count > 1 and _preemption_service()
        if self.synced:  # jax.distributed's notifier took SIGTERM over: never put another handler back
            self._previous.pop(signal.SIGTERM, None)
        return self

    def _handle(self, signum, frame):  # noqa: ARG002 - signal API
        name = signal.Signals(signum).name
        # Noted before anything is said: a signal that comes once the line is out (Python may run
        # its handler nested inside this one) must find this one already counted.
        first, self._seen = not self._seen, True
        if signum == signal.SIGINT and not first:
            if self.exit_on_second_interrupt:
                _say("maxmoe: SIGINT again: exiting now, without saving")
                os._exit(130)
            raise KeyboardInterrupt
        if first:
            _say(f"maxmoe: {name}: stopping; the step in progress is finished and saved first (Ctrl-C again: exit now)")
        if self.synced:  # JAX's notifier owns SIGTERM: hand the interrupt to it
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.requested = name

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignal]:
        """Handlers in place for the block; outside the main thread (no Python handlers there) a no-op."""
        if self._depth == 0 and threading.current_thread() is threading.main_thread():
            handled = (signal.SIGINT, signal.SIGHUP) if self.synced else (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
            self._previous = {sig: signal.signal(sig, self._handle) for sig in handled}
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                for sig, handler in self._previous.items():
                    # None: a handler not set from Python, which cannot be put back; the default is closest.
                    signal.signal(sig, signal.SIG_DFL if handler is None else handler)
                self._previous = {}

    def should_stop(self, step: int) -> bool:
        """Whether to save `step` and stop; call after every step (on every process when synced)."""
        if self.synced and _reached_sync_point(step):
            self.requested = f"SIGTERM (all {self.process_count} processes stop after the same step)"
        return self.requested is not None

    def say_stopped(self, where: str) -> bool:
        """Whether a stop is due before any work began; if so, says so on stdout (with `where`) and clears it."""
        if not self.requested:
            return False
        print(f"maxmoe: {self.clear()}: stopped before training a step; {where}", flush=True)
        return True

    def clear(self) -> str | None:
        """The pending reason, forgotten (the loop has acted on it)."""
        reason, self.requested, self._seen = self.requested, None, False
        return reason


def _reached_sync_point(step: int) -> bool:
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)
