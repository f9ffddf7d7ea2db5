"""The EMA of the weights (train/ema.py) in process: openpi's update, what it averages, its checkpoint files and
their place in the manifest's per-rank expectations. Real 2-process launches: tests/test_ema_e2e.py."""

from __future__ import annotations

import pytest
import torch

from opentau_cli.store.layout import EMA_WEIGHTS, ema_rank_file, rank_state_file
from opentau_cli.store.manifest import rank_files
from opentau_cli.train import ema as ema_module
from opentau_cli.train.ema import WeightEMA, ema_update_

pytestmark = pytest.mark.quick


def openpi_ema(ema: torch.Tensor, w: torch.Tensor, decay: float) -> torch.Tensor:
    return decay * ema + (1 - decay) * w  # openpi's expression, in fp32


def test_the_update_is_openpi_s_expression_bit_for_bit_also_across_chunks(monkeypatch):
    monkeypatch.setattr(ema_module, "CHUNK", 7)  # a tensor of 50 values goes in 8 chunks, the last one short
    gen = torch.Generator().manual_seed(0)
    ema, w = torch.randn(5, 10, generator=gen), torch.randn(5, 10, generator=gen)
    for decay in (0.9, 0.99, 0.999):
        want = openpi_ema(ema, w, decay)
        got = ema.clone()
        ema_update_(got, w, decay)
        assert torch.equal(got, want)


def test_a_bf16_weight_is_averaged_in_fp32():
    ema, w = torch.full((4,), 1.0), torch.full((4,), 3.0, dtype=torch.bfloat16)
    ema_update_(ema, w, 0.75)
    assert ema.dtype == torch.float32 and torch.equal(ema, torch.full((4,), 1.5))


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trained = torch.nn.Linear(3, 2)
        self.frozen = torch.nn.Linear(2, 1)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.frozen(self.trained(x))


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def test_single_process_ema_averages_every_trainable_parameter_after_each_step(accelerator):
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    ema = WeightEMA.build(0.9, accelerator, model)
    assert ema.names == ["trained.weight", "trained.bias"] and ema.file == EMA_WEIGHTS
    want = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    for _ in range(3):
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        want = {n: openpi_ema(want[n], p.detach(), 0.9) for n, p in model.named_parameters() if p.requires_grad}
    files = ema.files()
    assert list(files) == [EMA_WEIGHTS]
    for name, tensor in files[EMA_WEIGHTS].items():
        assert torch.equal(tensor, want[name])
    assert not torch.equal(want["trained.weight"], model.trained.weight)


def test_swap_in_computes_with_the_ema_and_gives_the_live_weights_back_exactly(accelerator):
    torch.manual_seed(1)
    model = Tiny()
    ema = WeightEMA.build(0.5, accelerator, accelerator.prepare(model))
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model.trained.weight.add_(1.0)  # the live weights move on; the EMA stays where it was built
    moved = model.trained.weight.detach().clone()
    x = torch.randn(2, 3)
    with ema.swap_in():
        assert torch.equal(model.trained.weight, live["trained.weight"])
        with torch.no_grad():
            out = model(x)
    assert torch.equal(model.trained.weight, moved)
    assert torch.equal(out, torch.nn.functional.linear(torch.nn.functional.linear(x, live["trained.weight"], live["trained.bias"]),
                                                      live["frozen.weight"], live["frozen.bias"]))


def test_loading_an_ema_of_another_model_names_what_differs(accelerator):
    from opentau_cli.errors import RunError

    ema = WeightEMA.build(0.9, accelerator, accelerator.prepare(Tiny()))
    state = {n: t.clone() + 1 for n, t in ema.state_dict().items()}
    ema.load_state_dict(state)
    assert all(torch.equal(ema.state_dict()[n], state[n]) for n in state)
    with pytest.raises(RunError, match="missing"):
        ema.load_state_dict({"trained.weight": state["trained.weight"]})
    with pytest.raises(RunError, match="shape"):
        ema.load_state_dict({**state, "trained.bias": torch.zeros(3)})


def test_the_manifest_expects_each_deepspeed_rank_s_ema_and_rank_0_s_under_ddp():
    ddp = [rank_state_file(0), rank_state_file(1)]
    assert rank_files(ddp, 2, None)[1] == []  # no EMA asked: none expected
    found, missing = rank_files(ddp + [EMA_WEIGHTS], 2, None, ema=True)
    assert missing == [] and EMA_WEIGHTS in found["0"]
    assert rank_files(ddp, 2, None, ema=True)[1] == [(0, EMA_WEIGHTS)]
    shards = [f"pytorch_model/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    found, missing = rank_files(ddp + shards + [ema_rank_file(0)], 2, 2, ema=True)
    assert missing == [(1, ema_rank_file(1))] and ema_rank_file(0) in found["0"]


def test_ema_decay_is_off_by_default_and_below_1():
    from pydantic import ValidationError

    from opentau_cli.config import TrainConfig

    assert not TrainConfig().ema.enabled
    assert TrainConfig(ema={"decay": 0.99}).ema.enabled
    for bad in (1.0, -0.1):
        with pytest.raises(ValidationError):
            TrainConfig(ema={"decay": bad})


def test_weights_ema_of_a_checkpoint_without_an_ema_is_refused_in_one_line(tmp_path):
    import json

    from opentau_cli.errors import UserError
    from opentau_cli.store.layout import TRAINING_STATE
    from opentau_cli.tools.consolidate import wants_ema

    (tmp_path / TRAINING_STATE).write_text(json.dumps({"step": 4}))
    assert wants_ema(tmp_path, None) is False and wants_ema(tmp_path, "live") is False
    with pytest.raises(UserError, match="holds no EMA weights.*--weights live"):
        wants_ema(tmp_path, "ema")
    with pytest.raises(UserError, match="--weights must be ema or live"):
        wants_ema(tmp_path, "best")
    (tmp_path / TRAINING_STATE).write_text(json.dumps({"step": 4, "ema": {"decay": 0.99}}))
    assert wants_ema(tmp_path, None) is True and wants_ema(tmp_path, "live") is False


def test_the_benchmark_report_puts_both_sides_of_each_backend_side_by_side():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_ema", REPO / "benchmarks" / "bench_ema.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = lambda ms, mib: {"step_time_s": ms / 1000, "samples_per_s": 8000 / ms, "peak_memory_bytes": mib << 20}
    rows = bench.compare_rows([row(100, 1000), row(200, 800)], [row(110, 1400), row(210, 850)])
    assert [name for name, _ in rows] == ["DDP", "ZeRO-3"]
    assert "step time 1.100x, memory +400 MiB/rank" in rows[0][1]
    assert "step time 1.050x, memory +50 MiB/rank" in rows[1][1]


def test_with_lora_the_ema_averages_the_adapters_and_full_modules_under_the_names_a_checkpoint_holds(accelerator):
    from opentau_cli.policies import build_policy
    from opentau_cli.policies.lora import apply_lora, checkpoint_keys
    from test_lora import tiny

    cfg = tiny(rank=4)
    model = accelerator.prepare(apply_lora(build_policy(cfg), cfg.lora))
    ema = WeightEMA.build(0.99, accelerator, model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(ema.names) == trainable and any(".lora_A." in n for n in ema.names)
    assert any(n.startswith("action_out_proj.") for n in ema.names)
    assert set(ema.names) <= checkpoint_keys(model)  # what export finds in model.safetensors to replace
    assert sum(t.numel() for t in ema.shadow) < 0.5 * sum(p.numel() for p in model.parameters())


def test_with_the_ema_on_run_best_is_the_best_checkpoint_by_the_ema_weights_validation(tmp_path):
    """The default checkpoint.best_metric of a run with an EMA ranks checkpoints on the EMA weights (what export, eval
    and serve use by default); on hand-written validation records where the live and the EMA rankings disagree,
    RUN:best resolves to the EMA's best, whatever the live weights scored."""
    from conftest import EXAMPLES
    from opentau_cli.config import AccelerateSetup, Machine, load_config, validate
    from opentau_cli.store.layout import BEST, CHECKPOINTS, read_last
    from opentau_cli.store.runs import find_checkpoint
    from opentau_cli.train.manager import BestCheckpoints, CheckpointManager
    from test_train_checkpoint_manager import FakeAccelerator

    cfg = load_config(EXAMPLES / "pi05_tiny_config.json", [
        "--ema.decay=0.99", "--checkpoint.keep_best=1", "--validation.val_freq=10", "--validation.val_split=0.25",
        f"--output_dir={tmp_path / 'run'}"], environ={})
    cfg = validate(cfg, AccelerateSetup(), Machine(cuda=False, gpus=0)).config
    best = cfg.checkpoint
    assert cfg.to_json_dict()["checkpoint"]["best_metric"] == "ema_val_loss"  # what train_config.json records
    run = tmp_path / "run"
    manager = CheckpointManager(FakeAccelerator(), run, total_steps=60, run_id="a", keep_last=1,
                                best=BestCheckpoints(best.keep_best, best.best_metric, best.best_mode))
    # The run: the live weights were best at step 50, the EMA weights at step 60.
    records = {40: (0.25, 0.23), 50: (0.199, 0.21), 60: (0.205, 0.1715)}
    for step, (live, ema) in records.items():
        manager.save(step, config={"steps": 60, "resume": False},
                     state={"step": step, "validation": {"val_loss": live, "ema_val_loss": ema}})
    assert read_last(run / CHECKPOINTS, BEST) == "000060"
    assert sorted(p.name for p in (run / CHECKPOINTS).iterdir() if p.name.isdigit()) == ["000060"]  # 000050 retired
    assert find_checkpoint(f"{run}:best") == (run / CHECKPOINTS / "000060").resolve()
