"""The short resolved summary that `config validate` prints, and `train` / `resume` before launching."""

from __future__ import annotations

from opentau_cli.plan import RunPlan


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def parameter_row(policy_cfg) -> str:
    """Total and trainable parameters of the configured policy (built on the meta device: no memory, no weights)."""
    from opentau_cli.policies import count_parameters

    counts = count_parameters(policy_cfg)
    return f"{_human(counts['total'])} total, {_human(counts['trainable'])} trainable ({counts['total']:,} / {counts['trainable']:,})"


def summary_rows(plan: RunPlan) -> list[tuple[str, str]]:
    checked = plan.checked
    cfg, accel = checked.config, checked.accelerate
    source = str(accel.path) if accel.path else "none (single process)"
    rows = [
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
        ("parameters", parameter_row(cfg.policy)),
        ("dataset", cfg.dataset.root if cfg.dataset.mixture is None
         else "mixture of " + ", ".join(f"{m.label} (weight {m.weight:g})" for m in cfg.dataset.mixture)),
    ]
    if plan.resume_from:
        rows.append(("resume from", str(plan.resume_from)))
    rows.append(("checked for", checked.machine.describe()))
    return rows


def summarize(plan: RunPlan, heading: str = "Config OK") -> str:
    rows = summary_rows(plan)
    width = max(len(k) for k, _ in rows)
    return heading + "\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
