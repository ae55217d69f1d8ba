"""Every way gpipe.GPipe refuses: ValueError for bad arguments before any work, RuntimeError naming
the stage, micro-batch and action for a failure inside a stage, and the step leaves nothing changed."""
import time
from typing import Tuple

import pytest
import torch

import gpipe


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))


def refused(match, **kwargs):
    with pytest.raises(ValueError, match=match):
        gpipe.GPipe(kwargs.pop("model") if "model" in kwargs else mlp(), **kwargs)


def test_bad_arguments_are_value_errors_that_name_the_fix():
    refused("cannot cut 1 layer into 2 devices", model=torch.nn.Linear(3, 3))  # traced: one torch.nn layer
    refused("the model must be a torch.nn.Module .got function.", model=lambda x: x)
    refused("the model is empty", model=torch.nn.Sequential())
    # GPipe's own keywords are checked by their rows of the settings' table, as gpipe train's flags:
    # the rows' words, where each had its own Python check before.
    refused("chunks must be at least 1 .got 0.", chunks=0)
    refused("chunks must be a whole number", chunks=2.5)
    refused("checkpoint must be always, except_last or never .got 'sometimes'.", checkpoint="sometimes")
    refused("checkpoint takes one value, not a list", checkpoint=["never"])
    refused("schedule must be auto, gpipe, .* .got 'fastest'.", schedule="fastest")
    refused("schedule=\"task\" is gpipe train's", schedule="task")
    refused("batch_norm must be deferred or per-micro-batch .got 'later'.", batch_norm="later")
    refused("batch_norm takes one value, not a list", batch_norm=["deferred"])
    refused("batch_norm must be deferred or per-micro-batch .got True.", batch_norm=True)
    refused("threads must be at least 1 .got 0.", threads=0)
    refused("runtime must be one of", runtime="cloud")
    refused("devices must be at least 1 .got -1.", devices=-1)
    refused("balance must be a list", balance="2,2")
    refused("every entry of balance must be a whole number", balance=[2, 2.0])
    refused("every entry of balance must be at least 1 .got 0.: it is a stage's layers", balance=[4, 0])  # its row's
    refused("balance must be a list", balance={2, 2})  # a set has no order
    refused("precision takes one value, not a list", precision=["fp32"])  # a keyword of the table alone, as GPipe's own
    refused("the model and the sum of the balance differ", balance=[2, 3])
    refused("disagree", balance=[2, 2], devices=3)
    refused("cannot cut 4 layers into 5 devices", devices=5)
    refused("must be a multiple of K", schedule="interleaved", chunks=3, devices=2)
    refused("virtual_stages must be at least 1 .got -1.", virtual_stages=-1)
    # Keywords of the settings' table alone, checked as GPipe's own: the value as Python wrote it.
    refused("precision must be fp32, bf16 or fp16 .got 'fp8'.", precision="fp8")
    refused("loss_scale must be auto, dynamic or off .got 'sometimes'.", loss_scale="sometimes")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 4):  # CPU autocast takes bfloat16 only
        refused("precision fp16 runs on CUDA devices with this torch", precision="fp16")
    refused("chunks is out of range .got 2147483648", chunks=2**31)
    refused("threads=100000 is more than this machine's", threads=100000)


def test_more_micro_batches_than_gpipe_plans_is_refused_at_once():
    # A micro-batch needs a row: chunks far above any batch's rows is refused before the plan is
    # built (which took seconds and gigabytes at chunks=10**6), naming chunks and the fix.
    begin = time.perf_counter()
    refused("M = 1000000 micro-batches .* more than gpipe plans .65536.*at most the rows of a batch.*M chunks",
            chunks=10**6)
    assert time.perf_counter() - begin < 5
    # Below the cap a batch of fewer rows than chunks runs in one micro-batch per row.
    pipe = gpipe.GPipe(mlp(), balance=[2, 2], chunks=64)
    assert isinstance(pipe.train_step(torch.randn(8, 6), torch.randint(3, (8,))), float)


def test_a_model_torchscript_cannot_compile_is_refused_with_its_reason():
    class Untyped(torch.nn.Module):
        def forward(self, x):
            return {"a": x}["a"] if isinstance(x, list) else x.numpy()  # Python-only

    with pytest.raises(ValueError, match="cannot be compiled by TorchScript.*TorchScript says") as e:
        gpipe.GPipe(torch.nn.Sequential(torch.nn.Linear(2, 2), Untyped()), balance=[1, 1])
    assert "Make each layer scriptable" in str(e.value)


def test_bad_batches_and_losses_before_any_work():
    model = mlp()
    pipe = gpipe.GPipe(model, balance=[2, 2], chunks=2)
    x, y = torch.randn(4, 6), torch.randint(3, (4,))
    with pytest.raises(ValueError, match="input must be a torch.Tensor"):
        pipe.train_step([1, 2], y)
    with pytest.raises(ValueError, match="no batch dimension"):
        pipe.train_step(torch.tensor(1.0), y)
    with pytest.raises(ValueError, match="target's batch size differs"):
        pipe.train_step(x, y[:3])
    with pytest.raises(ValueError, match="loss must be"):
        pipe.train_step(x, y, loss="hinge")
    with pytest.raises(ValueError, match="torch.jit.script"):
        pipe.train_step(x, y, loss=lambda o, t: (o - t).mean())
    with pytest.raises(ValueError, match="empty batch"):
        pipe.train_step(x[:0], y[:0])
    assert all(p.grad is None for p in model.parameters())


def test_a_failure_inside_a_stage_names_it_and_leaves_the_gradients():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(7, 3))  # 8 != 7
    pipe = gpipe.GPipe(model, balance=[2, 1], chunks=2, schedule="gpipe")
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    with pytest.raises(RuntimeError, match=r"stage 1 failed in the forward of micro-batch 0 \(action 1F0") as e:
        pipe.train_step(torch.randn(4, 6), torch.randint(3, (4,)))
    assert "frame #" not in str(e.value), "no C++ stack in the message"
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())
    # schedule="auto" (the default) meets it when it profiles the layers on the first batch: named there.
    with pytest.raises(RuntimeError, match=r"layer 2 \('2'\) failed when profiled on \[\d+, 8\]: mat1 and mat2") as e:
        gpipe.GPipe(model, devices=2).train_step(torch.randn(4, 6), torch.randint(3, (4,)))
    assert "frame #" not in str(e.value), "no C++ stack in the message"
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())


def test_a_loss_that_is_not_a_scalar_is_named():
    @torch.jit.script
    def per_row(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).pow(2).mean(1)

    pipe = gpipe.GPipe(mlp(), balance=[2, 2])
    with pytest.raises(RuntimeError, match="must return a scalar"):
        pipe.train_step(torch.randn(4, 6), torch.randn(4, 3), loss=per_row)


def test_a_loss_without_a_gradient_is_named_and_changes_nothing():
    @torch.jit.script
    def detached(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.detach() - target).pow(2).mean()

    model = mlp()
    for checkpoint in ("never", "always"):
        pipe = gpipe.GPipe(model, balance=[2, 2], chunks=2, checkpoint=checkpoint)
        with pytest.raises(RuntimeError, match="the loss has no gradient with respect to the model's output"):
            pipe.train_step(torch.randn(4, 6), torch.randn(4, 3), loss=detached)
        assert all(p.grad is None for p in model.parameters())


def test_nothing_to_trace_before_a_step():
    pipe = gpipe.GPipe(mlp(), chunks=2)
    with pytest.raises(ValueError, match="no step has run"):
        pipe.trace("never.json")
    with pytest.raises(ValueError, match="decided with the cut"):
        pipe.schedule_text()
    with pytest.raises(ValueError, match="no rows to measure"):
        pipe.train_step(torch.randn(0, 6), torch.randint(3, (0,)))
    with pytest.raises(ValueError, match="no step has run"):
        gpipe.GPipe(mlp(), balance=[2, 2]).trace("never.json")


def test_trace_and_schedule_after_a_step(tmp_path):
    pipe = gpipe.GPipe(mlp(), balance=[2, 2], chunks=2)
    pipe.train_step(torch.randn(4, 6), torch.randint(3, (4,)))
    pipe.trace(tmp_path / "step.json")
    pipe.trace(tmp_path / "step.svg")
    pipe.trace(tmp_path / "upper.SVG")  # the suffix in any case
    assert '"traceEvents"' in (tmp_path / "step.json").read_text()
    assert (tmp_path / "step.svg").read_text().startswith("<svg")
    assert (tmp_path / "upper.SVG").read_text().startswith("<svg")
    assert "device 0 |" in pipe.schedule_text() and "device 1 |" in pipe.schedule_text()
    assert 0.0 <= pipe.bubble < 1.0
    with pytest.raises(RuntimeError, match="nowhere"):
        pipe.trace(tmp_path / "nowhere" / "step.json")


@pytest.mark.parametrize("change", ["parameter", "append", "replace", "delete", "dropout", "buffer"])
def test_a_model_changed_after_wrapping_is_refused_at_the_next_call(change):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    pipe = gpipe.GPipe(model, balance=[2, 3], chunks=2)
    x, y = torch.randn(8, 6), torch.randint(3, (8,))
    pipe.train_step(x, y)
    if change == "parameter":
        model[0].weight = torch.nn.Parameter(torch.zeros(8, 6))
    elif change == "append":
        model.append(torch.nn.Identity())
    elif change == "replace":
        model[1] = torch.nn.Tanh()
    elif change == "delete":
        del model[2]
    elif change == "dropout":
        model[2].p = 0.5
    else:
        model[3].running_mean = torch.zeros(8)
    with pytest.raises(ValueError, match="the model changed after GPipe was built.*build a new GPipe"):
        pipe.train_step(x, y)
    with pytest.raises(ValueError, match="the model changed after GPipe was built"):
        pipe(x)
    # What is followed: values changed in place, the mode, requires_grad.
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    pipe = gpipe.GPipe(fresh, balance=[2, 1])
    with torch.no_grad():
        fresh[0].weight.mul_(2)
    fresh.eval()
    fresh[2].bias.requires_grad_(False)
    assert torch.allclose(pipe(x), fresh(x))


def test_a_pipe_cannot_be_pickled_and_says_what_to_save():
    import pickle
    pipe = gpipe.GPipe(mlp(), balance=[2, 2])
    with pytest.raises(TypeError, match="model.state_dict"):
        pickle.dumps(pipe)
    with pytest.raises(TypeError, match="model.state_dict"):
        torch.save(pipe, "/dev/null")


def test_balance_of_tensor_or_numpy_whole_numbers_is_taken():
    assert gpipe.GPipe(mlp(), balance=torch.tensor([1, 3])).balance == [1, 3]
    np = pytest.importorskip("numpy")
    assert gpipe.GPipe(mlp(), balance=np.array([3, 1])).balance == [3, 1]
    refused("every entry of balance must be a whole number", balance=torch.tensor([2.0, 2.0]))


def test_a_sparse_input_is_refused_before_any_work():
    pipe = gpipe.GPipe(mlp(), balance=[2, 2])
    with pytest.raises(ValueError, match="sparse.*to_dense"):
        pipe.train_step(torch.randn(4, 6).to_sparse(), torch.randint(3, (4,)))


def test_a_layer_that_returns_a_nested_tuple_is_a_value_error_before_any_work():
    class Nested(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> Tuple[Tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
            return (x, x), x

    with pytest.raises(ValueError, match="layer 1 .*returns.*flat tuple"):
        gpipe.GPipe(torch.nn.Sequential(torch.nn.Linear(2, 2), Nested()), balance=[1, 1])


def test_batch_norm_with_one_row_per_micro_batch_is_a_value_error_naming_chunks():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    for balance in ([1, 2], None):
        pipe = gpipe.GPipe(model, balance=balance, chunks=4, devices=2)
        with pytest.raises(ValueError, match="BatchNorm.*chunks"):
            pipe.train_step(torch.randn(4, 6), torch.randint(3, (4,)))


def test_no_devices_or_no_virtual_stages_is_refused_naming_the_argument_and_its_default():
    for balance in (None, [2, 2]):  # 0 is not "from the balance" in Python: None is
        refused(r"devices must be at least 1 \(got 0\).*devices=1 or more.*devices=None", devices=0, balance=balance)
    refused(r"virtual_stages must be at least 1 \(got 0\).*virtual_stages=None", virtual_stages=0)


def test_a_parameter_that_holds_nan_is_refused_naming_it():
    model = mlp()
    with torch.no_grad():
        model[2].bias[1] = float("nan")
    refused(r"the model's parameter 2\.bias holds NaN or infinite values", model=model)


class AddOneWithAGraph(torch.nn.Module):
    """Changes its input in place only where it takes a gradient: gpipe cannot find it beforehand."""

    def forward(self, x):
        if x.requires_grad:
            x.add_(1.0)
        return x


def test_a_layer_that_changes_its_input_in_place_only_with_a_graph_is_refused_naming_what_python_has():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), AddOneWithAGraph(), torch.nn.Linear(8, 3))
    x, y = torch.randn(8, 6), torch.randint(3, (8,))
    with pytest.raises(ValueError, match=r"layer 1 .*changes its input in place when it runs with a graph.*"
                                         r"GPipe\(model, schedule=\"gpipe\", balance=\[\.\.\.\]\)") as e:
        gpipe.GPipe(model, chunks=2).train_step(x, y)
    assert "balance_by" not in str(e.value) and "gpipe train" not in str(e.value) and "`" not in str(e.value)
    gpipe.GPipe(model, schedule="gpipe", balance=[2, 1], chunks=2).train_step(x, y)  # as it says


def test_runtime_mpi_outside_mpirun_is_refused_when_the_gpipe_is_made_naming_mpirun(monkeypatch):
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    refused(r"runtime=\"mpi\" runs one process per device, but mpirun did not start this one.*"
            r"`mpirun -np 2 \S*python3\S* .*`.*runtime=\"auto\"", runtime="mpi", devices=2)
    refused(r"`mpirun -np 4 \S*python3", runtime="mpi", balance=[1, 1, 1, 1], schedule="gpipe")
    gpipe.GPipe(mlp(), runtime="mpi", devices=1)  # one device: MPI's job of this process alone
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")  # as mpirun -np 3 would start it
    refused(r"mpirun started 3 processes, not a multiple of the 2 devices.*`mpirun -np 2 ", runtime="mpi", devices=2)


def test_a_keyword_no_setting_has_is_a_type_error_that_lists_them():
    with pytest.raises(TypeError, match="unexpected keyword argument 'precison'; it takes .*chunks.*precision"):
        gpipe.GPipe(mlp(), precison="bf16")
