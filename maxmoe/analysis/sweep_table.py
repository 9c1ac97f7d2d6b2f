"""The sweep's tables: a dry run's memory and bytes per shape (columns chosen by `--columns`), or
the timing of real devices. The planner's predictions have their own (sweep_plan.format_predictions).
"""

from __future__ import annotations

from maxmoe.analysis.dry_run import GB
from maxmoe.config import UserError


# The dry-run table's columns: name -> (header with the unit, width, value of a result). `--columns`
# picks them; the default leaves out what the notes below the table break down.
def _dry_run_columns(u: str, gb) -> dict:
    def pass_a2a(name):
        return lambda r: gb(r["collectives_by_pass"][name].get("all-to-all", 0))

    def kind(name):
        return lambda r: gb(r["collectives"].get(name, 0))

    return {
        "arg": (f"arg {u}", 8, lambda r: gb(r["memory"]["argument"])),
        "out": (f"out {u}", 7, lambda r: gb(r["memory"]["output"])),
        "alias": (f"alias {u}", 8, lambda r: gb(r["memory"]["alias"])),
        "temp": (f"temp {u}", 8, lambda r: gb(r["memory"]["temp"])),
        "total": (f"total {u}", 8, lambda r: gb(r["memory"]["total"])),
        "fits": ("fits", 4, lambda r: "yes" if r["fits"] else "no"),
        "wire": (f"wire {u}", 8, lambda r: gb(r["collective_total"])),
        "fwd": (f"fwd {u}", 7, lambda r: gb(r["forward_total"])),
        "bwd": (f"bwd {u}", 7, lambda r: gb(r["backward_total"])),
        "x-dom": (f"x-dom {u}", 8, lambda r: gb(r["cross_domain_total"])),
        "a2a": (f"a2a {u}", 7, kind("all-to-all")),
        "a2a-fwd": ("a2a fwd", 7, pass_a2a("forward")),
        "a2a-bwd": ("a2a bwd", 7, pass_a2a("backward")),
        "AR": (f"AR {u}", 7, kind("all-reduce")),
        "AG": (f"AG {u}", 7, kind("all-gather")),
        "RS": (f"RS {u}", 7, kind("reduce-scatter")),
        "TFLOP": ("TFLOP", 7, lambda r: f"{r['flops_per_device'] / 1e12:.3g}"),
        "compile": ("compile s", 9, lambda r: f"{r['compile_s']:.1f}"),
    }


DRY_RUN_COLUMNS = tuple(_dry_run_columns("GB", str))
COMPACT_COLUMNS = ("arg", "temp", "total", "fits", "wire", "x-dom", "a2a", "TFLOP", "compile")


def parse_columns(text: str | None) -> tuple[str, ...]:
    """--columns: `all`, or names of DRY_RUN_COLUMNS separated by commas; None: COMPACT_COLUMNS."""
    if text is None:
        return COMPACT_COLUMNS
    if text == "all":
        return DRY_RUN_COLUMNS
    names = tuple(n.strip() for n in text.split(","))
    unknown = [n for n in names if n not in DRY_RUN_COLUMNS]
    if unknown or not names:
        raise UserError(f"--columns {text!r}: expected all or names from {','.join(DRY_RUN_COLUMNS)}")
    return names


def format_table(results: list[dict], dry_run: bool, columns: tuple[str, ...] = COMPACT_COLUMNS) -> str:
    ok = [r for r in results if "error" not in r]
    big = dry_run and ok and max(max(r["memory"]["total"], r["collective_total"]) for r in ok) >= GB
    unit, scale = ("GB", GB) if big or not ok else ("MB", 1e6)

    def _gb(x) -> str:
        return f"{x / scale:.2f}" if x is not None else "-"

    chosen = [_dry_run_columns(unit, _gb)[name] for name in columns] if dry_run else []
    if dry_run:
        head = f"{'#':>2} {'mesh (data,expert,tensor)':<26} " + " ".join(f"{h:>{w}}" for h, w, _ in chosen)
    else:
        head = (
            f"{'#':>2} {'mesh (data,expert,tensor)':<26} {'tokens/s':>10} {'TFLOP/s/dev':>11} {'MFU':>6} "
            f"{'step s':>8} {'compile s':>9}"
        )
    lines = [head, "-" * len(head)]
    for i, r in enumerate(results, 1):
        name = r["name"]
        if "error" in r:
            lines.append(f"{i:>2} {name:<26} error: {r['error']}")
            continue
        if dry_run:
            lines.append(f"{i:>2} {name:<26} " + " ".join(f"{value(r):>{w}}" for _, w, value in chosen))
        else:
            mfu_text = f"{r['mfu']:.3f}" if r.get("mfu") is not None else "n/a"
            lines.append(
                f"{i:>2} {name:<26} {r['tokens_per_s']:10,.0f} {r['tflops_per_device']:11.2f} {mfu_text:>6} "
                f"{r['step_s']:8.4f} {r['compile_s']:9.1f}"
            )
    return "\n".join(lines)
