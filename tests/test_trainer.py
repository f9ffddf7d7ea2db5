"""The unit-level pieces of the training loop, in this process: the learning-rate schedule, one step with its
collectives and timer, metrics collection (a real single-process Accelerator on CPU), and metrics truncation on resume."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import EXAMPLES
from opentau_cli.config import AccelerateSetup, load_config
from opentau_cli.profiling.phases import PhaseTimer
from opentau_cli.train.metrics import Progress, truncate_metrics
from opentau_cli.train.timing import PHASES
from opentau_cli.train.trainer import Trainer, lr_lambda, make_accelerator

pytestmark = pytest.mark.quick

TINY = EXAMPLES / "pi05_tiny_config.json"


def schedule(**overrides):
    cfg = load_config(TINY, {"optimizer.lr": "1e-3", "scheduler.decay_lr": "1e-4", **overrides})
    return lr_lambda(cfg)


def test_warmup_rises_linearly_then_the_cosine_falls_from_lr_to_decay_lr_over_the_run():
    factor = schedule(**{"steps": "20", "scheduler.warmup_steps": "4"})
    assert [factor(s) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factor(4) == pytest.approx(1.0)  # the cosine starts at lr
    assert factor(12) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: halfway between lr and decay_lr
    assert factor(20) == pytest.approx(0.1)  # decay_lr / lr at the last step
    assert factor(100) == pytest.approx(0.1)  # and it stays there


def test_decay_steps_end_the_cosine_before_the_run_ends():
    factor = schedule(**{"steps": "100", "scheduler.warmup_steps": "0", "scheduler.decay_steps": "10"})
    assert factor(0) == pytest.approx(1.0)
    assert factor(5) == pytest.approx(0.55)
    assert factor(10) == pytest.approx(0.1) and factor(50) == pytest.approx(0.1)


def test_constant_schedule_keeps_lr_after_the_warmup():
    factor = schedule(**{"steps": "50", "scheduler.type": "constant", "scheduler.warmup_steps": "1"})
    assert factor(0) == pytest.approx(0.5)
    assert {factor(s) for s in (1, 10, 49, 500)} == {1.0}


class KnownTerms(torch.nn.Module):
    """A policy stand-in whose loss terms are the numbers its batch carries, so their means are known exactly.
    Its one weight gets a zero gradient: the optimizer, clipping and schedule run, nothing drifts."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, batch):
        x = batch["x"].mean()
        return {"loss": x + 0.0 * self.w.sum(), "l1": 2 * x, "not_a_term": batch["x"]}


@pytest.fixture
def make_trainer():
    """Trainers over a real single-process CPU Accelerator; Accelerate's process-wide state is reset afterwards."""
    from accelerate.state import AcceleratorState, GradientState

    def make(values: list[float], **overrides) -> Trainer:
        cfg = load_config(TINY, {"steps": "100", "log_freq": "100", **overrides})
        setup = AccelerateSetup()
        accelerator = make_accelerator(cfg, setup)
        model = KnownTerms()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        batches = iter([{"x": torch.full((2,), float(v))} for v in values])
        return Trainer(cfg=cfg, setup=setup, accelerator=accelerator, model=model, optimizer=optimizer,
                       scheduler=scheduler, data=SimpleNamespace(stream=batches, remote=False))

    yield make
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_each_log_step_collects_the_mean_of_each_loss_term_since_the_previous_one(make_trainer):
    trainer = make_trainer([1, 2, 3, 10, 20, 30], log_freq="3", **{"scheduler.warmup_steps": "2"})
    records = [trainer.train_step().record for _ in range(6)]
    assert [r is None for r in records] == [True, True, False, True, True, False]
    first, second = records[2], records[5]
    assert (first["kind"], first["step"], first["loss"], first["l1"]) == ("train", 3, 2.0, 4.0)
    assert (second["step"], second["loss"], second["l1"]) == (6, 20.0, 40.0)  # steps 4-6 only
    assert "not_a_term" not in first  # only scalar outputs are loss terms
    assert first["samples_seen"] == 3 * 8 and second["samples_seen"] == 6 * 8
    assert first["lr"] == pytest.approx(1e-3 * lr_lambda(trainer.cfg)(3))  # one scheduler step per optimizer step
    assert first["grad_norm"] == 0.0 and first["samples_per_s"] > 0
    assert trainer.step == 6 and trainer.samples_seen == 48


def test_gradient_accumulation_averages_the_loss_terms_over_the_micro_batches(make_trainer):
    trainer = make_trainer([1, 3, 5, 7], gradient_accumulation_steps="2", log_freq="1")
    first, second = trainer.train_step().record, trainer.train_step().record
    assert (first["step"], first["loss"]) == (1, 2.0) and (second["step"], second["loss"]) == (2, 6.0)
    assert second["samples_seen"] == 2 * 8  # batch_size counts every micro-batch of a step
    assert trainer.scheduler.scheduler.last_epoch == 2  # the schedule steps once per optimizer step


def test_the_last_step_of_the_run_is_always_a_log_step(make_trainer):
    trainer = make_trainer([1, 2, 4], steps="3", log_freq="2")
    records = [trainer.train_step().record for _ in range(3)]
    assert [r and r["step"] for r in records] == [None, 2, 3]
    assert records[2]["loss"] == 4.0


def test_a_stop_requested_on_a_rank_comes_back_from_the_step(make_trainer):
    trainer = make_trainer([1, 2])
    assert trainer.train_step().stop is False
    assert trainer.train_step(stop_requested=True).stop is True


def test_the_step_drives_the_timer_through_every_phase_and_ends_after_its_collectives(make_trainer):
    trainer = make_trainer([1, 2, 3], log_freq="2")
    timer = PhaseTimer()
    for _ in range(3):
        trainer.train_step(timer)
    assert len(timer.steps) == 3
    for step in timer.steps:
        assert all(step[p] > 0 for p in PHASES), step  # sync: the stop agreement runs every step
        assert sum(step[p] for p in PHASES) <= step["total"]


def test_truncate_metrics_drops_records_past_the_checkpoint_and_lines_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": s, "loss": 1.0 / s}) for s in (1, 2, 3, 4)]
    lines.insert(3, json.dumps({"kind": "val", "step": 3, "val_loss": 0.5}))
    path.write_text("\n".join(lines) + '\n{"kind": "train", "st')  # the run was killed mid-line
    truncate_metrics(path, 3)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in kept] == [("train", 1), ("train", 2), ("train", 3), ("val", 3)]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # replaced whole, no temporary left


def test_truncate_metrics_without_a_metrics_file_writes_nothing(tmp_path):
    truncate_metrics(tmp_path / "metrics.jsonl", 3)
    assert list(tmp_path.iterdir()) == []


RECORD = {"loss": 0.5, "lr": 1e-4, "grad_norm": 1.0, "samples_per_s": 2.0}


def progress_lines(**kwargs) -> list[str]:
    console = io.StringIO()
    progress = Progress(10, 0, console, "plain", **kwargs)
    progress.update(5, RECORD)
    progress.update(6, None)  # not a log step: no line
    progress.close()
    return console.getvalue().splitlines()


def test_an_automatically_restarted_run_says_which_restart_on_its_progress_line():
    (line,) = progress_lines(restarts=2)
    assert line.startswith("step 5/10  restart 2  loss 0.5000")


def test_a_run_never_restarted_shows_no_restart_on_its_progress_line():
    (line,) = progress_lines()
    assert line.startswith("step 5/10  loss 0.5000") and "restart" not in line
