"""The short resolved summary that `config validate` prints, and `train` / `resume` before launching."""

from __future__ import annotations

from opentau_cli.process.launch import RunPlan


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def human_bytes(n: int) -> str:
    """Bytes in binary units, as nvidia-smi and the memory plan count memory."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


# AdamW keeps two fp32 moments per trainable parameter.
ADAMW_BYTES_PER_PARAMETER = 8


def fsdp_rows(accel) -> list[tuple[str, str]]:
    """An FSDP2 launch's sharding, wrapping and precision (config/accelerate.py fsdp_lines), one row each."""
    if accel.backend != "fsdp":
        return []
    from opentau_cli.config.accelerate import fsdp_lines

    names = {"backend": "sharding"}  # the backend row says FSDP2 already
    rows = [(line.split(":", 1)[0].lower(), line.split(":", 1)[1].strip()) for line in fsdp_lines(accel)]
    return [(names.get(key, key), text) for key, text in rows]


def restart_policy(cfg) -> str:
    """What happens when a rank dies or hangs (docs/ARCHITECTURE.md, "Restarts")."""
    n = cfg.distributed.max_restarts
    if n == 0:
        return "none: a failed or hung rank ends the run (distributed.max_restarts / --max-restarts)"
    policy = (f"up to {n} automatic restart{'s' * (n != 1)} from the last checkpoint when a rank dies or hangs; bad "
              "input, a checkpoint that fails verification or the same step failing twice end the run "
              "(distributed.max_restarts)")
    machines = cfg.distributed.machine_range
    if machines and machines[0] < machines[1]:
        policy += (f"; elastic machines {machines[0]}:{machines[1]}: goes on with {machines[0]} or more, the global "
                   f"batch kept; re-forms after {cfg.distributed.machine_wait_seconds:g} s (distributed.machines)")
    return policy


def parameter_row(counts: dict[str, int]) -> str:
    """Total and trainable parameters of the configured policy (with LoRA on, of the adapted one)."""
    return f"{_human(counts['total'])} total, {_human(counts['trainable'])} trainable ({counts['total']:,} / {counts['trainable']:,})"


def optimizer_row(counts: dict[str, int], world_size: int, zero_stage: int | None, sharded_by: str | None = None) -> str:
    """The AdamW state the trainable parameters imply: per process, divided among the ranks by ZeRO-1/2/3 or FSDP2
    (`sharded_by`); in binary units, as the memory plan counts memory."""
    total = ADAMW_BYTES_PER_PARAMETER * counts["trainable"]
    who = sharded_by or (f"ZeRO-{zero_stage}" if zero_stage else None)
    shards = world_size if who else 1
    where = f"{human_bytes(-(-total // shards))} per process, {who} shards it over {world_size}" if shards > 1 \
        else "on every process"
    return f"{human_bytes(total)} AdamW state (2 fp32 moments per trainable parameter; {where})"


def memory_row(cfg, accel, machine) -> str:
    """The memory plan's peak per GPU, and the margin on the card it was checked against (opentau_cli/plan/memory.py)."""
    from opentau_cli.plan.memory import card_memory, plan_memory

    try:
        return plan_memory(cfg, accel).describe(card_memory(machine))
    except Exception as error:  # noqa: BLE001  (a plan that cannot be computed never blocks a launch; it says why)
        return f"not computed ({type(error).__name__}: {error})"


def summary_rows(plan: RunPlan) -> list[tuple[str, str]]:
    checked = plan.checked
    cfg, accel = checked.config, checked.accelerate
    source = str(accel.path) if accel.path else "none (single process)"
    from opentau_cli.plan.memory import parameter_counts  # built on the meta device once: no memory, no weights

    counts = parameter_counts(cfg.policy)
    rows = [
        ("backend", accel.label),
        ("accelerate config", source),
        ("world size", f"{accel.world_size} ({accel.num_machines} machine{'s' if accel.num_machines > 1 else ''})"),
        *([("scheduler", accel.scheduler)] if accel.scheduler else []),
        ("mixed precision", accel.mixed_precision),
        *fsdp_rows(accel),
        ("distributed", f"hang timeout {cfg.distributed.timeout_minutes:g} min (distributed.timeout_minutes)"),
        ("restarts", restart_policy(cfg)),
        (
            "global batch",
            f"{checked.global_batch_size} = {cfg.per_device_batch_size} per device x {cfg.gradient_accumulation_steps} "
            f"accumulation x {accel.world_size} processes",
        ),
        ("steps", str(cfg.steps)),
        ("output dir", str(cfg.output_dir)),
        ("policy", f"{cfg.policy.type} (preset {cfg.policy.preset})"),
        ("parameters", parameter_row(counts)),
        ("optimizer memory", optimizer_row(counts, accel.world_size, accel.zero_stage if accel.backend == "deepspeed" else None,
                                           sharded_by="FSDP2" if accel.backend == "fsdp" else None)),
        ("dataset", (cfg.dataset.root if cfg.dataset.repo_id is None else
                     f"{cfg.dataset.repo_id} at {cfg.dataset.revision} (Hugging Face Hub, read from its cache)")
         if cfg.dataset.mixture is None else "mixture of " + ", ".join(f"{m.label} (weight {m.weight:g})" for m in cfg.dataset.mixture)),
    ]
    rows.append(("memory plan", memory_row(cfg, accel, checked.machine)))
    if plan.resume_from:
        rows.append(("resume from", str(plan.resume_from)))
    rows.append(("checked for", checked.machine.describe()))
    return rows


def summarize(plan: RunPlan, heading: str = "Config OK") -> str:
    rows = summary_rows(plan)
    width = max(len(k) for k, _ in rows)
    return heading + "\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)
