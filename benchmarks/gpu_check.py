"""Part 0 of benchmarks/gpu_suite.sh: every kernel `auto` can choose on this device against its XLA oracle.

    PYTHONPATH=. python benchmarks/gpu_check.py [--json OUT.jsonl] [--only CHECK ...]

The checks live in maxmoe.check (users run the same as `python -m maxmoe.info --check`);
this runner only makes them a suite part. Rows are printed and appended to --json as each
check finishes, so a part cut off by its time limit keeps the rows it measured.
"""

import sys

from maxmoe.check import main

if __name__ == "__main__":
    sys.exit(main())
