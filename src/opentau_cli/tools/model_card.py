"""The model card (the README.md of a Hub model repo) of a policy `checkpoint export --push-to-hub` publishes: what a
robot engineer needs to act on it (base model and revision, datasets and revisions, the training recipe, the eval
result of that checkpoint with its plot, how to load it in LeRobot, openpi and `opentau serve`) and the Hub metadata
fields LeRobot's own cards carry (library_name, tags, pipeline_tag, license, base_model, datasets), written through
huggingface_hub's `ModelCardData`. docs/ARCHITECTURE.md, "Publishing to the Hub".

No date or local path goes into the card: the same checkpoint pushed twice gives the same bytes (the Hub then skips
the unchanged file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from opentau_cli.config.accelerate import AccelerateSetup
from opentau_cli.config.model import TrainConfig
from opentau_cli.policies.layouts import LEROBOT, OPENPI, OPENTAU

CARD = "README.md"
EVAL_PLOT = "eval/eval.png"  # where the eval plot goes in the repo
PIPELINE_TAG = "robotics"  # LeRobot's cards' pipeline tag
UNKNOWN_LICENSE = "unknown"  # a Hub license id: what the card says when the base model's card names none
_LIBRARY = {LEROBOT: "lerobot", OPENPI: "openpi", OPENTAU: "opentau"}  # which code the files load in as they are


@dataclass
class BaseModel:
    """Where the policy's weights started: `policy.pretrained_path`, a Hub repo at a commit or a local path."""

    source: str
    repo_id: str | None = None
    commit: str | None = None
    how: str = ""  # how the commit was found, in words
    license: str | None = None


@dataclass
class CardFacts:
    repo_id: str  # USER/REPO it is pushed to
    branch: str
    layout: str
    config: TrainConfig
    state: dict  # the checkpoint's training_state.json
    run: str  # the run directory's name
    checkpoint: str  # the checkpoint directory's name
    manifest_xxh3: str
    weights: str  # ema | live
    dataset: str  # the dataset whose statistics the export carries (export --dataset)
    base: BaseModel | None = None
    eval: dict | None = None  # the eval.json of `opentau eval` on this checkpoint
    eval_plot: str | None = None  # its plot's path in the repo
    simulator: dict | None = None  # its evaluation in a simulator during training (store/evals.py, eval.env)
    asset: str | None = None  # openpi: assets/<asset>/norm_stats.json
    files: list[str] = field(default_factory=list)


def base_model(source) -> BaseModel | None:
    """The base model of `policy.pretrained_path`: for a Hub repo id its commit (the one this machine's Hugging Face
    cache holds for the asked revision, which the run read, else the Hub's answer now) and the license its own card
    names; None when the policy started from a seeded initialization."""
    if source is None:
        return None
    from opentau_cli.store.hub import parse_repo_id

    text = str(source)
    parsed = None if Path(text).expanduser().exists() else parse_repo_id(text)
    if parsed is None:
        return BaseModel(text, how="a local path")
    repo_id, asked = parsed
    from huggingface_hub import HfApi, ModelCard, hf_hub_download, snapshot_download

    found = BaseModel(text, repo_id)
    try:
        folder = snapshot_download(repo_id, revision=asked, allow_patterns=["*.safetensors"], local_files_only=True)
        found.commit, found.how = Path(folder).name, f"{asked or 'main'} in this machine's Hugging Face cache"
    except Exception:  # not in the cache: what the Hub says now
        try:
            found.commit = HfApi().model_info(repo_id, revision=asked).sha
            found.how = f"{asked or 'main'} on the Hub at the time of the push"
        except Exception:
            found.how = "not found: neither the cache nor the Hub answered"
    try:
        card = hf_hub_download(repo_id, CARD, revision=found.commit or asked)
        found.license = ModelCard.load(card, ignore_metadata_errors=True).data.license
    except Exception:  # no card, or not reachable: the license stays unknown, and the card says so
        pass
    return found


def dataset_refs(cfg: TrainConfig, state: dict) -> list[dict]:
    """Each dataset of the run: its name, its Hub repo id and commit (what training_state.json recorded), or none
    for a local dataset; its sampling weight in a mixture."""
    recorded = state.get("dataset_revisions") or {}
    out = []
    for member in cfg.dataset.members():
        ref = {"name": member.label, "repo_id": None, "commit": None, "weight": member.weight, "episodes": member.episodes}
        if member.repo_id:
            was = recorded.get(member.label) or {}
            ref["repo_id"] = member.repo_id.partition("@")[0]
            ref["commit"] = was.get("commit") or member.revision
        out.append(ref)
    return out


def metadata(facts: CardFacts) -> str:
    """The YAML front matter: the fields LeRobot's cards carry (library_name, tags, pipeline_tag, license, base_model,
    datasets, model_name), through huggingface_hub's own ModelCardData."""
    from huggingface_hub import ModelCardData

    policy = facts.config.policy
    library = _LIBRARY[facts.layout]
    tags = list(dict.fromkeys(["robotics", library, policy.type, "opentau", f"{facts.layout}-layout"]))
    hub_datasets = [d["repo_id"] for d in dataset_refs(facts.config, facts.state) if d["repo_id"]]
    base = facts.base
    data = ModelCardData(
        license=(base.license if base and base.license else UNKNOWN_LICENSE), library_name=library,
        pipeline_tag=PIPELINE_TAG, tags=tags, model_name=policy.type,
        base_model=base.repo_id if base and base.repo_id else None, datasets=hub_datasets or None)
    return data.to_yaml()


def render(facts: CardFacts) -> str:
    """The whole README.md."""
    sections = [f"---\n{metadata(facts)}\n---\n", _summary(facts), _base(facts), _datasets(facts), _recipe(facts),
                _evaluation(facts), _usage(facts)]
    return "\n".join(s for s in sections if s)


def _summary(f: CardFacts) -> str:
    p = f.config.policy
    weights = "EMA weights" if f.weights == "ema" else "weights"
    return (f"# {f.repo_id.partition('/')[2]}\n\n"
            f"A {p.type} policy ({p.preset} preset) trained with opentau, in the {f.layout} layout: the {weights} of "
            f"step {f.state.get('step')} of run `{f.run}` (checkpoint `{f.checkpoint}`, whose manifest.json has the "
            f"xxh3-128 `{f.manifest_xxh3}`), normalized with the statistics of dataset `{f.dataset}`.\n\n"
            f"Files: {', '.join(f'`{name}`' for name in f.files)}.\n")


def _base(f: CardFacts) -> str:
    b = f.base
    if b is None:
        return "## Base model\n\nNone: the policy was trained from a seeded initialization (no pretrained weights).\n"
    if b.repo_id is None:
        return (f"## Base model\n\nLocal weights `{Path(b.source).name}` (not a Hub repo); their license is not "
                "recorded here.\n")
    commit = f"at commit `{b.commit}` ({b.how})" if b.commit else f"(revision {b.how})"
    license = (f"license `{b.license}`, from its model card" if b.license
               else f"license `{UNKNOWN_LICENSE}`: its model card names none")
    return f"## Base model\n\n[{b.repo_id}](https://huggingface.co/{b.repo_id}) {commit}; {license}.\n"


def _datasets(f: CardFacts) -> str:
    rows = ["| dataset | where | revision | sampling weight | episodes |", "|---|---|---|---|---|"]
    for d in dataset_refs(f.config, f.state):
        where = (f"[{d['repo_id']}](https://huggingface.co/datasets/{d['repo_id']})" if d["repo_id"]
                 else "a local dataset (not on the Hub)")
        episodes = "all" if d["episodes"] is None else ", ".join(map(str, d["episodes"]))
        commit = f"`{d['commit']}`" if d["commit"] else "-"
        rows.append(f"| `{d['name']}` | {where} | {commit} | {d['weight']:g} | {episodes} |")
    held = f.config.validation.val_split
    note = f"\n{held:.0%} of the episodes were held out for validation.\n" if held else ""
    return "## Datasets\n\n" + "\n".join(rows) + "\n" + note


def _recipe(f: CardFacts) -> str:
    cfg, s = f.config, f.state
    world = s.get("world_size") or 1
    backend = AccelerateSetup(backend=s.get("backend") or "single", zero_stage=s.get("zero_stage")).label
    micro = cfg.per_device_batch_size or cfg.batch_size // cfg.gradient_accumulation_steps
    lora = cfg.policy.lora
    opt, sched = cfg.optimizer, cfg.scheduler
    rows = [
        ("steps", f"{s.get('step')} of {cfg.steps} ({s.get('samples_seen', '-')} samples)"),
        ("batch", f"{cfg.batch_size * world} per step: {micro} per device x {cfg.gradient_accumulation_steps} "
                  f"accumulation x {world} process{'es' * (world != 1)}"),
        ("backend", f"{backend}, {world} process{'es' * (world != 1)}, mixed precision {s.get('mixed_precision') or 'no'}"),
        ("optimizer", f"AdamW, lr {opt.lr:g}, betas {tuple(opt.betas)}, weight decay {opt.weight_decay:g}, "
                      f"gradient clipping {opt.grad_clip_norm:g}"),
        ("schedule", f"{sched.type}, {sched.warmup_steps} warmup steps, decay to {sched.decay_lr:g}"
         if sched.type == "cosine_with_warmup" else sched.type),
        ("LoRA", f"rank {lora.rank}, alpha {lora.alpha:g} (merged into the exported weights)" if lora.enabled else "off (full fine-tuning)"),
        ("EMA", f"decay {cfg.ema.decay:g} ({'these are the EMA weights' if f.weights == 'ema' else 'the live weights were exported'})"
         if cfg.ema.decay else "off"),
        ("augmentation", "openpi's (crop, rotation, colour)" if cfg.dataset.augment == "openpi" else "none"),
        ("frozen", ", ".join(n for n, on in (("vision encoder", cfg.policy.freeze_vision_encoder),
                                            ("all but the action expert", cfg.policy.train_expert_only)) if on) or "nothing"),
        ("actions", f"chunks of {cfg.policy.chunk_size}, {cfg.policy.n_action_steps} returned, "
                    f"{cfg.policy.num_inference_steps} flow-matching steps"),
        ("images", f"{cfg.dataset.num_cameras} camera slot{'s' * (cfg.dataset.num_cameras != 1)} at "
                   f"{cfg.policy.image_resolution[0]}x{cfg.policy.image_resolution[1]}"),
    ]
    return "## Training recipe\n\n| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def _evaluation(f: CardFacts) -> str:
    return _offline(f) + _in_simulator(f.simulator)


def _in_simulator(s: dict | None) -> str:
    if s is None:
        return ""
    low, high = s["success_rate_95"]
    return (f"\n### In a simulator\n\nSuccess rate **{s['success_rate']:.1%}** ({s['successes']} of {s['episodes_run']} "
            f"episodes; 95% interval {low:.1%}-{high:.1%}) in `{s['env']}`, episodes from seeds {s['seed']} to "
            f"{s['seed'] + s['rollouts'] - 1}, evaluated during training at step {s['step']} "
            f"({s['weights'] or 'the'} weights); mean return {s['mean_return']:.3g}, mean episode length "
            f"{s['mean_steps']:.1f} steps.\n")


def _offline(f: CardFacts) -> str:
    e = f.eval
    if e is None:
        return ("## Evaluation\n\nNo `opentau eval` result of this checkpoint was found when it was pushed "
                "(`opentau eval RUN` writes one; `checkpoint export --eval DIR` attaches it).\n")
    ours, mean = e["policy"], e["mean_action"]
    episodes = ", ".join(map(str, e["episodes"]))
    verdict = "beats" if e["beats_mean_action"] else "does not beat"
    lines = [
        "## Evaluation\n",
        f"`opentau eval` on {e['samples']} action chunks of the {'held-out' if e['held_out'] else 'selected'} episodes "
        f"{episodes} of dataset `{e['dataset_name']}` (seed {e['seed']}), against the recorded actions; the baseline "
        f"is {e['baseline']}.\n",
        "| | policy | mean action |", "|---|---|---|",
        f"| action MSE | {ours['mse']:.5g} | {mean['mse']:.5g} |",
        f"| action MAE | {ours['mae']:.5g} | {mean['mae']:.5g} |",
        f"\nThe policy {verdict} the mean action (MSE ratio {e['mse_ratio']:.3f}).\n",
    ]
    if f.eval_plot:
        lines.append(f"![Predicted vs recorded actions]({f.eval_plot})\n")
    return "\n".join(lines)


def _usage(f: CardFacts) -> str:
    pinned = f.repo_id if f.branch == "main" else f"{f.repo_id}@{f.branch}"
    out = ["## Use it\n",
           f"A branch moves with the next push: give a robot a commit (`{f.repo_id}@COMMIT`, below for LeRobot and openpi).\n",
           "### opentau\n",
           f"```bash\nopentau serve {pinned} --port 8000            # openpi's websocket protocol (openpi-client)\n"
           f"opentau eval {pinned} --dataset.root=DATASET    # action error on your episodes\n```\n"]
    if f.layout == LEROBOT:
        kind = f.config.policy.type
        policy = f"{kind.upper()}Policy"
        # LeRobot 0.4.4's pi0 / pi05 from_pretrained read the weights from the default branch whatever `revision`
        # says: another branch (or a commit) is loaded from the folder snapshot_download gives.
        fetch = "" if f.branch == "main" else (
            f'from huggingface_hub import snapshot_download\n\nfolder = snapshot_download("{f.repo_id}", revision="{f.branch}")\n')
        repo = f'"{f.repo_id}"' if f.branch == "main" else "folder"
        processors = "\n".join(f'{step} = PolicyProcessorPipeline.from_pretrained({repo}, config_filename="policy_{step}or.json")'
                                for step in ("preprocess", "postprocess"))
        out += ["### LeRobot\n",
                f"```python\nfrom lerobot.policies.{kind}.modeling_{kind} import {policy}\n"
                f"from lerobot.processor import PolicyProcessorPipeline\n{fetch}\n"
                f"policy = {policy}.from_pretrained({repo})\n{processors}\n```\n",
                f"To pin a commit, load a folder: `huggingface_hub.snapshot_download(\"{f.repo_id}\", revision=COMMIT)`: "
                f"LeRobot 0.4.4's `{policy}.from_pretrained` reads the weights from the default branch whatever its "
                "`revision` says.\n",
                "For openpi, export the checkpoint again with `--layout openpi`.\n"]
    elif f.layout == OPENPI:
        rev = "" if f.branch == "main" else f" --revision {f.branch}"
        out += ["### openpi\n",
                f"```bash\nhf download {f.repo_id}{rev} --local-dir checkpoints/{f.repo_id.partition('/')[2]}"
                "    # --revision COMMIT pins it\n```\n",
                "Then `openpi.policies.policy_config.create_trained_policy(train_config, that_dir)`: openpi's PyTorch "
                f"path loads `model.safetensors`, and the normalization statistics from `assets/{f.asset}/norm_stats.json`: "
                f'set your training config\'s asset id to "{f.asset}".\n',
                "For LeRobot, export the checkpoint again with `--layout lerobot`.\n"]
    else:
        out.append("For LeRobot or openpi, export the checkpoint again with `--layout lerobot` or `--layout openpi`.\n")
    out.append(f"To fine-tune from it with opentau: `--policy.pretrained_path={pinned}`.\n")
    return "\n".join(out)
