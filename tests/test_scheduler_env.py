"""SLURM's job environment as the launch reads it (config/scheduler.py through config.with_machine): the machines,
this machine's rank, the GPUs per node where the YAML leaves them, what the plan prints, and a YAML that does not fit
the allocation refused. The address of machine 0 through `scontrol` is exercised on a real cluster
(tests/test_slurm.py)."""

from __future__ import annotations

import pytest

from opentau_cli.config import read_accelerate_config, with_machine
from opentau_cli.errors import UserError

pytestmark = pytest.mark.quick

JOB = {"SLURM_JOB_ID": "4711", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[01-02]",
       "MASTER_ADDR": "gpu01"}


def yaml_file(tmp_path, text: str):
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    return read_accelerate_config(path)


def test_a_slurm_job_gives_the_machines_the_rank_and_the_gpus_per_node_a_yaml_leaves_out(tmp_path):
    setup = yaml_file(tmp_path, "distributed_type: MULTI_GPU\nnum_machines: 2\n")
    read = with_machine(setup, {}, {**JOB, "SLURM_GPUS_ON_NODE": "8"})
    assert (read.num_machines, read.machine_rank, read.num_processes, read.main_process_ip) == (2, 1, 16, "gpu01")
    assert read.scheduler == ("SLURM job 4711, 2 nodes (gpu[01-02]), this is node 1 (SLURM_NODEID), machine 0's "
                              "address gpu01, 8 GPUs per node")


def test_slurm_gpus_per_node_with_a_type_count_and_a_yaml_that_says_num_processes_wins(tmp_path):
    leaves = yaml_file(tmp_path, "distributed_type: MULTI_GPU\nnum_machines: 2\n")
    assert with_machine(leaves, {}, {**JOB, "SLURM_GPUS_PER_NODE": "a100:4"}).num_processes == 8
    says = yaml_file(tmp_path, "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 2\n")
    assert with_machine(says, {}, {**JOB, "SLURM_GPUS_ON_NODE": "8"}).num_processes == 2


def test_a_yaml_for_2_machines_in_a_1_node_job_is_one_sentence(tmp_path):
    setup = yaml_file(tmp_path, "distributed_type: MULTI_GPU\nnum_machines: 2\nnum_processes: 16\n")
    with pytest.raises(UserError) as refused:
        with_machine(setup, {}, {**JOB, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"})
    assert str(refused.value) == (f"Accelerate config '{setup.path}' says num_machines 2 and this SLURM job has 1 node "
                                  "(SLURM_JOB_NUM_NODES): submit it with --nodes=2, or use a config whose num_machines "
                                  "is 1.")
    flags = with_machine(setup, {"num_machines": 2}, {**JOB, "SLURM_JOB_NUM_NODES": "1"})  # the command line decides
    assert flags.num_machines == 2


def test_outside_slurm_nothing_is_read_and_a_checkpoint_s_record_does_not_repeat_an_old_job(tmp_path):
    from opentau_cli.config import setup_from_dict

    setup = yaml_file(tmp_path, "distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\n")
    assert with_machine(setup, {}, {}).scheduler is None
    in_job = with_machine(setup, {}, {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"})
    assert in_job.scheduler == "SLURM job 7, 1 node, this is node 0 (SLURM_NODEID)"
    assert setup_from_dict(in_job.to_dict()).scheduler is None
