"""`python -m maxmoe.info`: parameter counts and FLOPs of a config, without allocating parameters.

python -m maxmoe.info --config configs/deepseek_v3_671b.yaml [key=value ...] [--json]
python -m maxmoe.info --config configs/tiny.yaml run.cpu_devices=8 mesh.expert=8 --lower cuda
"""

from __future__ import annotations

import json
import sys

from maxmoe import runtime
from maxmoe.cli import config_from_args, main_guard, make_parser
from maxmoe.flops import count_params, flops_per_token
from maxmoe.lowering import collective_counts_for_platform


@main_guard
def main(argv: list[str] | None = None) -> int:
    parser = make_parser("python -m maxmoe.info", __doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--lower",
        choices=["cuda"],
        help="lower one train step for this platform and count its collectives (no GPU needed)",
    )
    args = parser.parse_args(argv)
    config = config_from_args(args)

    if args.lower:
        runtime.set_host_device_count(config.run.cpu_devices)
        counts = collective_counts_for_platform(config, args.lower)
        if args.json:
            print(json.dumps(counts))
        else:
            for name, count in counts.items():
                print(f"{name}: {count}")
        return 0

    report = dict(count_params(config.model))
    report["flops_per_token"] = flops_per_token(config.model, config.train.seq_len)
    report["seq_len"] = config.train.seq_len
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>16}: {value:,.0f}" if isinstance(value, (int, float)) else f"{key:>16}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
