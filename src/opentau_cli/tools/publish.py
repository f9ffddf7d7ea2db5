"""`checkpoint export --push-to-hub USER/REPO[@BRANCH]`: a verified checkpoint exported in a published layout, with
its model card (tools/model_card.py) and its eval plot, pushed to a Hugging Face Hub model repo as one commit through
huggingface_hub's own upload API (docs/ARCHITECTURE.md, "Publishing to the Hub").

- One commit per push (`HfApi.create_commit`): the Hub uploads the large files first and makes them visible only with
  the commit, so a push that fails midway leaves the branch where it was. The commit names its parent (the head the
  push checked), so a push that raced another one is refused rather than mixed with it.
- Everything a user can get wrong is found before anything is written to the Hub (UserError, exit 2): a repo id that
  is not USER/NAME, no token, a checkpoint that fails its manifest, an eval of another checkpoint, a repo holding
  files the export does not replace (unless --force, which keeps them and names them). The one file a push removes
  is an earlier push's eval plot when this checkpoint has no eval (its card would not describe it), and it says so.
- The token comes from the Hub's own sources (HF_TOKEN, the token file `hf auth login` writes; huggingface_hub's
  `get_token`), is handed to `HfApi` in memory and never written anywhere.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from opentau_cli.errors import RunError, UserError

GITATTRIBUTES = ".gitattributes"  # the Hub writes it into every new repo
EVAL_ROOT = Path("outputs") / "eval"  # where `opentau eval` writes by default: searched for this checkpoint's eval


@dataclass
class Target:
    repo_id: str
    branch: str

    def __str__(self) -> str:
        return self.repo_id if self.branch == "main" else f"{self.repo_id}@{self.branch}"


@dataclass
class Pushed:
    target: Target
    commit: str
    url: str
    files: list[str]
    total_bytes: int
    step: int | None
    layout: str
    weights: str
    unchanged: bool = False  # the branch already held exactly these files: no commit was made
    kept: list[str] = field(default_factory=list)  # files of the repo the export did not replace (--force)
    removed: list[str] = field(default_factory=list)  # an earlier push's eval plot, which this push's card does not show
    created: bool = False
    eval_dir: Path | None = None


def parse_target(text: str) -> Target:
    """USER/REPO or USER/REPO@BRANCH (UserError otherwise)."""
    from huggingface_hub import constants

    from opentau_cli.store.hub import parse_repo_id

    parsed = parse_repo_id(text)
    if parsed is None:
        raise UserError(f"--push-to-hub {text}: not a Hugging Face repo id USER/NAME or USER/NAME@BRANCH.")
    repo_id, branch = parsed
    if branch and constants.REGEX_COMMIT_OID.fullmatch(branch):
        raise UserError(f"--push-to-hub {text}: '{branch}' is a commit, and a push goes to a branch: name one.")
    return Target(repo_id, branch or "main")


def hub_token() -> str:
    """The token from the Hub's standard sources (HF_TOKEN, then `hf auth login`'s token file)."""
    from huggingface_hub import constants, get_token

    if constants.HF_HUB_OFFLINE:
        raise UserError("--push-to-hub: HF_HUB_OFFLINE is set, and a push needs the Hub: unset it.")
    token = get_token()
    if not token:
        raise UserError("--push-to-hub: no Hugging Face token: set HF_TOKEN or run `hf auth login` (with a token that "
                        "may write to the repo).")
    return token


def verified(target: Path) -> tuple[Path, str]:
    """The checkpoint `target` names (RUN, RUN:STEP, RUN:best or a checkpoint directory) re-hashed against its
    manifest, and the xxh3-128 of that manifest (what the commit message names). UserError when it fails."""
    from opentau_cli.store.layout import MANIFEST
    from opentau_cli.store.runs import find_checkpoint
    from opentau_cli.store.manifest import hash_file, verify_manifest

    ckpt = find_checkpoint(Path(str(target)))
    problems = verify_manifest(ckpt)
    if problems:
        more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
        raise UserError(f"{ckpt} fails verification ({problems[0]}{more}), so it is not pushed: push a checkpoint that "
                        f"`opentau checkpoint verify` passes.")
    return ckpt, hash_file(ckpt / MANIFEST)


def find_eval(ckpt: Path, manifest_xxh3: str, weights: str, given: Path | None) -> Path | None:
    """The directory of `opentau eval`'s output for this checkpoint's `weights`: `given` (refused when it evaluated
    something else), else the newest one under outputs/eval/ that names this checkpoint's manifest; None if none."""
    if given is not None:
        report = _eval_report(Path(given))
        if report is None:
            raise UserError(f"--eval {given}: no readable eval.json there (an `opentau eval` output directory).")
        why = _not_of(report, ckpt, manifest_xxh3, weights)
        if why:
            raise UserError(f"--eval {given}: {why}, so it is not this push's evaluation.")
        return Path(given)
    found = sorted(EVAL_ROOT.glob("*/eval.json"), key=lambda p: p.stat().st_mtime, reverse=True) if EVAL_ROOT.is_dir() else []
    for path in found:
        report = _eval_report(path.parent)
        if report is not None and not _not_of(report, ckpt, manifest_xxh3, weights):
            return path.parent
    return None


def _eval_report(directory: Path) -> dict | None:
    from opentau_cli.tools.evaluate import EVAL_JSON

    try:
        report = json.loads((directory / EVAL_JSON).read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and "policy" in report else None


def _not_of(report: dict, ckpt: Path, manifest_xxh3: str, weights: str) -> str | None:
    """Why an eval.json is not of this checkpoint's weights (None: it is)."""
    if report.get("manifest_xxh3") != manifest_xxh3:
        evaluated = (report.get("checkpoint") or {}).get("path") or report.get("model") or "another model"
        return f"it evaluated {evaluated}, not {ckpt}"
    if report.get("weights") != weights:
        return f"it evaluated the {report.get('weights')} weights, and the push holds the {weights} weights"
    return None


# ------------------------------------------------------------------------------------------- the remote side
@dataclass
class Remote:
    """What the target holds before the push."""

    exists: bool
    private: bool = False
    branch_exists: bool = False
    head: str | None = None  # the commit the push goes on top of (the branch's, or main's for a new branch)
    files: list[str] = field(default_factory=list)


def remote_state(api, target: Target) -> Remote:
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = api.model_info(target.repo_id, revision=target.branch)
        branch = True
    except RepositoryNotFoundError:
        return Remote(False)
    except RevisionNotFoundError:  # a new branch starts at main's head
        info, branch = api.model_info(target.repo_id), False
    return Remote(True, bool(info.private), branch, info.sha, sorted(s.rfilename for s in info.siblings or []))


def _refused_token(exc: Exception, target: Target, doing: str) -> UserError | None:
    """The Hub refusing the token (401), its right to write the repo (403), or a repo it cannot see (409 on creating
    one of that name): the user's to fix."""
    from huggingface_hub.errors import HfHubHTTPError

    status = exc.response.status_code if isinstance(exc, HfHubHTTPError) and exc.response is not None else None
    if status == 401:
        return UserError(f"The Hub refused the Hugging Face token while {doing} {target} ({_first_line(exc)}): check "
                         "HF_TOKEN or run `hf auth login`.")
    if status == 403:
        return UserError(f"The token may not write to {target.repo_id} ({_first_line(exc)}): use a token with write "
                         "access to it, or push to a repo of your own.")
    if status == 409 and doing == "creating":  # the Hub hid it from this token: another account's private repo
        return UserError(f"{target.repo_id} exists, and this token cannot see it (a private repo of another account?): "
                         "push to a repo of your own, or use a token that can read and write it.")
    return None


@contextlib.contextmanager
def _hub_errors(target: Target, doing: str):
    """The Hub's answers as one sentence: a refused token is the user's to fix (exit 2), anything else a failure
    (exit 1)."""
    try:
        yield
    except (UserError, RunError):
        raise
    except Exception as exc:  # the Hub's HTTP errors, the client's connection and timeout errors
        refused = _refused_token(exc, target, doing)
        if refused is not None:
            raise refused from None
        raise RunError(f"Talking to the Hub failed while {doing} {target} ({type(exc).__name__}: {_first_line(exc)}).") from None


# ------------------------------------------------------------------------------------------- the push
def push(checkpoint, target_text: str, *, layout: str, dtype: str = "fp32", dataset: str | None = None,
         weights: str | None = None, private: bool = False, force: bool = False, output: Path | None = None,
         eval_dir: Path | None = None, locate=str, echo=print) -> Pushed:
    """Export `checkpoint` in `layout` (into `output` when given, else a temporary directory) and push it with its
    card to `target_text` as one commit; `locate` gives the local path of `checkpoint` (a remote run's verified copy).
    Raises UserError before anything is written to the Hub, RunError after."""
    from huggingface_hub import HfApi, constants

    from opentau_cli.tools.consolidate import wants_ema
    from opentau_cli.tools.export import export
    from opentau_cli.tools.model_card import EVAL_PLOT

    target = parse_target(target_text)
    token = hub_token()
    ckpt, digest = verified(locate(str(checkpoint)))
    kind = "ema" if wants_ema(ckpt, weights) else "live"
    evaluated = find_eval(ckpt, digest, kind, eval_dir)
    api = HfApi(token=token)
    with _hub_errors(target, "reading"):
        remote = remote_state(api, target)
    if private and remote.exists and not remote.private:
        raise UserError(f"--private: {target.repo_id} exists and is public; change its visibility on the Hub, or push "
                        "without --private.")
    with tempfile.TemporaryDirectory(prefix="opentau-push-") as scratch:
        out = Path(output) if output is not None else Path(scratch) / "export"
        result = export(ckpt, out, layout=layout, dtype=dtype, dataset=dataset, force=force, weights=kind)
        upload = {f.relative_to(result.output).as_posix(): f for f in result.files}
        upload.update(_card(ckpt, digest, target, layout, result, evaluated, Path(scratch), upload))
        # An earlier push's eval plot goes when this checkpoint has none: the card would not describe it.
        removed = [EVAL_PLOT] if EVAL_PLOT in remote.files and EVAL_PLOT not in upload else []
        kept = sorted(set(remote.files) - set(upload) - {GITATTRIBUTES, *removed})
        if kept and not force:
            raise UserError(f"{target.repo_id} holds {len(kept)} file(s) the export does not replace "
                            f"({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}); nothing was pushed: push to "
                            "another repo, or pass --force to push beside them (they are kept, never deleted).")
        pushed = Pushed(target, "", "", sorted(upload), sum(p.stat().st_size for p in upload.values()), result.step,
                        layout, result.weights, kept=kept, removed=removed, created=not remote.exists,
                        eval_dir=evaluated)
        message = (f"opentau {layout} export of {_run_name(ckpt)} step {result.step} ({result.weights} weights), "
                   f"checkpoint manifest xxh3-128 {digest}")
        _commit(api, target, remote, upload, message, private, pushed, echo)
    pushed.url = f"{constants.ENDPOINT}/{target.repo_id}/tree/{pushed.commit}"
    return pushed


def _commit(api, target: Target, remote: Remote, upload: dict[str, Path], message: str, private: bool, pushed: Pushed,
            echo) -> None:
    """Create the repo and the branch if needed, then one commit on top of the head the checks saw."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    head, branch_exists = remote.head, remote.branch_exists
    with _hub_errors(target, "creating"):
        if not remote.exists:
            api.create_repo(target.repo_id, private=private)
            head, branch_exists = api.model_info(target.repo_id).sha, target.branch == "main"
        if not branch_exists:
            api.create_branch(target.repo_id, branch=target.branch, revision=head)
    operations = [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path)) for rel, path in sorted(upload.items())]
    operations += [CommitOperationDelete(path_in_repo=rel) for rel in pushed.removed]
    echo(f"Pushing {len(operations)} files ({pushed.total_bytes / 1e6:.1f} MB) to {target} as one commit...")
    try:
        info = api.create_commit(target.repo_id, operations, commit_message=message, revision=target.branch,
                                 parent_commit=head, commit_description=_description(pushed))
    except Exception as exc:  # whatever the uploads or the commit raised: the Hub made no commit
        echo("")  # the upload's progress bars stop mid-line
        refused = _refused_token(exc, target, "pushing to")
        if refused is not None:
            raise refused from None
        what = _first_line(exc) + (f": {_first_line(exc.__cause__)}" if exc.__cause__ is not None else "")
        raise RunError(f"Pushing to {target} failed ({what}); no commit was made and {target.branch} still points at "
                       f"{head}: run the command again.") from None
    pushed.commit, pushed.unchanged = info.oid, info.oid == head


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _description(pushed: Pushed) -> str:
    return (f"Exported by `opentau checkpoint export --layout {pushed.layout} --push-to-hub`: {len(pushed.files)} files "
            f"({', '.join(pushed.files)}).")


def _run_name(ckpt: Path) -> str:
    """The run's directory name; for a cached copy of a checkpoint in remote storage, the run's URL."""
    from opentau_cli.store.runs import run_dir_of
    from opentau_cli.tools.remote import remote_origin

    remote = remote_origin(ckpt)
    return remote["url"] if remote is not None else run_dir_of(ckpt).name


def _card(ckpt: Path, digest: str, target: Target, layout: str, result, evaluated: Path | None, scratch: Path,
          upload: dict[str, Path]) -> dict[str, Path]:
    """README.md (and the eval plot) for `upload`: {path in the repo: local file}, written under `scratch`."""
    from opentau_cli.store.layout import TRAIN_CONFIG
    from opentau_cli.store.runs import read_training_state
    from opentau_cli.config.load import load_config
    from opentau_cli.data.mixture import select_member
    from opentau_cli.tools.evaluate import EVAL_PLOT as LOCAL_PLOT
    from opentau_cli.tools.model_card import CARD, EVAL_PLOT, CardFacts, base_model, render

    config = load_config(ckpt / TRAIN_CONFIG, {})
    extra = {}
    plot = evaluated / LOCAL_PLOT if evaluated is not None else None
    if plot is not None and plot.is_file():
        extra[EVAL_PLOT] = plot
    metadata = _export_metadata(result.output)
    facts = CardFacts(
        repo_id=target.repo_id, branch=target.branch, layout=layout, config=config, state=read_training_state(ckpt),
        run=_run_name(ckpt), checkpoint=ckpt.name, manifest_xxh3=digest, weights=result.weights,
        dataset=metadata.get("dataset") or select_member(config, None).label, base=base_model(config.policy.pretrained_path),
        eval=_eval_report(evaluated) if evaluated is not None else None, eval_plot=EVAL_PLOT if extra else None,
        simulator=_simulator_record(ckpt),
        asset=next((p.split("/")[1] for p in upload if p.startswith("assets/")), None),
        files=sorted([*upload, *extra, CARD]))
    card = scratch / CARD
    card.write_text(render(facts))
    return {CARD: card, **extra}


def _simulator_record(ckpt: Path) -> dict | None:
    """The checkpoint's evaluation in eval.env during training (store/evals.py), when it has a done one."""
    from opentau_cli.store import evals
    from opentau_cli.store.runs import run_dir_of

    record = evals.read_record(run_dir_of(ckpt), ckpt.name)
    return record if record and record.get("status") == evals.DONE else None


def _export_metadata(output: Path) -> dict:
    from safetensors import safe_open

    from opentau_cli.store.layout import MODEL_WEIGHTS

    with safe_open(str(output / MODEL_WEIGHTS), framework="pt") as handle:
        return handle.metadata() or {}

