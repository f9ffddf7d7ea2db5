"""`opentau profile` end to end: the real CLI, the real launcher, the tiny preset on the demo data."""

from __future__ import annotations

import json

import pytest

from conftest import EXAMPLES, run_cli, run_cli_in_process

pytestmark = [pytest.mark.full, pytest.mark.slow]  # a minute or more: starts first (tests/conftest.py)

TINY = str(EXAMPLES / "pi05_tiny_config.json")
# One thread per worker: on a busy 2-core CI box, two spinning OpenMP threads per process slow a step down 5-10x.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def test_dataloader_only_measures_samples_per_s_without_importing_the_policy(isolated_env):
    out = isolated_env / "dl.json"
    r = run_cli(["profile", f"--config_path={TINY}", "--dataloader-only", "--steps", "6", "--warmup", "1", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    assert "samples/s (ceiling)" in r.stdout
    report = json.loads(out.read_text())
    assert report["mode"] == "dataloader_only"
    assert report["model_built"] is False and report["policy_imported"] is False
    assert report["measured_batches"] == 6 and report["batch_size"] == 8
    assert report["samples_per_s"] == pytest.approx(report["batches_per_s"] * 8)
    assert report["samples_per_s"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataloader-only", "--compare", "a.yaml,b.yaml"], "cannot be combined with --compare"),
        (["--find-max-batch"], "needs --memory-limit"),
        (["--compare", "missing.yaml"], "'missing.yaml' (in --compare) not found"),
        (["--memory-limit", "4GB"], "--memory-limit applies to --find-max-batch only"),
        (["--find-max-batch", "--memory-limit", "lots"], "is not a size"),
        (["--steps", "3", "--policy.chunk_sise=4"], "did you mean 'policy.chunk_size'"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(isolated_env, args, message):
    r = run_cli(["profile", f"--config_path={TINY}", *args], cwd=isolated_env)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert list(isolated_env.glob("outputs*")) == []


SINGLE_YAML = "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\nmixed_precision: 'no'\n"


def test_compare_on_two_cpu_configs_gives_two_rows_full_reports_and_phases_that_add_up(isolated_env):
    from opentau_cli.profiling.stats import REPORT_FIELDS
    from opentau_cli.train.timing import PHASES

    single = isolated_env / "single.yaml"
    single.write_text(SINGLE_YAML)
    ddp = EXAMPLES / "accelerate_cpu_ddp_config.yaml"
    out = isolated_env / "compare.json"
    r = run_cli(
        ["profile", f"--config_path={TINY}", "--compare", f"{single},{ddp}", "--steps", "4", "--warmup", "1",
         "--json", str(out), "--log_freq=2"],
        cwd=isolated_env,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "single.yaml" in r.stdout and "accelerate_cpu_ddp_config.yaml" in r.stdout
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [row["world_size"] for row in rows] == [1, 2]
    assert [row["backend"] for row in rows] == ["single process", "DDP"]
    assert rows[0]["speedup"] == 1.0
    assert rows[1]["speedup"] == pytest.approx(rows[1]["samples_per_s"] / rows[0]["samples_per_s"])
    for rep in report["reports"]:
        assert set(rep) == set(REPORT_FIELDS) | {"warnings"}
        assert rep["measured_steps"] == 4
        assert len(rep["peak_memory"]) == rep["world_size"]
        assert all(m["kind"] == "process_peak_rss" and m["bytes"] > 50 << 20 for m in rep["peak_memory"])
        assert rep["flops_per_sample"] > 0  # counted on the warm-up step
        assert rep["mfu"] is None  # a CPU's peak is unknown
        phases = rep["phases"]
        timed = sum(phases[p]["mean_s"] for p in PHASES)
        assert timed == pytest.approx(phases["total"]["mean_s"], rel=0.10)
        for p in ("data", "forward", "backward", "optimizer", "zero_grad_sched", "sync"):
            assert phases[p]["mean_s"] > 0, p  # log_freq=2: the metric gather ran in the measured steps
        assert rep["samples_per_s"] == pytest.approx(rep["steps_per_s"] * rep["global_batch_size"])
    assert report["reports"][1]["global_batch_size"] == 16  # 8 per process x 2
    # Nothing was checkpointed and no scratch run dir is left behind.
    assert not list(isolated_env.rglob("checkpoints"))


def test_profile_refuses_a_config_problem_before_launching(isolated_env):
    r = run_cli(["profile", f"--config_path={TINY}", "--policy.n_action_steps=20"], cwd=isolated_env)
    assert r.returncode == 2
    assert "n_action_steps (20) must be <= policy.chunk_size (10)" in r.stderr


def test_find_max_batch_reports_an_oom_under_the_memory_limit_as_batch_0(isolated_env):
    out = isolated_env / "fmb.json"
    # 350 MB is below what a worker with torch and the tiny policy needs, so batch 1 already fails to allocate.
    r = run_cli(["profile", f"--config_path={TINY}", "--find-max-batch", "--memory-limit", "350MB", "--max-batch", "1",
                 "--json", str(out)], cwd=isolated_env, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "per-device batch 1: out of memory" in r.stdout
    assert "even a per-device batch of 1 runs out of memory" in r.stderr
    result = json.loads(out.read_text())["results"][0]
    assert result["max_per_device_batch"] == 0 and result["first_oom_batch"] == 1


def test_a_user_error_found_late_in_the_data_exits_2_with_one_line_under_profile_as_under_train(isolated_env):
    """A truncated video of a later episode passes the checks made before launch (they decode the first selected
    episode's only); the first batch finds it. Both commands read the rank's marked line the same way."""
    data = isolated_env / "videos"
    r = run_cli_in_process(["dataset", "synth", str(data), "--episodes", "2", "--steps-per-episode", "12", "--video"])
    assert r.returncode == 0, r.stderr
    for video in data.rglob("episode_000001.mp4"):
        video.write_bytes(video.read_bytes()[:600])
    no_validation = ["--validation.val_split=0", "--validation.val_freq=0"]  # both episodes train
    checked = run_cli_in_process(["config", "validate", TINY, f"--dataset.root={data}", f"--output_dir={isolated_env / 'run'}",
                                  *no_validation])
    assert checked.returncode == 0, checked.stderr  # so the error below is found late, inside a worker
    errors = {}
    for command, extra in (("profile", ["--warmup", "0"]), ("train", [f"--output_dir={isolated_env / 'run'}"])):
        r = run_cli([command, f"--config_path={TINY}", f"--dataset.root={data}", "--steps", "1", *no_validation, *extra],
                    cwd=isolated_env, env=ONE_THREAD)
        assert r.returncode == 2, f"{command}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stdout + r.stderr, command
        errors[command] = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors["train"]) == 1 and "cannot open video" in errors["train"][0]
    assert errors["profile"] == errors["train"]
