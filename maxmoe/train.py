"""`python -m maxmoe.train --config configs/X.yaml [key=value ...]`: the training job, top to bottom.

    python -m maxmoe.train --config configs/tiny.yaml                     # 1 CPU device
    python -m maxmoe.train --config configs/tiny.yaml run.cpu_devices=8 mesh.data=2 mesh.expert=4

Steps: parse the config; then `maxmoe.training.trainer.train`, the same code a notebook
drives through `Trainer`: set up the process (host devices, XLA flags, jax.distributed),
build the mesh and the data, initialise or restore the state, jit the step with explicit
shardings, loop (log, evaluate, checkpoint), save at the end or on SIGTERM.
Exit status: 0 done (or stopped and saved on SIGTERM), 1 too many non-finite steps, 2 bad input.
"""

from __future__ import annotations

from maxmoe.cli import config_from_args, exit_with, main_guard, make_parser
from maxmoe.config import UserError
from maxmoe.data import resolve_vocab_size, vocab_size_note
from maxmoe.training.preemption import StopSignal, hold


@main_guard
def main(argv: list[str] | None = None) -> int:
    # The signal handlers come first: a signal while the config is read or jax starts (seconds)
    # is answered and stops the job before it writes anything, rather than being lost.
    stop = StopSignal(exit_on_second_interrupt=True)
    with stop.installed():
        hold("startup")
        return _run(argv, stop)


def _run(argv: list[str] | None, stop: StopSignal) -> int:
    parser = make_parser("python -m maxmoe.train", __doc__.splitlines()[0])
    args = parser.parse_args(argv)
    notes = []

    def resolve(config):  # model.vocab_size=auto: the number taken is said (not with --print-config)
        resolved = resolve_vocab_size(config)
        notes.append(vocab_size_note(config, resolved))
        return resolved

    config = config_from_args(args, resolve)
    if stop.say_stopped("nothing was written"):
        return 0
    if config.run.progress != "none":
        # Said before jax is imported (seconds): the run has started, and where its files go.
        print(f"maxmoe: run.dir {config.run.dir}: starting jax ...", flush=True)
        for note in filter(None, notes):
            print(note, flush=True)
    from maxmoe.training.trainer import train

    return train(config, stop=stop)


def __getattr__(name):
    if name == "train":  # `from maxmoe.train import train`, without importing jax at startup
        from maxmoe.training.trainer import train

        return train
    raise AttributeError(f"module 'maxmoe.train' has no attribute {name!r}")


if __name__ == "__main__":
    exit_with(main())


__all__ = ["main", "UserError"]
