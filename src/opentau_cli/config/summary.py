"""The short resolved summary printed by `config validate` and before training."""

from __future__ import annotations

from opentau_cli.config.rules import Validated


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def parameter_row(cfg) -> str:
    """Total and trainable parameters of the configured policy (built on the meta device: no memory, no weights)."""
    from opentau_cli.policies import count_parameters

    counts = count_parameters(cfg.policy)
    return f"{_human(counts['total'])} total, {_human(counts['trainable'])} trainable ({counts['total']:,} / {counts['trainable']:,})"


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
        ("parameters", parameter_row(cfg)),
        ("dataset", cfg.dataset.root),
    ]


def summarize(checked: Validated) -> str:
    rows = summary_rows(checked)
    width = max(len(k) for k, _ in rows)
    return "Config OK\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
