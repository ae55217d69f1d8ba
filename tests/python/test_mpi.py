"""`mpirun -np 2 python3 train.py`: each rank holds its stages; the results equal one process bit for
bit, and pipe.save writes one file with the whole model."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import gpipe  # noqa: F401  (a saved model with Stash and Pop layers needs gpipe's operators to load)

HERE = os.path.dirname(os.path.abspath(__file__))


def mpirun():
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed (openmpi-bin)")
    flags = ["--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    return ["mpirun", *flags]


def run(command, out, *flags):
    result = subprocess.run(command + [sys.executable, os.path.join(HERE, "mpi_train.py"), str(out), *flags],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


# The default step program (interleaved over 4 stages, except_last) and one of each other schedule, each
# trained in one process and by 2 ranks: one interpreter and one job for all of them (--configs).
CONFIGS = [("interleaved", "except_last"), ("gpipe", "always"), ("1f1b", "never"), ("zb1p", "except_last"),
           ("zbv", "always"), ("interleaved", "never:held")]  # held: within pipe.update_on_devices(opt)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The folders of the one-process runs and of the 2-rank runs, a subfolder per configuration."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    configs = ",".join(f"{s}:{c}" for s, c in CONFIGS)
    run([], one, "--configs", configs)
    run(mpirun() + ["-np", "2"], two, "--configs", configs)
    return one, two


def test_two_ranks_equal_one_process_bit_for_bit(trained):
    one, two = (folder / "interleaved-except_last" for folder in trained)
    alone = torch.load(one / "rank0.pt")
    ranks = [torch.load(two / f"rank{r}.pt") for r in range(2)]
    assert alone["describe"] == "one process, 2 device threads"
    assert ranks[0]["describe"] == "MPI: 2 ranks = 2 devices x 1 replica"
    assert ranks[0]["losses"] == alone["losses"] == ranks[1]["losses"]
    # Each rank trained its stages' parameters (device 0: stages 0 and 2; the tied weight's copy on
    # both), which together are the whole model's.
    names = set(ranks[0]["parameters"]) | set(ranks[1]["parameters"])
    assert names == set(alone["parameters"])
    assert set(ranks[0]["parameters"]) != set(ranks[1]["parameters"])
    for rank in ranks:
        for name, value in rank["parameters"].items():
            assert torch.equal(value, alone["parameters"][name]), name
    # One file holds the whole model, the same from both runs.
    a = torch.jit.load(str(one / "model.pt")).state_dict()
    b = torch.jit.load(str(two / "model.pt")).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("schedule,checkpoint", CONFIGS[1:])
def test_every_schedule_under_two_ranks_equals_one_process_bit_for_bit(trained, schedule, checkpoint):
    one, two = (folder / f"{schedule}-{checkpoint}".replace(":", "-") for folder in trained)
    alone = torch.load(one / "rank0.pt")
    ranks = [torch.load(two / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["balance"] == alone["balance"] == ([3, 3, 2, 1] if schedule in ("zbv", "interleaved") else [5, 4])
    assert ranks[0]["losses"] == alone["losses"] == ranks[1]["losses"]
    assert set(ranks[0]["parameters"]) | set(ranks[1]["parameters"]) == set(alone["parameters"])
    for rank in ranks:
        for name, value in rank["parameters"].items():
            assert torch.equal(value, alone["parameters"][name]), name
    if checkpoint.endswith(":held"):  # the update on the devices is the step after train_step's, to the bit
        plain = torch.load(trained[0] / "interleaved-except_last" / "rank0.pt")
        assert plain["losses"] == alone["losses"]
        for name, value in plain["parameters"].items():
            assert torch.equal(value, alone["parameters"][name]), name


def test_a_weight_tied_across_ranks_gets_the_sum_of_its_gradients(tmp_path):
    """The tied copies' gradients are summed across the ranks (in another order than one process's
    autograd adds them, so equal within rounding), and the copies stay identical to the bit."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    run([], one, "--tied")
    run(mpirun() + ["-np", "2"], two, "--tied")
    alone = torch.load(one / "rank0.pt")
    ranks = [torch.load(two / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["losses"] == pytest.approx(alone["losses"], rel=1e-5)
    assert torch.equal(ranks[0]["parameters"]["0.weight"], ranks[1]["parameters"]["0.weight"])  # both hold a copy
    for rank in ranks:
        for name, value in rank["parameters"].items():
            assert torch.allclose(value, alone["parameters"][name], rtol=1e-5, atol=1e-6), name


def test_a_traced_model_under_two_ranks_equals_one_process_bit_for_bit(tmp_path):
    """A model gpipe traces, with a BatchNorm inside a block (deferred) and a tied head: each rank
    traces and cuts it alike; BatchNorm's statistics end the same on both ranks and in one process."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    run([], one, "--traced", "--schedule", "1f1b")
    run(mpirun() + ["-np", "2"], two, "--traced", "--schedule", "1f1b")
    alone = torch.load(one / "rank0.pt")
    ranks = [torch.load(two / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["balance"] == alone["balance"] and len(alone["balance"]) == 2
    assert ranks[0]["losses"] == pytest.approx(alone["losses"], rel=1e-5)  # the tied weight's sum: another order
    assert "norms.0.running_mean" in alone["parameters"]
    for rank in ranks:
        for name, value in rank["parameters"].items():
            assert torch.allclose(value, alone["parameters"][name], rtol=1e-5, atol=1e-6), name


def test_balance_none_under_mpi_every_rank_takes_rank_0s_cut(tmp_path):
    run(mpirun() + ["-np", "2"], tmp_path, "--by-time")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["balance"] == ranks[1]["balance"] and len(ranks[0]["balance"]) == 4
    assert ranks[0]["losses"] == ranks[1]["losses"]


def test_a_failed_trace_fails_on_every_rank_and_an_uncaught_exception_ends_the_job(tmp_path):
    # The job ends (timeout: a hang, with a margin for a loaded machine; it takes seconds).
    result = subprocess.run(mpirun() + ["-np", "2", sys.executable, os.path.join(HERE, "mpi_train.py"), str(tmp_path),
                                        "--raise-on-rank-1"], capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "rank 0: trace refused" in output and "rank 1: trace refused: gpipe: writing" in output, output
    assert "RuntimeError: rank 1 stops here" in output


def test_ranks_given_different_models_are_refused_on_every_rank(tmp_path):
    run(mpirun() + ["-np", "2"], tmp_path, "--unseeded-model")
    for r in range(2):
        assert "rank 1's model differs from rank 0's" in torch.load(tmp_path / f"rank{r}.pt")["refused"]


def test_ranks_given_different_batches_are_refused_on_every_rank(tmp_path):
    run(mpirun() + ["-np", "2"], tmp_path, "--unseeded")
    for r in range(2):
        assert "the ranks were given different batches" in torch.load(tmp_path / f"rank{r}.pt")["refused"]


@pytest.mark.parametrize("how", ["return", "exit"])
def test_a_rank_whose_script_ends_early_ends_the_job_with_a_message_naming_it(tmp_path, how):
    """Rank 1's script ends (its last line, or sys.exit(0)) while rank 0 still trains: rank 0's next
    step raises an error naming rank 1 within seconds, and no process of the job is left."""
    marker = str(tmp_path / f"ends-early-{how}")
    os.makedirs(marker)
    try:
        result = subprocess.run(mpirun() + ["-np", "2", sys.executable, os.path.join(HERE, "mpi_train.py"), marker,
                                            "--rank-1-ends-early", how], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        subprocess.run(["pkill", "-f", marker])
        pytest.fail(f"the job hung: {e.stdout}{e.stderr}")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert re.search(r"rank 1 \(device 1, replica 0\): (ended its program|let go of its pipeline)", output), output
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left: {left}"
