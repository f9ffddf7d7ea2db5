"""The short resolved summary printed by `config validate` and before training."""

from __future__ import annotations

from opentau_cli.config.rules import Validated


def summary_rows(checked: Validated) -> list[tuple[str, str]]:
    cfg, accel = checked.config, checked.accelerate
    source = str(accel.path) if accel.path else "none (single process)"
    return [
        ("backend", accel.label),
        ("accelerate config", source),
        ("world size", f"{accel.world_size} ({accel.num_machines} machine{'s' if accel.num_machines > 1 else ''})"),
        ("mixed precision", accel.mixed_precision),
        (
            "global batch",
            f"{checked.global_batch_size} = {cfg.per_device_batch_size} per device x {cfg.gradient_accumulation_steps} "
            f"accumulation x {accel.world_size} processes",
        ),
        ("steps", str(cfg.steps)),
        ("output dir", str(cfg.output_dir)),
        ("policy", f"{cfg.policy.type} (preset {cfg.policy.preset})"),
        ("dataset", cfg.dataset.root),
    ]


def summarize(checked: Validated) -> str:
    rows = summary_rows(checked)
    width = max(len(k) for k, _ in rows)
    return "Config OK\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
