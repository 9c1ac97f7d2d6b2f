"""`python -m maxmoe.convert`: DeepSeek-V3 checkpoints between Hugging Face and maxmoe.

    python -m maxmoe.convert from-hf --hf-dir DeepSeek-V3 --out ckpt/dsv3 [--dtype float32|bfloat16]
    python -m maxmoe.train --config ckpt/dsv3/config.yaml checkpoint.init_from=ckpt/dsv3
    python -m maxmoe.convert to-hf --checkpoint runs/x --out hf/x [--dtype bfloat16|float32]

from-hf writes OUT/checkpoints (parameters and router biases) and OUT/config.yaml (a
`model:` section). to-hf reads a converted folder or a training run's folder and writes
config.json and model.safetensors (shards + index past --shard-gb), one tensor at a time
without holding the model. Bad input (unknown or missing tensors, wrong shapes, a non-empty
output folder) is one line and exit status 2.
"""

from __future__ import annotations

import math

from maxmoe.cli import _Parser, exit_with, main_guard, path_argument
from maxmoe.config import UserError
from maxmoe.convert import hf, hf_export
from maxmoe.convert.output import storage_error


def build_parser() -> _Parser:
    parser = _Parser(prog="python -m maxmoe.convert", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    importer = commands.add_parser("from-hf", help="Hugging Face folder -> maxmoe checkpoint")
    importer.add_argument("--hf-dir", type=path_argument, required=True, help="folder with config.json and safetensors")
    importer.add_argument("--out", type=path_argument, required=True, help="new folder for the maxmoe checkpoint")
    importer.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="parameter dtype in the checkpoint (router biases stay float32)",
    )
    exporter = commands.add_parser("to-hf", help="maxmoe checkpoint -> Hugging Face folder")
    exporter.add_argument(
        "--checkpoint", type=path_argument, required=True, help="converted folder or training run.dir"
    )
    exporter.add_argument("--out", type=path_argument, required=True, help="new folder for config.json + safetensors")
    exporter.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    exporter.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors file, GiB")
    return parser


@main_guard
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except OSError as e:  # what was written is gone again (maxmoe.convert.output)
        where = f"{e.filename}: " if e.filename else ""
        raise UserError(
            f"{args.command}: {where}{storage_error(e) or e}; nothing was kept in --out {args.out}"
        ) from None


def _run(args) -> int:
    if args.command == "from-hf":
        out = hf.convert_from_hf(args.hf_dir, args.out, args.dtype)
        print(f"maxmoe: wrote {out}/checkpoints and {out}/config.yaml")
    else:
        if not math.isfinite(args.shard_gb) or args.shard_gb <= 0:
            raise UserError(f"--shard-gb {args.shard_gb}: expected a positive number of GiB")
        names = hf_export.convert_to_hf(
            args.checkpoint,
            args.out,
            args.dtype,
            int(args.shard_gb * (1 << 30)),
            label=f"--checkpoint {args.checkpoint}",
        )
        print(f"maxmoe: wrote {args.out}/config.json and {len(names)} safetensors file(s)")
    return 0


if __name__ == "__main__":
    exit_with(main())
