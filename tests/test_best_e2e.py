"""checkpoint.keep_best through the installed CLI: one single-process run with an EMA of the weights, validated and
saved every step with keep_last=1 and keep_best=2 and the default best_metric; the kept checkpoints, checkpoints/best
(ranked on the EMA weights, which export / eval / serve use by default), and `RUN:best` in export, eval and serve,
each recording which weights of which step it used.
(Which checkpoints win for a metric that rises and falls is tested in-process: tests/test_lineage.py; live and EMA
rankings that disagree: tests/test_ema.py.)"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from conftest import EXAMPLES, SINGLE_PROCESS_ENV, run_cli, run_cli_in_process
from opentau_cli.store.layout import BEST, CHECKPOINTS, METRICS, MODEL_WEIGHTS, TRAIN_CONFIG, TRAINING_STATE

pytestmark = [pytest.mark.full, pytest.mark.e2e, pytest.mark.usefixtures("one_thread_module")]

STEPS = 6


def ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("best")
    env = {"HF_HOME": str(tmp / "hf_home")}
    out = tmp / "run"
    ok(run_cli(["train", f"--config_path={EXAMPLES / 'pi05_tiny_config.json'}", f"--output_dir={out}", "--steps", str(STEPS),
                "--save_freq=1", "--log_freq=1", "--batch_size=4", "--validation.val_split=0.25", "--validation.val_freq=1",
                "--validation.max_batches=2", "--checkpoint.keep_last=1", "--checkpoint.keep_best=2", "--ema.decay=0.5"],
               env={**env, **SINGLE_PROCESS_ENV}))
    return tmp, out, env


def _validations(out) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / METRICS).read_text().splitlines()) if r.get("kind") == "val"}


def test_the_two_best_by_the_ema_weights_val_loss_and_the_newest_are_kept_and_best_points_at_the_best(run):
    from opentau_cli.config import load_config

    _, out, _ = run
    val = _validations(out)
    assert sorted(val) == list(range(1, STEPS + 1))
    ranked = sorted(val, key=lambda s: (val[s]["ema_val_loss"], -s))
    kept = sorted(p.name for p in (out / CHECKPOINTS).iterdir() if p.name.isdigit())
    assert kept == sorted({f"{s:06d}" for s in ranked[:2]} | {f"{STEPS:06d}"})
    assert (out / CHECKPOINTS / BEST).resolve().name == f"{ranked[0]:06d}"
    for name in kept:  # each checkpoint carries the validation of its step, as metrics.jsonl logged it
        state = json.loads((out / CHECKPOINTS / name / TRAINING_STATE).read_text())
        assert state["validation"] == val[int(name)]
        # The default (null) resolved before launch and recorded, so a resume ranks as this run did.
        assert json.loads((out / CHECKPOINTS / name / TRAIN_CONFIG).read_text())["checkpoint"]["best_metric"] == "ema_val_loss"
    # The keys a best_metric may name are those validation reported.
    cfg = load_config(out / CHECKPOINTS / kept[-1] / TRAIN_CONFIG, {})
    assert sorted(val[STEPS]) == sorted(["kind", "step", "val_batches", *cfg.validation_keys()])


def test_export_eval_and_serve_take_run_best_and_record_its_weights_and_step(run):
    from opentau_cli.tools.export import export
    from opentau_cli.tools.serve import load_served

    tmp, out, env = run
    best = (out / CHECKPOINTS / BEST).resolve()
    step = int(best.name)
    # In-process: export, eval and serve launch nothing (the run above is the launch).
    ok(run_cli_in_process(["checkpoint", "export", f"{out}:best", "--output", str(tmp / "by_name")], env=env))
    ok(run_cli_in_process(["checkpoint", "export", str(best), "--output", str(tmp / "by_dir")], env=env))
    assert (tmp / "by_name" / MODEL_WEIGHTS).read_bytes() == (tmp / "by_dir" / MODEL_WEIGHTS).read_bytes()
    config = json.loads((tmp / "by_name" / "config.json").read_text())
    assert config["opentau"] == {"weights": "ema", "step": step}
    with safe_open(str(tmp / "by_name" / MODEL_WEIGHTS), framework="pt") as f:
        assert (f.metadata()["weights"], f.metadata()["step"]) == ("ema", str(step))
    live = export(f"{out}:best", tmp / "live", weights="live")
    assert (live.weights, live.step, live.checkpoint) == ("live", step, best)
    assert json.loads((tmp / "live" / "config.json").read_text())["opentau"] == {"weights": "live", "step": step}

    evaluated = ok(run_cli_in_process(["eval", f"{out}:best", "--output", str(tmp / "eval_best"), "--device", "cpu",
                                       "--stride", "10", "--plot-episodes", "0"], env=env))
    assert f"on cpu with the EMA weights of step {step} ({best})..." in evaluated.stderr
    report = json.loads((tmp / "eval_best" / "eval.json").read_text())
    assert report["weights"] == "ema" and report["step"] == step
    assert report["checkpoint"] == {"path": str(best), "step": step, "resolved_from": f"{out}:best"}
    # The export, evaluated as a model, says what it was exported from.
    ok(run_cli_in_process(["eval", str(tmp / "live"), "--output", str(tmp / "eval_live"), "--device", "cpu", "--stride", "10",
                "--plot-episodes", "0", f"--dataset.root={report['dataset']}"], env=env))
    model = json.loads((tmp / "eval_live" / "eval.json").read_text())
    assert (model["weights"], model["step"], model["model"]) == ("live", step, str(tmp / "live"))

    served = load_served(f"{out}:best", device="cpu")
    meta = served.metadata()
    assert (meta["weights"], meta["step"]) == ("ema", step)
    assert meta["checkpoint"] == {"path": str(best), "step": step, "resolved_from": f"{out}:best"}
    assert served.describe() == f"EMA weights of step {step} ({best})"

    missing = run_cli_in_process(["checkpoint", "export", f"{tmp / 'nowhere'}:best", "--output", str(tmp / "x")], env=env)
    assert missing.returncode == 2 and "keep_best" in missing.stderr and "Traceback" not in missing.stderr


def test_serve_run_best_with_each_weights_answers_the_chunk_of_those_weights_read_from_the_checkpoint_files(run):
    """`serve RUN:best` (EMA by default) and `--weights live` answer a request with the chunk of the weights the test
    reads itself from the best checkpoint's files (model.safetensors; ema.safetensors over its trained parameters),
    sampled by the same serving code; the two differ."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from opentau_cli.config.load import load_config
    from opentau_cli.policies import build_policy
    from opentau_cli.tools.serve import ServedPolicy, load_served

    _, out, _ = run
    best = (out / CHECKPOINTS / BEST).resolve()
    served = {w: load_served(f"{out}:best", device="cpu", weights=w) for w in ("ema", "live")}
    cfg = load_config(best / TRAIN_CONFIG, {})
    ema = load_file(str(best / "ema.safetensors"))
    rng = np.random.default_rng(0)
    obs = {**{c: rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for c in served["ema"].cameras if c},
           served["ema"].state_key: rng.normal(size=served["ema"].state_width).astype(np.float32), "prompt": "reach"}
    chunks = {}
    for weights, use in served.items():
        policy = build_policy(cfg.policy)
        policy.load_state_dict(load_file(str(best / MODEL_WEIGHTS)))
        if weights == "ema":
            with torch.no_grad():
                for name, p in policy.named_parameters():
                    if name in ema:
                        p.copy_(ema[name])
        mine = ServedPolicy(policy.eval(), use.cameras, use.state_key, "test")
        chunks[weights] = use.infer(obs)["actions"]
        assert np.array_equal(chunks[weights], mine.infer(obs)["actions"]), weights
    assert not np.array_equal(chunks["ema"], chunks["live"])
