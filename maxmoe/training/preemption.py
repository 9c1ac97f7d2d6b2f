"""SIGTERM and SIGINT: save after the current step and stop; with several processes, the same step on all.

    stop = StopSignal(jax.process_count())
    ... after each step:  if stop.should_stop(step): save step; leave the loop

One process: Python handlers note the signal and the loop stops after the step in flight.

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

import os
import signal

import jax
from jax.experimental import multihost_utils


def _preemption_service() -> bool:
    """Whether JAX's multi-process preemption service is running in this process."""
    return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)


class StopSignal:
    """Turns SIGTERM/SIGINT into "save and stop after this step", agreed across processes.

    `requested` names the reason once a stop is due; `restore()` puts the previous handlers back.
    """

    def __init__(self, process_count: int = 1):
        self.requested: str | None = None
        self.process_count = process_count
        self.synced = process_count > 1 and _preemption_service()
        handled = (signal.SIGINT,) if self.synced else (signal.SIGTERM, signal.SIGINT)
        self._previous = {sig: signal.signal(sig, self._handle) for sig in handled}

    def _handle(self, signum, frame):  # noqa: ARG002 - signal API
        if self.synced:  # JAX's notifier owns SIGTERM: hand the interrupt to it
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.requested = signal.Signals(signum).name

    def should_stop(self, step: int) -> bool:
        """Whether to save `step` and stop; call after every step (on every process when synced)."""
        if self.synced and multihost_utils.reached_preemption_sync_point(step):
            self.requested = f"SIGTERM (all {self.process_count} processes stop after the same step)"
        return self.requested is not None

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
