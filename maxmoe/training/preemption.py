"""SIGTERM and SIGINT: save after the current step and stop; with several processes, the same step on all.

    stop = StopSignal(jax.process_count())
    with stop.installed():                    # handlers only while the loop runs
        ... after each step:  if stop.should_stop(step): save step; leave the loop

One process: Python handlers note the signal and the loop stops after the step in flight.
`installed()` nests: only the outermost use installs handlers, and the ones that were there
before come back when it ends (a notebook's interrupt keeps working after a run).

Several processes (jax.distributed): a process that stops alone leaves the others waiting in a
collective, and their checkpoints would not match. JAX's preemption service already handles
this: `jax.distributed.initialize` installs a SIGTERM notifier (in C++) that tells the
coordination service, which picks a step every process can still reach (the largest current
step + 1); `multihost_utils.reached_preemption_sync_point(step)`, asked after every step, is
true at that step on every process. A Python SIGTERM handler would replace that notifier at
the OS level, so none is installed then; SIGINT (Ctrl-C) is forwarded to this process as
SIGTERM and takes the same path.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import jax
from jax.experimental import multihost_utils


def _preemption_service() -> bool:
    """Whether JAX's multi-process preemption service is running in this process."""
    return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)


class StopSignal:
    """Turns SIGTERM/SIGINT into "save and stop after this step", agreed across processes.

    `requested` names the reason once a stop is due; `clear()` forgets it once acted on.
    """

    def __init__(self, process_count: int = 1):
        self.requested: str | None = None
        self.process_count = process_count
        self.synced = process_count > 1 and _preemption_service()
        self._depth = 0
        self._previous: dict = {}

    def _handle(self, signum, frame):  # noqa: ARG002 - signal API
        if self.synced:  # JAX's notifier owns SIGTERM: hand the interrupt to it
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.requested = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignal]:
        """Handlers in place for the block; outside the main thread (no Python handlers there) a no-op."""
        if self._depth == 0 and threading.current_thread() is threading.main_thread():
            handled = (signal.SIGINT,) if self.synced else (signal.SIGTERM, signal.SIGINT)
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
        if self.synced and multihost_utils.reached_preemption_sync_point(step):
            self.requested = f"SIGTERM (all {self.process_count} processes stop after the same step)"
        return self.requested is not None

    def clear(self) -> str | None:
        """The pending reason, forgotten (the loop has acted on it)."""
        reason, self.requested = self.requested, None
        return reason
