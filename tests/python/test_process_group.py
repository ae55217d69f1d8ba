"""GPipe(process_group=...): processes that initialized torch.distributed themselves (tcp://, without
torchrun's variables) run one device each over the group's store, with the losses and parameters of
one process bit for bit; subgroups run pipelines of their own; wrong uses are refused up front."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import gpipe

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "process_group_train.py")
LAUNCHER = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(size, groups):
    """Each process's JSON line (size 1: one process alone)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER}
    port = str(free_port()) + ("," + str(free_port()) if groups.startswith("again") else "")
    procs = [subprocess.Popen([sys.executable, SCRIPT, str(r), str(size), port, groups], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(size)]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def assert_as_alone(rank, alone):
    """A rank of a 2-device pipeline over c10d: the losses and its parameters of one process, bit for bit."""
    assert rank["describe"] == "c10d (Gloo; shared memory with 1 of 1 other rank): 2 ranks = 2 devices x 1 replica"
    assert rank["losses"] == alone["losses"]
    for name, values in rank["parameters"].items():
        assert values == alone["parameters"][name], name


@pytest.fixture(scope="module")
def alone():
    return run_job(1, "default")[0]


@pytest.mark.parametrize("groups", ["default", "world"])
def test_a_group_of_two_equals_one_process_bit_for_bit(alone, groups):
    ranks = run_job(2, groups)
    assert alone["describe"] == "one process, 2 device threads"
    for r in ranks:
        assert_as_alone(r, alone)
    assert set(ranks[0]["parameters"]) | set(ranks[1]["parameters"]) == set(alone["parameters"])


def test_subgroups_run_pipelines_of_their_own(alone):
    ranks = run_job(4, "pairs")
    for r in ranks:
        assert_as_alone(r, alone)


def test_a_subgroups_ranks_are_named_with_their_number_in_the_default_group():
    ranks = run_job(4, "pairs_leave")
    assert len(ranks[0]["losses"]) == len(ranks[1]["losses"]) == 4  # the other pair trains on
    error = ranks[2]["losses"][-1]
    assert "stopped because rank 1 (3 in the default group) failed: rank 1 (3 in the default group) (device 1, " \
           "replica 0): " in error, error


def test_a_new_group_after_destroy_process_group_once_the_old_pipelines_are_gone(alone):
    ranks = run_job(2, "again")
    for r in ranks:
        assert "which 1 pipeline of this process still uses; every pipeline of a process runs over the same " \
               "group: pass the same process_group, or end those pipelines first (Python: del the GPipe " \
               "objects)" in r["refused"], r["refused"]
        assert_as_alone(r, alone)


def test_a_rank_that_cannot_take_a_new_group_stops_the_others_at_once(alone):
    ranks = run_job(2, "again_one")
    assert "which 1 pipeline of this process still uses" in ranks[0]["refused"], ranks[0]["refused"]
    assert ranks[1]["refused"] == "gpipe: rank 0 could not take the new process group, so neither does rank 1: " \
        "1 pipeline of its process still uses the group before; end those pipelines first (Python: del the " \
        "GPipe objects), then make the GPipe over the new group on every rank", ranks[1]["refused"]
    assert ranks[1]["refused_s"] < 30  # heard of at once, not after GPIPE_TIMEOUT (1800 s)
    for r in ranks:
        assert_as_alone(r, alone)


def test_a_rank_that_gave_up_on_a_new_group_is_heard_by_one_that_comes_later(alone):
    ranks = run_job(2, "again_late")
    assert len(ranks[0]["refused"]) == 1 and "gpipe: rank 0 could not start over the new process group: rank 1 did " \
        "not say whether it takes it within 5 s (GPIPE_TIMEOUT)" in ranks[0]["refused"][0], ranks[0]["refused"]
    assert ranks[1]["refused"] == ["gpipe: rank 0 could not take the new process group, so neither does rank 1: "
                                   "rank 0 gave up waiting for rank 1; make the GPipe over the new group again on "
                                   "every rank"], ranks[1]["refused"]
    for r in ranks:
        assert_as_alone(r, alone)


def test_rank_zero_alone_profiles_for_auto_and_its_failure_fails_every_rank():
    ranks = run_job(2, "profile_fails")
    assert "this layer fails on rank 0" in ranks[0]["error"], ranks[0]["error"]
    assert ranks[1]["error"] == 'RuntimeError: gpipe: schedule="auto": rank 0 could not profile the model to ' \
        "choose the schedule: layer 1 ('1') failed when profiled on [4, 16]: builtins.RuntimeError: this layer " \
        "fails on rank 0", ranks[1]["error"]
    assert ranks[1]["seconds"] < 30, ranks[1]["seconds"]


def test_a_named_v_schedule_without_a_balance_runs_rank_zeros_cut_and_order_on_every_rank():
    ranks = run_job(2, "named_v")
    assert ranks[0] == ranks[1]
    assert ranks[0]["balance"] == [1, 1, 1, 1]
    # Ordered by rank 0's times of the unequal stages, not the unit order a given balance runs.
    torch.manual_seed(0)
    unit = gpipe.GPipe(torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 16),
                                           torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)),
                       devices=2, chunks=8, schedule="zbv", balance=[1, 1, 1, 1])
    unit.train_step(torch.randn(64, 64), torch.randn(64, 8), loss="mse")
    assert ranks[0]["program"] != unit.schedule_text(), ranks[0]["program"]


def model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_a_group_without_torch_distributed_is_refused():
    with pytest.raises(ValueError, match="torch.distributed is not initialized in this process; call "
                                         "torch.distributed.init_process_group"):
        gpipe.GPipe(model(), balance=[2, 1], process_group=object())


def test_a_group_with_another_runtime_is_refused():
    with pytest.raises(ValueError, match='process_group runs the pipeline over the c10d backend; give '
                                         'runtime="c10d" or "auto" with it \\(got runtime=\'threads\'\\)'):
        gpipe.GPipe(model(), balance=[2, 1], runtime="threads", process_group=object())
