"""The sweep's planning side: ranking, the planner's table, `--replan` and `--write-config`.

Split from maxmoe.sweep (which compiles and times shapes): everything here reads results.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from maxmoe.analysis.assumptions import table as assumption_table
from maxmoe.analysis.dry_run import GB, replan
from maxmoe.config import Config, UserError
from maxmoe.parallel.names import SIZED_MESH_AXES

AXES = SIZED_MESH_AXES


def with_mesh(config: Config, sizes: dict[str, int]) -> Config:
    return config.replace(mesh=dataclasses.replace(config.mesh, **sizes))


def rank(results: list[dict], dry_run: bool) -> list[dict]:
    """Best first: with the planner's predictions, shapes that fit by predicted TFLOP/s per GPU;
    dry runs without, by fewest cross-domain then total bytes, then memory; timed, by tokens/s."""
    ok = [r for r in results if "error" not in r]
    if dry_run and ok and all(r.get("prediction") for r in ok):
        ok.sort(key=lambda r: (not r["fits"], -r["prediction"]["tflops_per_gpu"]))
    elif dry_run:
        ok.sort(key=lambda r: (not r["fits"], r["cross_domain_total"], r["collective_total"], r["memory"]["total"]))
    else:
        ok.sort(key=lambda r: -r["tokens_per_s"])
    return ok + [r for r in results if "error" in r]


def format_predictions(results: list[dict]) -> str:
    """The planner's table: one line per shape that has a prediction (maxmoe.analysis.planner), its
    step parts, each compute class's kernel, efficiency, status and source (`format_compute`), and
    the uniform-efficiency figure labelled as a sensitivity.

    TFLOP/s per GPU counts model FLOPs, exec the executed ones (recompute included); MFU is
    against the peak of each GEMM class's precision; exposed = the step's non-compute share.
    """
    lines = [
        "predicted by the planner from the dry run's program (maxmoe.analysis.planner; not measured):",
        f"{'#':>2} {'mesh (data,expert,tensor)':<26} {'system':<6} {'step s':>7} {'tokens/s':>10} "
        f"{'TFLOP/s/GPU':>11} {'exec':>5} {'MFU':>5} {'exposed':>7} {'mem GB':>7} {'fits':>4} {'x4 retention':>12}  bound",
    ]
    for i, r in enumerate(results, 1):
        p = r.get("prediction")
        if not p:
            continue
        retention = next(v for k, v in p.items() if k.startswith("retention_at_"))
        lines.append(
            f"{i:>2} {r['name']:<26} {p['system']:<6} {p['step_s']:7.2f} {p['tokens_per_s']:10,.0f} "
            f"{p['tflops_per_gpu']:11.0f} {p['executed_tflops_per_gpu']:5.0f} {p['mfu']:5.2f} "
            f"{p['exposed_fraction']:7.1%} {r['memory']['total'] / GB:7.1f} {'yes' if r['fits'] else 'no':>4} "
            f"{retention:12.4f}  {p['bound']}"
        )
        parts = ", ".join(f"{k} {v:.2f}" for k, v in p["contributions"].items() if v)
        lines.append(f"{'':>3}step parts (s): {parts}")
        lines += [f"{'':>3}{line}" for line in format_compute(p).splitlines()]
    return "\n".join(lines)


def format_compute(p: dict) -> str:
    """Each compute class of a prediction: kernel, precision, executed TFLOP per device, efficiency
    (fraction of its peak), status, seconds, then each source; the uncalibrated classes; and the
    uniform-efficiency sensitivity."""
    lines = [
        f"{'class':<15} {'kernel':<28} {'precision':<10} {'peak':<4} {'exec TFLOP':>10} {'eff':>6} "
        f"{'status':<12} {'seconds':>8}"
    ]
    for c in p.get("compute", ()):
        kernel = f"{c['kernel_class']} {c['backend']}"
        lines.append(
            f"{c['name']:<15} {kernel:<28} {c['precision']:<10} {c['peak']:<4} {c['executed_flops'] / 1e12:10.1f} "
            f"{c['efficiency']:6.3f} {c['status']:<12} {c['seconds']:8.2f}"
        )
    lines += [f"  {c['name']}: {c['source']}" for c in p.get("compute", ())]
    if p.get("uncalibrated"):
        lines.append(f"uncalibrated (no rate measured for the kernel that runs): {', '.join(p['uncalibrated'])}")
    sensitivity = p.get("sensitivity")
    if sensitivity:
        lines.append(
            f"sensitivity, not a prediction: every class at compute efficiency "
            f"{sensitivity['uniform_compute_efficiency']:g} (uncalibrated) gives {sensitivity['tflops_per_gpu']:.0f} "
            "TFLOP/s per GPU"
        )
    return "\n".join(lines)


def write_winner(config: Config, results: list[dict], path: str) -> str:
    """Write the first ranked shape that fits as a full config (YAML) to `path`; its name."""
    winner = next((r for r in results if "error" not in r and r.get("fits", True)), None)
    if winner is None:
        raise UserError(f"--write-config {path}: no shape fits; nothing written")
    shaped = with_mesh(config, {a: winner["mesh"][a] for a in AXES if a in winner["mesh"]})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(shaped.to_yaml())
    return winner["name"]


def replan_main(args, config: Config, system: str | None, assumptions, argv: list[str]) -> dict:
    """`--replan IN.json`: every stored dry-run result predicted again under `system` and `assumptions`;
    returns the report (the sweep plots it with --plot)."""
    if not system:
        raise UserError("--replan needs --system (or a config whose xla.profile is a system)")
    try:
        report = json.loads(Path(args.replan).read_text())
        results = [r for r in report["results"] if "error" not in r]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--replan {args.replan}: not a sweep JSON ({e})") from None
    if any("planner_rows" not in r for r in results):
        raise UserError(
            f"--replan {args.replan}: written before dry runs stored their collectives; run the dry run again"
        )
    for r in results:
        r["prediction"] = replan(r, with_mesh(config, r["mesh"]), system, assumptions)
        r["fits"] = r["memory"]["total"] <= args.hbm_gb * GB
    report.update(system=system, hbm_gb=args.hbm_gb, assumptions=assumption_table(assumptions))
    report["command"] = "python -m maxmoe.sweep " + " ".join(argv)
    report["results"] = rank(report["results"], dry_run=True)
    print(format_predictions(report["results"]))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    if args.write_config:
        print(f"wrote {write_winner(config, report['results'], args.write_config)} to {args.write_config}")
    return report
