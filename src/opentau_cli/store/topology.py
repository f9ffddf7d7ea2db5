"""A run's topology as training_state.json records it (processes, machines, backend, ZeRO stage, batch split), and how
its global batch fits another number of processes (docs/ARCHITECTURE.md, "Resume contract"). Used before a launch
(plan), by a restarted group that re-formed on another world (process/restarts.py) and by the elastic resume itself
(train/reshard.py)."""

from __future__ import annotations

from opentau_cli.errors import UserError


def topology(state: dict) -> dict:
    """The launch a checkpoint was saved by (`topologies`' last entry; older checkpoints: their own fields)."""
    history = topologies(state)
    return history[-1]


def topologies(state: dict) -> list[dict]:
    """Every launch the run went through, oldest first: {step, world_size, backend, zero_stage, per_device_batch,
    grad_accum, machines}. A checkpoint written before the history existed gives one entry from its own fields."""
    if state.get("topologies"):
        return list(state["topologies"])
    acc = state.get("accelerate") or {}
    return [{"step": 0, "world_size": state.get("world_size"), "backend": state.get("backend"),
             "zero_stage": state.get("zero_stage"), "per_device_batch": None, "grad_accum": None,
             "machines": acc.get("num_machines", 1)}]


def topology_entry(step: int, setup, cfg) -> dict:
    return {"step": step, "world_size": setup.world_size, "backend": setup.backend,
            "zero_stage": setup.zero_stage if setup.backend == "deepspeed" else None,
            "per_device_batch": cfg.per_device_batch_size, "grad_accum": cfg.gradient_accumulation_steps,
            "machines": setup.num_machines}


def with_topology(history: list[dict], entry: dict) -> list[dict]:
    """The history with this launch appended, unless the last entry is the same launch (a plain resume, or a later
    save of this launch; an entry from before the history lacks the batch fields, which then do not count)."""
    last = history[-1] if history else None
    same = last is not None and all(last.get(k) in (entry[k], None) if k in ("per_device_batch", "grad_accum")
                                    else last.get(k) == entry[k] for k in entry if k != "step")
    return list(history) if same else [*history, entry]


def is_reshard(state: dict, setup) -> bool:
    """Whether resuming `state` into `setup` changes the topology (processes, backend or ZeRO stage)."""
    saved_ds = state.get("backend") == "deepspeed"
    now_ds = setup.backend == "deepspeed"
    saved_fsdp, now_fsdp = state.get("backend") == "fsdp", setup.backend == "fsdp"
    return (state.get("world_size") != setup.world_size or saved_ds != now_ds or saved_fsdp != now_fsdp
            or (saved_ds and state.get("zero_stage") != setup.zero_stage))


def fit_global_batch(saved_cfg: dict, saved_world: int, world: int, given: dict) -> dict:
    """Per-process batch, per-device batch and accumulation for `world` processes that keep the checkpoint's global
    batch (batch_size x processes): accumulation is kept where the new per-process batch divides by it, else the
    per-device batch, else accumulation goes to 1. `given`: the values the command line set (ints), kept and checked.
    Raises UserError naming the process counts that work when none does."""
    batch, accum = int(saved_cfg["batch_size"]), int(saved_cfg.get("gradient_accumulation_steps") or 1)
    micro = int(saved_cfg.get("per_device_batch_size") or batch // accum)
    global_batch = batch * saved_world
    if global_batch % world:
        fits = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        raise UserError(
            f"The checkpoint's global batch ({global_batch} = {batch} per process x {saved_world} processes) does not "
            f"divide over {world} processes: resume with one of {', '.join(map(str, fits))} processes, or start a new "
            "run from its weights with --policy.pretrained_path.")
    per_process = global_batch // world
    if given.get("batch_size") is not None and given["batch_size"] != per_process:
        raise UserError(
            f"--batch_size={given['batch_size']} would change the checkpoint's global batch of {global_batch}: on "
            f"{world} processes it is {per_process} per process; drop --batch_size to keep it.")
    given_accum, given_micro = given.get("gradient_accumulation_steps"), given.get("per_device_batch_size")
    if given_accum is not None or given_micro is not None:
        fits = (given_accum * given_micro == per_process if given_accum is not None and given_micro is not None
                else per_process % (given_accum or given_micro) == 0)
        if not fits:
            flags = " x ".join(f"--{k}={v}" for k, v in (("per_device_batch_size", given_micro),
                                                         ("gradient_accumulation_steps", given_accum)) if v is not None)
            raise UserError(
                f"Keeping the checkpoint's global batch of {global_batch} on {world} processes needs per-device batch x "
                f"accumulation = {per_process}; {flags} does not fit it: drop it to let resume choose, or pick values "
                f"whose product is {per_process}.")
        accum = given_accum or per_process // given_micro
        micro = given_micro or per_process // accum
    elif per_process % accum == 0:
        micro = per_process // accum
    elif per_process % micro == 0:
        accum = per_process // micro
    else:
        micro, accum = per_process, 1
    return {"batch_size": per_process, "per_device_batch_size": micro, "gradient_accumulation_steps": accum}


def describe_change(before: dict, after: dict) -> str:
    """One line: what changed between two topology entries."""
    def count(n, what):
        return f"{n} {what}" + ("" if n == 1 else "es" if what.endswith("s") else "s")

    def launch(t):
        backend = f"ZeRO-{t['zero_stage']}" if t.get("backend") == "deepspeed" else t.get("backend")
        return f"{count(t.get('world_size'), 'process')} on {count(t.get('machines') or 1, 'machine')} under {backend}"

    def batch(t):
        if t.get("per_device_batch") is None:
            return "?"
        return f"per-device batch {t['per_device_batch']} x accumulation {t['grad_accum']}"

    return (f"Elastic resume: {launch(before)} -> {launch(after)}; {batch(before)} -> {batch(after)} "
            f"(global batch kept); the data continues at its global sample position.")
