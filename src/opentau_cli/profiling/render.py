"""Rich tables for profile reports (stdout), built from the JSON-ready dicts in stats.py."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from opentau_cli.profiling.stats import PHASE_LABELS, REPORT_PHASES


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def phase_table(report: dict) -> Table:
    run = report.get("run", {})
    title = (
        f"{run.get('backend_label', report['backend'])}, {report['world_size']} process(es), "
        f"{report['measured_steps']} measured steps (rank {report['slowest_rank']}, the slowest)"
    )
    table = Table(title=title)
    table.add_column("phase")
    for col in ("mean ms", "median ms", "p95 ms", "share"):
        table.add_column(col, justify="right")
    for name in REPORT_PHASES:
        s = report["phases"][name]
        style = "bold" if name == "total" else None
        table.add_row(PHASE_LABELS[name], _ms(s["mean_s"]), _ms(s["median_s"]), _ms(s["p95_s"]), f"{s['share'] * 100:.1f}%", style=style)
    return table


def summary_lines(report: dict) -> list[str]:
    mfu = "n/a" if report["mfu"] is None else f"{report['mfu'] * 100:.1f}%"
    why = ""
    if report["mfu"] is None:
        missing = []
        if not report["flops_per_sample"]:
            missing.append("policy FLOPs per sample")
        if not report["peak_flops_per_device"]:
            missing.append(f"peak FLOP/s of '{report['device']}' (pass --peak-tflops)")
        why = f" (unknown: {', '.join(missing)})"
    memory = ", ".join(f"rank {m['rank']}: {fmt_bytes(m['bytes'])}" for m in report["peak_memory"])
    kind = report["peak_memory"][0]["kind"].replace("_", " ")
    lines = [
        f"{report['steps_per_s']:.3f} steps/s, {report['samples_per_s']:.2f} global samples/s "
        f"(global batch {report['global_batch_size']}, slowest rank)",
        f"peak memory ({kind}): {memory}",
        f"MFU: {mfu}{why}",
    ]
    if report["flops_per_sample"]:
        lines.append(f"training FLOPs per sample: {report['flops_per_sample'] / 1e9:.2f} GFLOP")
    if report.get("accounting"):
        lines.append(report["accounting"])
    return lines


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    console.print(phase_table(report))
    for line in summary_lines(report):
        console.print(line, highlight=False)


def compare_table(rows: list[dict]) -> Table:
    table = Table(title="Accelerate configs side by side (same training config)")
    table.add_column("accelerate config")
    table.add_column("backend")
    for col in ("procs", "samples/s", "step ms", "peak memory / rank", "speedup"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            Path(r["accelerate_config"]).name,
            r["backend"],
            str(r["world_size"]),
            f"{r['samples_per_s']:.2f}",
            _ms(r["step_time_s"]),
            fmt_bytes(r["peak_memory_bytes"]),
            f"{r['speedup']:.2f}x",
        )
    return table


def dataloader_table(report: dict) -> Table:
    table = Table(title=f"Input pipeline only (no model), {report['measured_batches']} batches of {report['batch_size']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    wait = report["batch_wait"]
    table.add_row("samples/s (ceiling)", f"{report['samples_per_s']:.1f}")
    table.add_row("batches/s", f"{report['batches_per_s']:.2f}")
    table.add_row("batch wait mean ms", _ms(wait["mean_s"]))
    table.add_row("batch wait median ms", _ms(wait["median_s"]))
    table.add_row("batch wait p95 ms", _ms(wait["p95_s"]))
    table.add_row("num_workers", str(report["num_workers"]))
    if len(report.get("datasets", [])) > 1:
        table.add_row("datasets (weight)", ", ".join(f"{d['name']} ({d['weight']:g})" for d in report["datasets"]))
    return table


def max_batch_table(results: list[dict]) -> Table:
    table = Table(title="Largest per-device batch that fits")
    table.add_column("accelerate config")
    table.add_column("backend")
    for col in ("procs", "max batch / device", "first OOM", "samples/s", "peak memory / rank"):
        table.add_column(col, justify="right")
    for r in results:
        best = str(r["max_per_device_batch"]) + (" (limit)" if r["reached_limit"] else "")
        table.add_row(
            Path(r["accelerate_config"]).name if r["accelerate_config"] else "default",
            r["backend"],
            str(r["world_size"]),
            best,
            str(r["first_oom_batch"] or "-"),
            f"{r['samples_per_s']:.2f}" if r["samples_per_s"] else "n/a",
            fmt_bytes(r["peak_memory_bytes"]),
        )
    return table
