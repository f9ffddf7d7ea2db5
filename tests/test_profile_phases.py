"""PhaseTimer: the timer `opentau profile` hands to TRAIN's step."""

from __future__ import annotations

import time

import pytest

from opentau_cli.profiling.phases import PhaseTimer
from opentau_cli.train.timing import PHASES

pytestmark = pytest.mark.quick


def test_phases_are_recorded_per_step_and_add_up_to_the_step_total():
    timer = PhaseTimer()
    for _ in range(2):
        with timer.phase("data"):
            time.sleep(0.01)
        with timer.phase("forward"):
            time.sleep(0.02)
        with timer.phase("backward"):
            time.sleep(0.03)
        timer.end_step()
    assert len(timer.steps) == 2
    for step in timer.steps:
        assert set(PHASES) | {"total"} == set(step)
        assert step["data"] >= 0.01 and step["forward"] >= 0.02 and step["backward"] >= 0.03
        assert step["optimizer"] == 0.0
        phase_sum = sum(step[name] for name in PHASES)
        assert phase_sum <= step["total"]
        assert phase_sum == pytest.approx(step["total"], rel=0.1)


def test_time_between_steps_counts_in_the_next_step_total():
    timer = PhaseTimer()
    with timer.phase("data"):
        pass
    timer.end_step()
    time.sleep(0.05)  # e.g. logging outside any phase
    with timer.phase("data"):
        pass
    timer.end_step()
    assert timer.steps[1]["total"] >= 0.05
    assert timer.steps[1]["data"] < 0.05


def test_repeated_phase_in_one_step_is_summed():
    timer = PhaseTimer()
    for _ in range(3):  # e.g. gradient accumulation micro-batches
        with timer.phase("forward"):
            time.sleep(0.01)
    timer.end_step()
    assert timer.steps[0]["forward"] >= 0.03


def test_sync_is_called_at_both_boundaries_of_every_phase():
    calls = []
    timer = PhaseTimer(sync=lambda: calls.append(1))
    with timer.phase("forward"):
        assert len(calls) == 1
    with timer.phase("backward"):
        pass
    assert len(calls) == 4


def test_nested_phases_are_refused():
    timer = PhaseTimer()
    with timer.phase("forward"):
        with pytest.raises(RuntimeError, match="inside phase 'forward'"):
            with timer.phase("backward"):
                pass


def test_reset_forgets_warmup_steps():
    timer = PhaseTimer()
    with timer.phase("data"):
        pass
    timer.end_step()
    timer.reset()
    assert timer.steps == []
    time.sleep(0.05)
    with timer.phase("data"):
        pass
    timer.end_step()
    assert timer.steps[0]["total"] < 0.05


def test_custom_phase_names_are_kept():
    timer = PhaseTimer()
    with timer.phase("validation"):
        pass
    timer.end_step()
    assert "validation" in timer.steps[0]


def test_phase_time_is_recorded_even_when_the_body_raises():
    timer = PhaseTimer()
    with pytest.raises(ValueError):
        with timer.phase("forward"):
            time.sleep(0.01)
            raise ValueError("boom")
    timer.end_step()
    assert timer.steps[0]["forward"] >= 0.01
