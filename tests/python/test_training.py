"""gpipe.GPipe trains as plain PyTorch on one device: parameters compared after several optimizer
steps, for every schedule and checkpoint mode, uneven micro-batches, skips, tied weights, BatchNorm,
Dropout."""
import contextlib
import copy
import os
import subprocess
import time
from typing import Tuple

import pytest
import torch

import gpipe
from mpi_train import TiedHead  # an output projection reading the embedding's weight

RTOL = 1e-5


def mlp(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Dropout(dropout), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))


def batches(steps, rows, classes=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 12, generator=g), torch.randint(classes, (rows,), generator=g)) for _ in range(steps)]


def assert_same_parameters(model, reference, rtol=RTOL):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        scale = q.detach().abs().max().item() + 1e-12
        assert (p.detach() - q.detach()).abs().max().item() <= rtol * scale + 1e-7, name


def train_reference(reference, data, loss_fn, make_opt):
    opt = make_opt(reference.parameters())
    for x, y in data:
        opt.zero_grad()
        loss_fn(reference(x), y).backward()
        opt.step()


def train_gpipe(pipe, model, data, loss, make_opt):
    opt = make_opt(model.parameters())
    losses = []
    for x, y in data:
        opt.zero_grad()
        losses.append(pipe.train_step(x, y, loss=loss))
        opt.step()
    return losses


SCHEDULES = [("gpipe", [3, 5], None), ("1f1b", [3, 5], None), ("zb1p", [3, 5], None),
             ("interleaved", [2, 2, 2, 2], 2), ("zbv", [2, 2, 2, 2], None), ("v-half", [2, 2, 2, 2], None)]


@pytest.mark.parametrize("schedule,balance,V", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_every_schedule_and_checkpoint_mode_trains_as_one_device(schedule, balance, V, checkpoint):
    model, reference = mlp(), mlp()
    data = batches(3, 22)  # 22 rows in 4 micro-batches: 6, 6, 5, 5
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    pipe = gpipe.GPipe(model, balance=balance, chunks=4, checkpoint=checkpoint, schedule=schedule, virtual_stages=V)
    losses = train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
    assert all(isinstance(l, float) for l in losses)
    assert_same_parameters(model, reference)


class HiddenAndMask(torch.nn.Module):
    """x -> (hidden states, a boolean mask per row)."""
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(12, 32)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.proj(x)), x[:, :1] > -0.3


class MaskedLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, xm: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        x, m = xm
        return x + torch.relu(self.lin(x)) * m.float(), m


class Towers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, xm: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, m = xm
        return self.a(x), self.b(x), m


class Merge(torch.nn.Module):
    def forward(self, abm: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b, m = abm
        return a * torch.sigmoid(b) * m.float()


def in_place_model(seed=0):
    """As torchvision writes its models: activations that change their input in place, one first."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(6, 8), torch.nn.ReLU(inplace=True),
                               torch.nn.Linear(8, 8), torch.nn.Hardtanh(inplace=True), torch.nn.Linear(8, 5),
                               torch.nn.ReLU6(inplace=True))


@pytest.mark.parametrize("schedule,balance", [("gpipe", [2, 5]), ("1f1b", [1, 2, 4]), ("zb1p", [3, 4]),
                                              ("interleaved", [1, 2, 2, 2]), ("zbv", [2, 1, 2, 2]),
                                              ("auto", None)])
def test_layers_that_change_their_input_in_place_train_as_one_device(schedule, balance):
    # Wherever a stage begins (at an in-place layer too), under split backwards, and with auto's
    # profile: one step as one device takes it, and the caller's batch left as it was.
    x, y = torch.randn(12, 6), torch.randint(5, (12,))
    given = x.clone()
    model, reference = in_place_model(), in_place_model()
    kwargs = {"devices": 2} if balance is None else {"balance": balance}
    pipe = gpipe.GPipe(model, chunks=4, schedule=schedule, **kwargs)
    loss = pipe.train_step(x, y, loss="cross_entropy")
    assert torch.equal(x, given), "the caller's batch changed"
    expected = torch.nn.functional.cross_entropy(reference(x.clone()), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name
    with torch.no_grad():
        assert torch.allclose(pipe(x), reference(x.clone()), rtol=1e-5, atol=1e-6)
    assert torch.equal(x, given), "the caller's batch changed in evaluation"


def squeezenet(seed=0):
    """torchvision's SqueezeNet 1.1 as shipped (ReLU(inplace=True) throughout, Fire blocks that
    concatenate), its layers laid out in a Sequential; Dropout off, since a pipeline draws its masks
    per micro-batch."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(seed)
    model = torchvision.models.squeezenet1_1(num_classes=10)
    model.classifier[0].p = 0.0
    return torch.nn.Sequential(*model.features, *model.classifier, torch.nn.Flatten())


@pytest.mark.parametrize("schedule,devices", [("gpipe", 2), ("1f1b", 3), ("zb1p", 2), ("zbv", 2), ("auto", 2)])
def test_a_torchvision_model_as_shipped_trains_as_one_device(schedule, devices):
    x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
    model, reference = squeezenet(), squeezenet()
    pipe = gpipe.GPipe(model, chunks=4, devices=devices, schedule=schedule)
    with torch.no_grad():  # a first call under no_grad: the profile still runs its backwards
        pipe(x)
    loss = pipe.train_step(x, y, loss="cross_entropy")
    expected = torch.nn.functional.cross_entropy(reference(x.clone()), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6 * q.grad.abs().max().item()), name


def tuple_model(seed=0):
    """Layers that hand tuples on: hidden states beside a mask, then two towers."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(HiddenAndMask(), MaskedLinear(), MaskedLinear(), Towers(), Merge(),
                               torch.nn.Linear(32, 5))


@pytest.mark.parametrize("schedule,balance", [("gpipe", [3, 3]), ("1f1b", [1, 3, 2]), ("zb1p", [4, 2]),
                                              ("interleaved", [1, 2, 1, 2]), ("zbv", [1, 2, 1, 2]),
                                              ("v-half", [2, 1, 1, 2])])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_tuples_across_stages_train_as_one_device(schedule, balance, checkpoint):
    model, reference = tuple_model(), tuple_model()
    data = batches(3, 22)
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    pipe = gpipe.GPipe(model, balance=balance, chunks=4, checkpoint=checkpoint, schedule=schedule)
    train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
    assert_same_parameters(model, reference)


@pytest.mark.skipif(not os.environ.get("GPIPE_CLI"), reason="GPIPE_CLI names the gpipe program (ctest sets it)")
def test_a_model_that_passes_tuples_saved_from_python_trains_in_gpipe_train(tmp_path):
    assert_cli_trains_as_one_device(tmp_path, tuple_model(), tuple_model(), "--schedule", "zb1p", "--balance", "2,4")


def test_loss_equals_one_device_and_grads_are_added_like_backward():
    model, reference = mlp(), mlp()
    x, y = batches(1, 13)[0]
    pipe = gpipe.GPipe(model, balance=[4, 4], chunks=5)  # 13 rows in 5 micro-batches
    loss = pipe.train_step(x, y)
    expected = torch.nn.functional.cross_entropy(reference(x), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=RTOL)
    # A second step without zero_grad adds to .grad, as a second backward() would.
    pipe.train_step(x, y)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=RTOL, atol=1e-7)


def test_bf16_trains_as_one_device_under_torch_autocast():
    """precision="bf16": each stage's forward under autocast, as torch.autocast("cpu") runs the model on
    one device. bfloat16 keeps 8 significant bits, and a weight's gradient sums bfloat16 products over
    each micro-batch's rows instead of the whole batch's, so the gradients agree to a few roundings of
    2^-8: 3% of each gradient's largest entry (tests/precision_test.cc says more)."""
    model, reference = mlp(), mlp()
    x, y = batches(1, 16)[0]
    pipe = gpipe.GPipe(model, balance=[4, 4], chunks=4, schedule="1f1b", checkpoint="always", precision="bf16")
    loss = pipe.train_step(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.nn.functional.cross_entropy(reference(x), y)
    expected.backward()
    assert loss == pytest.approx(expected.item(), rel=0.03)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32
        assert (p.grad - q.grad).abs().max() <= 0.03 * q.grad.abs().max()


def test_a_loss_scale_that_is_a_power_of_two_changes_no_bit():
    """loss_scale="dynamic" (on by itself under precision="fp16"): each micro-batch's loss times 65536,
    the gradients divided by it: the same parameters, to the bit, as the run without it."""
    data = batches(3, 16)
    params, accumulated, inputs = [], [], []
    for loss_scale in ("off", "dynamic"):
        model = mlp()
        pipe = gpipe.GPipe(model, balance=[4, 4], chunks=4, schedule="1f1b", loss_scale=loss_scale)
        assert (pipe.loss_scaler is None) == (loss_scale == "off")
        train_gpipe(pipe, model, data, "cross_entropy", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        params.append([p.detach().clone() for p in model.parameters()])
        # Gradients added to those of a step before (no zero_grad between), and an input's gradient.
        x = data[0][0].clone().requires_grad_(True)
        pipe.train_step(x, data[0][1])
        pipe.train_step(data[1][0], data[1][1])
        accumulated.append([p.grad.clone() for p in model.parameters()])
        inputs.append(x.grad.clone())
    assert all(torch.equal(a, b) for a, b in zip(*params))
    assert all(torch.equal(a, b) for a, b in zip(*accumulated))
    assert torch.equal(*inputs)
    with pytest.raises(TypeError, match="must be a gpipe.LossScaler"):
        pipe.loss_scaler = {"scale": 2.0}
    plain = gpipe.GPipe(mlp(), balance=[4, 4], chunks=4, schedule="gpipe")
    with pytest.raises(ValueError, match="scales no loss"):
        plain.loss_scaler = gpipe.LossScaler()


def test_the_loss_scale_follows_gradscalers_own_update_on_a_made_up_history():
    """gpipe.LossScaler.update against the op torch.cuda.amp.GradScaler.update runs
    (torch._amp_update_scale_), step by step, where this torch has it on a CPU (2.x); the C++ test
    (LossScaleTest) checks the same rule where it has not."""
    scale, tracker = torch.full((1,), 8.0), torch.zeros((1,), dtype=torch.int32)
    try:
        torch._amp_update_scale_(scale.clone(), tracker.clone(), torch.zeros((1,)), 2.0, 0.5, 2)
    except (RuntimeError, NotImplementedError):
        pytest.skip("this torch has no CPU kernel of _amp_update_scale_ (torch 1.13)")
    ours = gpipe.LossScaler(init_scale=8.0, growth_interval=2)
    for finite in [True, True, False, True, False, True, True, True, True, False, True]:
        torch._amp_update_scale_(scale, tracker, torch.zeros((1,)) if finite else torch.ones((1,)), 2.0, 0.5, 2)
        ours.update(finite)
        assert (ours.scale, ours.growth_tracker) == (scale.item(), tracker.item())


@pytest.mark.parametrize("on_devices", [False, True])
def test_an_overflowing_step_is_skipped_everywhere_and_the_scale_halves(on_devices):
    """A scale so large that the scaled gradients overflow: the step leaves every .grad None on both
    stages, optimizer.step() changes nothing, and the scale halves (torch.cuda.amp.GradScaler's rule);
    the scale's state goes in a checkpoint as GradScaler's does."""
    model = mlp()
    with torch.no_grad():
        model[-1].weight.mul_(100)  # a loss of tens: times 2^127, beyond float's range
    pipe = gpipe.GPipe(model, balance=[4, 4], chunks=4, schedule="gpipe", loss_scale="dynamic")
    pipe.loss_scaler = gpipe.LossScaler(init_scale=2.0 ** 127, growth_interval=3)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = batches(1, 16)[0]
    with pipe.update_on_devices(opt) if on_devices else contextlib.nullcontext():
        opt.zero_grad()
        pipe.train_step(x, y)
        assert all(p.grad is None for p in model.parameters())
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert pipe.loss_scaler.scale == 2.0 ** 126 and pipe.loss_scaler.skipped == 1
    state = pipe.loss_scaler.state_dict()
    again = gpipe.LossScaler()
    again.load_state_dict(state)
    assert again.state_dict() == state
    pipe.loss_scaler = gpipe.LossScaler(init_scale=1024.0)
    loss = pipe.train_step(x, y)  # a scale that fits: the step trains
    assert loss == loss and all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="has no skipped"):
        again.load_state_dict({"scale": 2.0, "growth_tracker": 0})


def test_adam_clipping_and_lr_scheduler_work_unchanged():
    model, reference = mlp(), mlp()
    data = batches(4, 16)
    pipe = gpipe.GPipe(model, balance=[3, 5], chunks=4)

    def run(forward_backward, params):
        opt = torch.optim.Adam(params, lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for x, y in data:
            opt.zero_grad()
            forward_backward(x, y)
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()

    run(lambda x, y: pipe.train_step(x, y), list(model.parameters()))
    run(lambda x, y: torch.nn.functional.cross_entropy(reference(x), y).backward(), list(reference.parameters()))
    assert_same_parameters(model, reference)


@torch.jit.script
def half_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((output - target) ** 2).mean()


@pytest.mark.parametrize("loss,loss_fn", [("mse", torch.nn.functional.mse_loss), (half_mse, half_mse)])
def test_mse_and_a_scripted_loss(loss, loss_fn):
    model, reference = mlp(), mlp()
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(10, 12, generator=g), torch.randn(10, 5, generator=g)) for _ in range(2)]
    make_opt = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    pipe = gpipe.GPipe(model, balance=[5, 3], chunks=3, schedule="1f1b")
    train_gpipe(pipe, model, data, loss, make_opt)
    train_reference(reference, data, loss_fn, make_opt)
    assert_same_parameters(model, reference)


def test_balance_none_cuts_by_measured_time_on_the_first_batch():
    model, reference = mlp(), mlp()
    data = batches(2, 16)
    pipe = gpipe.GPipe(model, chunks=4, devices=2, schedule="gpipe")
    assert pipe.balance is None
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    assert len(pipe.balance) == 2 and sum(pipe.balance) == len(model)
    train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
    assert_same_parameters(model, reference)


def test_schedule_auto_runs_the_fastest_predicted_on_the_first_batch_and_trains_as_one_device():
    model, reference = mlp(), mlp()
    data = batches(2, 16)
    pipe = gpipe.GPipe(model, chunks=4, devices=2, schedule="auto")
    assert pipe.schedule is None and pipe.predicted is None and pipe.config is None
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    assert pipe.schedule in gpipe.schedule_names() and sum(pipe.balance) == len(model)
    assert len(pipe.balance) == 2 * pipe.virtual_stages
    step_s, bubble = pipe.predicted
    assert step_s > 0 and 0 <= bubble < 1
    # The pipeline that runs, as one value: what the properties say, and its fields as a checkpoint records them.
    config = pipe.config
    assert isinstance(config, gpipe.PipelineConfig) and config == pipe.config
    assert (config.schedule, config.devices, config.virtual_stages, config.micro_batches, config.balance,
            config.checkpoint) == (pipe.schedule, 2, pipe.virtual_stages, 4, pipe.balance, pipe.checkpoint)
    fields = config.fields()
    assert fields["schedule"] == config.schedule and fields["balance"] == config.balance
    assert ("stage_times" in fields) == bool(config.stage_times)
    assert all(len(times) == 3 for times in config.stage_times) and config.schedule in repr(config)
    train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
    assert_same_parameters(model, reference)
    # A given balance stays: only the schedules of its K·V stages are weighed.
    kept = gpipe.GPipe(mlp(), balance=[3, 5], chunks=4, schedule="auto")
    kept.train_step(*data[0])
    assert kept.balance == [3, 5] and kept.virtual_stages == 1 and kept.schedule in ("gpipe", "1f1b", "zb1p")


def test_defaults_choose_the_schedule_chunks_and_checkpoint_on_the_first_batch_and_train_as_one_device():
    model, reference = mlp(), mlp()
    data = batches(2, 32)
    pipe = gpipe.GPipe(model, devices=2)
    assert pipe.chunks is None and pipe.checkpoint is None  # chosen on the first batch
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    assert pipe.schedule in gpipe.schedule_names() and pipe.chunks >= 1 and pipe.predicted is not None
    assert pipe.checkpoint == "never"  # the memory predicted fits: no re-materialization
    train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
    assert_same_parameters(model, reference)
    # A named schedule without chunks: 4 micro-batches per device; the paper's re-materialization.
    named = gpipe.GPipe(mlp(), devices=2, schedule="1f1b", balance=[4, 4])
    assert named.chunks == 8 and named.checkpoint == "except_last"
    assert gpipe.GPipe(mlp(), schedule="interleaved", balance=[2, 2, 2, 2]).chunks == 8  # K=2, V=2
    assert gpipe.GPipe(mlp(), schedule="interleaved", devices=2).chunks == 8
    two = gpipe.GPipe(mlp(), devices=2, virtual_stages=2)  # auto among the schedules of V=2
    two.train_step(*data[0])
    assert two.virtual_stages == 2 and len(two.balance) == 4


OPTIMIZERS = [lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.Adam(p, lr=1e-2),
              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)]


def same_to_the_bit(model, reference):
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def assert_same_optimizer_state(opt, model, reference_opt, reference):
    """The optimizer states of the same parameters of two models, to the bit."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert opt.state[p].keys() == reference_opt.state[q].keys(), name
        for key, value in reference_opt.state[q].items():
            other = opt.state[p][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, (name, key)


@pytest.mark.parametrize("make_opt", OPTIMIZERS, ids=["sgd-momentum", "adam", "adamw"])
def test_update_on_devices_is_the_step_after_train_step_to_the_bit(make_opt):
    # Dropout draws from the step's seed: both runs start from the same generator state.
    data = batches(5, 24)
    runs = []
    for on_devices in (False, True):
        model = mlp(dropout=0.2)
        pipe = gpipe.GPipe(model, balance=[2, 2, 2, 2], chunks=4, schedule="interleaved")
        opt = make_opt(model.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)  # each step's update at that step's rate
        torch.manual_seed(7)
        outputs = []
        with pipe.update_on_devices(opt) if on_devices else contextlib.nullcontext():
            for n, (x, y) in enumerate(data):
                opt.zero_grad()
                pipe.train_step(x, y)
                opt.step()  # within the block: nothing to do (.grad is None), as a plain loop may still call it
                scheduler.step()
                if n == 2:  # pipe(x) applies the held update first
                    model.eval()
                    outputs.append(pipe(x))
                    model.train()
        runs.append((model, opt, outputs))
    (plain, plain_opt, plain_out), (held, held_opt, held_out) = runs
    assert same_to_the_bit(held, plain)
    assert all(torch.equal(a, b) for a, b in zip(held_out, plain_out))
    assert_same_optimizer_state(held_opt, held, plain_opt, plain)
    assert all(p.grad is None for p in held.parameters())  # the last step's gradients went with its update


def plain_and_on_devices(setup, steps=6):
    """(model, optimizer) of the plain loop, opt.zero_grad(); pipe.train_step(x, y); opt.step(), and of
    the same steps within update_on_devices, each from mlp(). `setup(model)` gives the optimizer and
    `change(n, when, pipe)`, which both loops run at step n "before" its train_step, "after" it (in
    the plain loop before opt.step()) and at its "end"."""
    data = batches(steps, 16)
    runs = []
    for on_devices in (False, True):
        model = mlp()
        pipe = gpipe.GPipe(model, balance=[2, 2, 2, 2], chunks=4, schedule="interleaved")
        opt, change = setup(model)
        with pipe.update_on_devices(opt) if on_devices else contextlib.nullcontext():
            for n, (x, y) in enumerate(data):
                change(n, "before", pipe)
                if not on_devices:
                    opt.zero_grad()
                pipe.train_step(x, y)
                change(n, "after", pipe)
                if not on_devices:
                    opt.step()
                change(n, "end", pipe)
        runs.append((model, opt))
    return runs


def params(*layers):
    return [p for layer in layers for p in layer.parameters()]


def sgd_with_groups(model):  # momentum and weight decay: a zero gradient still moves a parameter
    return torch.optim.SGD([{"params": params(model[0])}, {"params": params(model[2]), "lr": 0.05}],
                           lr=0.1, momentum=0.9, weight_decay=0.01)


def adam_with_groups(model):
    return torch.optim.Adam([{"params": params(model[0])}, {"params": params(model[2]), "lr": 3e-3}], lr=1e-2)


def a_group_added(model, make_opt):  # layer 5 trains from the start but joins the optimizer at step 2
    opt = make_opt(model)

    def change(n, when, pipe):
        if n == 2 and when == "before":
            opt.add_param_group({"params": params(model[5], model[7]), "lr": 0.02})
    return opt, change


def a_group_removed_and_added_again(model, make_opt):
    opt = make_opt(model)

    def change(n, when, pipe):
        if n == 1 and when == "end":
            opt.add_param_group({"params": params(model[5])})
        if n == 3 and when == "before":
            opt.param_groups.pop()
        if n == 4 and when == "before":
            opt.add_param_group({"params": params(model[5]), "lr": 0.03})
    return opt, change


def a_groups_parameters_swapped(model, make_opt):
    opt = make_opt(model)

    def change(n, when, pipe):
        if n == 2 and when == "before":
            opt.param_groups[1]["params"] = params(model[5])
    return opt, change


def step_lr(model, make_opt):  # each group's rate halved after each step
    opt = make_opt(model)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    return opt, lambda n, when, pipe: when == "end" and scheduler.step()


def lambda_lr(model, make_opt):  # a schedule of its own per group
    opt = make_opt(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, [lambda n: 1 / (n + 1), lambda n: 0.9 ** n])
    return opt, lambda n, when, pipe: when == "end" and scheduler.step()


def frozen_from_the_start(model, make_opt):
    model[2].weight.requires_grad_(False)
    return make_opt(model), lambda n, when, pipe: None


def unfrozen_after_two_steps(model, make_opt):
    model[2].weight.requires_grad_(False)
    return make_opt(model), lambda n, when, pipe: n == 2 and when == "before" and model[2].weight.requires_grad_(True)


def frozen_after_two_steps(model, make_opt):  # the plain loop's zero_grad() leaves zeros (torch 1.x) or None
    return make_opt(model), lambda n, when, pipe: n == 2 and when == "before" and model[0].weight.requires_grad_(False)


def clipped(model, make_opt):
    return make_opt(model), lambda n, when, pipe: when == "after" and pipe.clip_grad_norm_(0.2)


CHANGES = [a_group_added, a_group_removed_and_added_again, a_groups_parameters_swapped, step_lr, lambda_lr,
           frozen_from_the_start, unfrozen_after_two_steps, frozen_after_two_steps, clipped]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__ for c in CHANGES])
@pytest.mark.parametrize("make_opt", [sgd_with_groups, adam_with_groups], ids=["sgd", "adam"])
def test_update_on_devices_follows_the_optimizers_changes_to_the_bit(change, make_opt):
    (plain, plain_opt), (held, held_opt) = plain_and_on_devices(lambda model: change(model, make_opt))
    for (name, p), q in zip(held.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    assert_same_optimizer_state(held_opt, held, plain_opt, plain)
    assert [len(g["params"]) for g in held_opt.param_groups] == [len(g["params"]) for g in plain_opt.param_groups]


def test_torchs_clips_refuse_the_gradients_update_on_devices_holds_and_pipe_clip_grad_norm_clips_them():
    model, reference = mlp(), mlp()
    data = batches(4, 16)
    pipe = gpipe.GPipe(model, balance=[4, 4], chunks=2, schedule="gpipe")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    import torch.nn.utils.clip_grad as clip_grad
    torchs_own = torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_
    torchs_module_own = clip_grad.clip_grad_norm_, clip_grad.clip_grad_value_
    with pipe.update_on_devices(opt):
        for x, y in data:
            pipe.train_step(x, y)
            with pytest.raises(ValueError, match=r"clip_grad_norm_ within update_on_devices finds no gradient.*"
                                                 r"pipe\.clip_grad_norm_\(max_norm\)"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            with pytest.raises(ValueError, match=r"clip_grad_value_ within update_on_devices.*opt\.step\(\) outside"):
                torch.nn.utils.clip_grad_value_(model[0].weight, 0.01)
            other = torch.nn.Linear(2, 2)  # gradients the block does not hold clip as ever
            other(torch.ones(1, 2)).sum().backward()
            assert torch.nn.utils.clip_grad_norm_(other.parameters(), 0.1) > 0.1
            assert torch.nn.utils.clip_grad_norm_(other.parameters(), 0.1) <= 0.1 + 1e-6
            assert pipe.clip_grad_norm_(0.1) > 0.1
        pipe(data[0][0])  # the held update applied: nothing held, and .grad still empty
        with pytest.raises(ValueError, match=r"clip_grad_norm_ within update_on_devices finds no gradient"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_) == torchs_own
    assert (clip_grad.clip_grad_norm_, clip_grad.clip_grad_value_) == torchs_module_own
    # Torch's own back also when the block ends by an exception.
    with pytest.raises(RuntimeError, match="leaving the block"):
        with pipe.update_on_devices(torch.optim.SGD(model.parameters(), lr=0.0)):
            raise RuntimeError("leaving the block")
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_) == torchs_own
    # As the plain loop that clips with torch's own (gpipe sums the norm in double: to rounding).
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for x, y in data:
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        ref_opt.step()
    assert_same_parameters(model, reference)


def test_update_on_devices_after_a_failed_step_leaves_the_last_steps_parameters():
    data = batches(3, 12)
    model, reference = mlp(), mlp()
    make_opt = OPTIMIZERS[1]
    ref_opt = make_opt(reference.parameters())
    for x, y in data[:2]:
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()

    @torch.jit.script
    def not_a_scalar(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output.sum(1)

    pipe = gpipe.GPipe(model, balance=[2, 2, 2, 2], chunks=4, schedule="interleaved")
    opt = make_opt(model.parameters())
    with pipe.update_on_devices(opt):
        for x, y in data[:2]:
            pipe.train_step(x, y)
        with pytest.raises(RuntimeError, match="scalar"):
            pipe.train_step(*data[2], loss=not_a_scalar)
        assert_same_parameters(model, reference)  # the second step's update applied, the failed one's none
        pipe.train_step(*data[2])  # and training goes on
    assert not same_to_the_bit(model, reference)


def test_update_on_devices_refuses_what_it_cannot_split():
    model = mlp()
    pipe = gpipe.GPipe(model, balance=[4, 4], chunks=2, schedule="gpipe")
    with pytest.raises(ValueError, match="per-parameter optimizers.*LBFGS.*optimizer.step"):
        with pipe.update_on_devices(torch.optim.LBFGS(model.parameters())):
            pass
    stranger = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not the model's"):
        with pipe.update_on_devices(torch.optim.SGD(list(model.parameters()) + [stranger], lr=0.1)):
            pass
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pipe.update_on_devices(opt):
        with pytest.raises(ValueError, match="already active"):
            with pipe.update_on_devices(opt):
                pass


def test_update_on_devices_refuses_a_second_block_over_the_same_parameters_and_a_foreign_one_later():
    model = mlp()
    first = gpipe.GPipe(model, balance=[4, 4], chunks=2, schedule="gpipe")
    second = gpipe.GPipe(model, balance=[4, 4], chunks=2, schedule="1f1b")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(2, 8)
    with first.update_on_devices(opt):
        first.train_step(*data[0])
        with pytest.raises(ValueError, match="another GPipe's update_on_devices block holds"):
            with second.update_on_devices(opt):
                pass
        stranger = torch.nn.Parameter(torch.zeros(3))
        stranger.grad = torch.ones(3)
        opt.add_param_group({"params": [stranger]})
        with pytest.raises(ValueError, match="not the model's .added by add_param_group"):
            first.train_step(*data[1])
        opt.param_groups.pop()
    with second.update_on_devices(opt):  # the first block has ended
        second.train_step(*data[1])


def test_update_on_devices_drops_the_held_update_when_the_optimizer_state_is_loaded():
    model = mlp()
    pipe = gpipe.GPipe(model, balance=[4, 4], chunks=2, schedule="gpipe")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(3, 8)
    with pipe.update_on_devices(opt):
        pipe.train_step(*data[0])
        pipe(data[0][0])  # applies the held update: the checkpoint is taken after it, as a plain loop's
        saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        pipe.train_step(*data[1])
        model.load_state_dict(saved_model)  # back to the checkpoint: the update held since is dropped
        opt.load_state_dict(saved_opt)
        with pytest.warns(RuntimeWarning, match="update was dropped"):
            pipe.train_step(*data[2])
    # As a plain loop that reloads the same checkpoint after its second step.
    reference = mlp()
    ref_pipe = gpipe.GPipe(reference, balance=[4, 4], chunks=2, schedule="gpipe")
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for n, (x, y) in enumerate(data):
        ref_opt.zero_grad()
        ref_pipe.train_step(x, y)
        ref_opt.step()
        if n == 0:
            ref_pipe(x)
            ref_saved = copy.deepcopy(reference.state_dict()), copy.deepcopy(ref_opt.state_dict())
        if n == 1:
            reference.load_state_dict(ref_saved[0])
            ref_opt.load_state_dict(ref_saved[1])
    assert same_to_the_bit(model, reference)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"])


def unet_like():
    torch.manual_seed(4)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16), gpipe.Stash("a"), torch.nn.ReLU(), torch.nn.Linear(16, 16), gpipe.Stash("b"),
        torch.nn.Tanh(), torch.nn.Linear(16, 16), gpipe.Pop("b", "concat"), torch.nn.Linear(32, 16),
        gpipe.Pop("a"), torch.nn.Linear(16, 5))


def test_skip_connections_across_stages():
    model, reference = unet_like(), unet_like()
    data = batches(3, 14)
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    for schedule in ("gpipe", "zb1p"):
        pipe = gpipe.GPipe(model, balance=[3, 3, 3, 2], chunks=3, schedule=schedule)
        train_gpipe(pipe, model, data, "cross_entropy", make_opt)
        train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
        assert_same_parameters(model, reference)


def assert_cli_trains_as_one_device(tmp_path, model, reference, *cut):
    """`model` saved as TorchScript and trained one SGD step by `gpipe train` over 2 stages cut as
    `cut` says ends with the parameters of `reference` trained so in plain PyTorch."""
    torch.jit.script(model).save(str(tmp_path / "model.pt"))
    (x, y), = batches(1, 14)
    torch.save({"input": x, "target": y}, str(tmp_path / "data.pt"))
    done = subprocess.run([os.environ["GPIPE_CLI"], "train", "--model", str(tmp_path / "model.pt"), "--data",
                           str(tmp_path / "data.pt"), "--optimizer", "sgd", "--lr", "0.1", "--batch-size", "14",
                           "--steps", "1", "--stages", "2", "--micro-batches", "2", *cut, "--save",
                           str(tmp_path / "trained.pt")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    trained = torch.jit.load(str(tmp_path / "trained.pt"))
    train_reference(reference, [(x, y)], torch.nn.functional.cross_entropy,
                    lambda params: torch.optim.SGD(params, lr=0.1))
    assert_same_parameters(trained, reference)


@pytest.mark.skipif(not os.environ.get("GPIPE_CLI"), reason="GPIPE_CLI names the gpipe program (ctest sets it)")
def test_a_model_with_skips_saved_from_python_trains_in_gpipe_train(tmp_path):
    """The TorchScript file of a model with gpipe.Stash and gpipe.Pop loads in the C++ program (the
    library registers their ops), which trains it as PyTorch does."""
    assert_cli_trains_as_one_device(tmp_path, unet_like(), unet_like(), "--balance", "5,6")


def test_a_weight_tied_across_stages_gets_one_gradient_and_one_update():
    def tied():
        torch.manual_seed(5)
        embedding = torch.nn.Embedding(20, 16)
        return torch.nn.Sequential(embedding, torch.nn.Linear(16, 16), torch.nn.Tanh(), TiedHead(embedding))

    model, reference = tied(), tied()
    g = torch.Generator().manual_seed(6)
    data = [(torch.randint(20, (8, 4), generator=g), torch.randint(20, (8, 4), generator=g)) for _ in range(3)]

    def loss_fn(out, y):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))

    make_opt = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
    pipe = gpipe.GPipe(model, balance=[2, 2], chunks=2)
    train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    train_reference(reference, data, loss_fn, make_opt)
    assert model[0].weight is model[3].weight
    assert_same_parameters(model, reference)


def bn_model(seed=7):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 5))


def test_batch_norm_deferred_follows_the_papers_rule():
    """Each micro-batch normalized by its own statistics; the running statistics updated once per
    step from all the step's rows (their mean and unbiased variance), with the layer's momentum."""
    model, reference = bn_model(), bn_model()
    data = batches(2, 18)
    M = 3
    pipe = gpipe.GPipe(model, balance=[2, 4], chunks=M)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    norms = [m for m in reference if isinstance(m, torch.nn.BatchNorm1d)]
    for x, y in data:
        opt.zero_grad()
        pipe.train_step(x, y)
        opt.step()
        # The reference: micro-batches one by one, the running statistics frozen, then updated once.
        inputs = {id(n): [] for n in norms}
        hooks = [n.register_forward_pre_hook(lambda m, a: inputs[id(m)].append(a[0].detach())) for n in norms]
        frozen = [(n.running_mean.clone(), n.running_var.clone(), n.num_batches_tracked.clone()) for n in norms]
        ref_opt.zero_grad()
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (torch.nn.functional.cross_entropy(reference(xm), ym) * len(xm) / len(x)).backward()
        for h in hooks:
            h.remove()
        for n, (mean, var, count) in zip(norms, frozen):
            rows = torch.cat(inputs[id(n)])
            n.running_mean.copy_((1 - n.momentum) * mean + n.momentum * rows.mean(0))
            n.running_var.copy_((1 - n.momentum) * var + n.momentum * rows.var(0, unbiased=True))
            n.num_batches_tracked.copy_(count + 1)
        ref_opt.step()
    assert_same_parameters(model, reference)
    for a, b in zip(model.buffers(), reference.buffers()):
        assert torch.allclose(a.float(), b.float(), rtol=RTOL, atol=1e-6)


def test_inference_in_training_mode_updates_batch_norm_once_per_call():
    """pipe(x) in training mode: the running statistics once per call from all its rows (num_batches_tracked
    1, not one per micro-batch); the first BatchNorm, whose input is the same, as model(x) gives them (a later
    one sees rows that each micro-batch's own statistics normalized)."""
    model, reference = bn_model(), bn_model()
    pipe = gpipe.GPipe(model, balance=[2, 4], chunks=3)
    x = torch.randn(18, 12) * 2 + 1
    with torch.no_grad():
        pipe(x)
        reference(x)
    for name, a in model.named_buffers():
        if name.endswith("num_batches_tracked"):
            assert a.item() == 1, name
    for a, b in zip(model[1].buffers(), reference[1].buffers()):
        assert torch.allclose(a.float(), b.float(), rtol=RTOL, atol=1e-6)


def test_dropout_masks_are_the_same_whatever_the_schedule_and_checkpoint_mode():
    """Against gpipe's own reference: the masks follow (step, stage, micro-batch), so every schedule
    and re-materialization mode over the same cut gives the same parameters; and they do drop."""
    data = batches(2, 16)
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    results = []
    for schedule, checkpoint in [("gpipe", "never"), ("gpipe", "always"), ("1f1b", "except_last"),
                                 ("zb1p", "always")]:
        model = mlp(dropout=0.5)
        torch.manual_seed(11)  # the stream each step's seed is drawn from
        pipe = gpipe.GPipe(model, balance=[4, 4], chunks=4, schedule=schedule, checkpoint=checkpoint)
        train_gpipe(pipe, model, data, "cross_entropy", make_opt)
        results.append(model)
    for other in results[1:]:
        assert_same_parameters(other, results[0], rtol=1e-6)
    without = mlp(dropout=0.0)
    torch.manual_seed(11)
    train_gpipe(gpipe.GPipe(without, balance=[4, 4], chunks=4), without, data, "cross_entropy", make_opt)
    assert any(not torch.allclose(p, q) for p, q in zip(without.parameters(), results[0].parameters()))


def splitmix64_finalizer(x):
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


def train_reference_with_gpipe_masks(reference, balance, chunks, data, make_opt):
    """One device, plain autograd, drawing Dropout's masks as gpipe's rule says: a step draws one
    seed from the default generator; stage s seeds it with mix(seed ^ mix(s << 32 | i)) before
    its layers run micro-batch i; afterwards the generator is where the seed draw left it."""
    opt = make_opt(reference.parameters())
    cuts = [sum(balance[:s]) for s in range(len(balance) + 1)]
    for x, y in data:
        opt.zero_grad()
        seed = torch.randint(2**63 - 1, (1,)).item()
        after_draw = torch.get_rng_state()
        rows = x.size(0)
        for i, (xi, yi) in enumerate(zip(x.chunk(chunks), y.chunk(chunks))):
            h = xi
            for s in range(len(balance)):
                torch.manual_seed(splitmix64_finalizer(seed ^ splitmix64_finalizer((s << 32) | i)))
                h = reference[cuts[s]:cuts[s + 1]](h)
            (torch.nn.functional.cross_entropy(h, yi) * (xi.size(0) / rows)).backward()
        torch.set_rng_state(after_draw)
        opt.step()


@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", "never"), ("1f1b", "always"), ("zb1p", "except_last")])
def test_dropout_trains_as_gpipes_one_device_reference(schedule, checkpoint):
    model, reference = mlp(dropout=0.5), mlp(dropout=0.5)
    data = batches(3, 16)
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    torch.manual_seed(5)
    train_gpipe(gpipe.GPipe(model, balance=[4, 4], chunks=4, schedule=schedule, checkpoint=checkpoint),
                model, data, "cross_entropy", make_opt)
    torch.manual_seed(5)
    train_reference_with_gpipe_masks(reference, [4, 4], 4, data, make_opt)
    assert_same_parameters(model, reference)
    # The reference is not vacuous: other seeds give other masks, and other parameters.
    other = mlp(dropout=0.5)
    torch.manual_seed(6)
    train_reference_with_gpipe_masks(other, [4, 4], 4, data, make_opt)
    assert any(not torch.allclose(p, q) for p, q in zip(other.parameters(), reference.parameters()))


def test_inference_equals_the_model_and_keeps_no_graph():
    model = mlp()
    pipe = gpipe.GPipe(model, balance=[4, 4], chunks=3)
    x = torch.randn(7, 12)
    out = pipe(x)
    assert not out.requires_grad
    assert torch.allclose(out, model(x), rtol=RTOL, atol=1e-6)


def test_parameters_are_the_models_own():
    model = mlp()
    pipe = gpipe.GPipe(model, balance=[4, 4], schedule="gpipe")
    assert all(any(p is q for q in model.parameters()) for p in pipe.parameters())
    assert len(pipe.parameters()) == len(list(model.parameters()))


def test_state_dict_round_trip():
    model, reference = mlp(), mlp()
    pipe = gpipe.GPipe(model, balance=[4, 4], chunks=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1, 8)[0]
    opt.zero_grad()
    pipe.train_step(x, y)
    opt.step()
    reference.load_state_dict(copy.deepcopy(model.state_dict()))
    assert_same_parameters(reference, model, rtol=0)


class Bilinear(torch.nn.Module):
    """A merge with a parameter of its own, which a Pop refuses."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return x + self.scale * skip


class Shortcut(torch.nn.Module):
    """A ResNet block's shortcut to half the pixels and twice the channels: every other pixel,
    the new channels zeros."""

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        sampled = skip[:, :, ::2, ::2]
        return x + torch.nn.functional.pad(sampled, [0, 0, 0, 0, 0, x.size(1) - skip.size(1)])


def test_a_pop_with_a_merge_module_of_its_own():
    def resnet_like():
        torch.manual_seed(8)
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1), gpipe.Stash("block"), torch.nn.Conv2d(4, 8, 3, stride=2, padding=1),
            torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1), gpipe.Pop("block", Shortcut()), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5))

    model, reference = resnet_like(), resnet_like()
    g = torch.Generator().manual_seed(9)
    data = [(torch.randn(6, 1, 8, 8, generator=g), torch.randint(5, (6,), generator=g)) for _ in range(2)]
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    pipe = gpipe.GPipe(model, balance=[3, 3, 3], chunks=2)
    train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
    assert_same_parameters(model, reference)
    with pytest.raises(ValueError, match="merge module of Pop.*has parameters"):
        bad = torch.nn.Sequential(torch.nn.Linear(2, 2), gpipe.Stash("s"), gpipe.Pop("s", Bilinear()))
        gpipe.GPipe(bad, balance=[1, 2])
    with pytest.raises(ValueError, match="merges by"):
        gpipe.Pop("block", "multiply")


def test_the_layers_run_in_the_models_train_or_eval_mode():
    model = mlp(dropout=0.5)
    pipe = gpipe.GPipe(model, balance=[4, 4], chunks=2)
    x = torch.randn(6, 12)
    model.eval()
    assert torch.allclose(pipe(x), model(x), rtol=RTOL, atol=1e-6), "eval: no dropout, as the model itself"
    model.train()
    assert not torch.allclose(pipe(x), model.eval()(x)), "train: dropout drops"


def test_balance_none_with_the_interleaved_schedule_cuts_k_times_v_stages():
    model, reference = mlp(), mlp()
    data = batches(2, 16)
    pipe = gpipe.GPipe(model, chunks=4, devices=2, schedule="interleaved")
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    assert len(pipe.balance) == 4 and pipe.placement == [0, 1, 0, 1]
    train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
    assert_same_parameters(model, reference)
    # V given: K·V stages.
    model, reference = mlp(), mlp()
    pipe = gpipe.GPipe(model, chunks=4, devices=2, schedule="interleaved", virtual_stages=3)
    train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    assert len(pipe.balance) == 6 and pipe.placement == [0, 1, 0, 1, 0, 1]
    train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
    assert_same_parameters(model, reference)


@pytest.mark.parametrize("schedule", ["zbv", "v-half"])
def test_v_schedules_place_their_stages_as_a_v(schedule):
    model, reference = mlp(), mlp()
    data = batches(2, 16)
    pipe = gpipe.GPipe(model, chunks=4, devices=2, schedule=schedule)
    assert schedule in gpipe.schedule_names()
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    train_gpipe(pipe, model, data, "cross_entropy", make_opt)
    assert len(pipe.balance) == 4 and pipe.placement == [0, 1, 1, 0] and pipe.virtual_stages == 2
    train_reference(reference, data, torch.nn.functional.cross_entropy, make_opt)
    assert_same_parameters(model, reference)


def transformer(dropout):
    torch.manual_seed(10)
    blocks = [torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=dropout, batch_first=True) for _ in range(2)]
    return torch.nn.Sequential(torch.nn.Embedding(20, 16), *blocks, torch.nn.Linear(16, 20))


def test_layers_whose_dropout_is_zero_draw_no_random_numbers():
    """A TransformerEncoderLayer built with dropout=0.0 calls dropout with p = 0: it draws nothing,
    so its stages need no seeded random stream (and their forwards overlap); with p > 0 they draw."""
    x, y = torch.randint(20, (8, 5)), torch.randint(20, (8, 5))
    for dropout, draws in ((0.0, False), (0.1, True)):
        pipe = gpipe.GPipe(transformer(dropout), balance=[2, 2], chunks=2)
        before = torch.get_rng_state()
        pipe.train_step(x, y)
        assert (not torch.equal(before, torch.get_rng_state())) == draws, f"dropout={dropout}"


def test_summary_prints_the_lines_gpipe_train_prints():
    model = mlp()
    pipe = gpipe.GPipe(model, balance=[2, 2, 2, 2], chunks=2, schedule="interleaved", devices=2)
    summary = gpipe.Summary(pipe)
    assert pipe.bubble == 0.0, "no step yet"
    for x, y in batches(2, 8):
        with summary.step(len(x)):
            pipe.train_step(x, y)
    lines = summary.text(accuracy=0.5).splitlines()
    assert lines[:3] == ["", "summary", "  test accuracy  50.00%"]
    assert lines[3].startswith("  training time  ") and lines[3].endswith(" s (2 steps)")
    assert lines[4].startswith("  throughput     ") and lines[4].endswith(" samples/s")
    assert lines[5].endswith("% of device time idle (measured)")
    assert lines[6] == ("  partition      stage 0 (device 0): 2 layers | stage 1 (device 1): 2 layers | "
                        "stage 2 (device 0): 2 layers | stage 3 (device 1): 2 layers")
    assert len(lines) == 7


def test_summary_leaves_out_the_first_batchs_build():
    pipe = gpipe.GPipe(mlp(), devices=2)  # schedule="auto": the first batch profiles the layers
    summary = gpipe.Summary(pipe)
    (x, y), = batches(1, 16)
    begin = time.perf_counter()
    with summary.step(len(x)):
        pipe.train_step(x, y)
    whole = time.perf_counter() - begin
    assert 0 < pipe.build_seconds < whole
    assert 0 < summary.seconds <= whole - pipe.build_seconds + 1e-6


@pytest.mark.parametrize("schedule", ["gpipe", "auto"])  # cut by measured time; auto: profiled for its choice
def test_balance_none_keeps_the_gradients_already_there(schedule):
    """Timing the layers for the cut runs backward through the model's parameters: the gradients
    they held before are kept, and the first step adds to them as loss.backward() would."""
    model, reference = mlp(), mlp()
    for m in (model, reference):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
    (x, y), = batches(1, 16)
    gpipe.GPipe(model, chunks=4, devices=2, schedule=schedule).train_step(x, y)
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("schedule", ["gpipe", "auto"])
def test_balance_none_profiles_without_touching_the_models_buffers_or_random_numbers(schedule):
    """The cut by measured time runs the layers in training mode; BatchNorm's running statistics
    and the random numbers are as if it had not: the same as a pipeline given its balance."""
    timed, given = bn_model(), bn_model()
    (x, y), = batches(1, 16)
    torch.manual_seed(3)
    gpipe.GPipe(timed, chunks=2, devices=2, schedule=schedule).train_step(x, y)
    timed_rng = torch.get_rng_state()
    torch.manual_seed(3)
    gpipe.GPipe(given, balance=[3, 3], chunks=2, schedule="gpipe").train_step(x, y)
    assert torch.equal(timed_rng, torch.get_rng_state())
    for (name, a), b in zip(timed.named_buffers(), given.buffers()):
        if name.endswith("num_batches_tracked"):
            assert a.item() == b.item() == 1, name
        else:
            assert torch.allclose(a, b, rtol=RTOL, atol=1e-6), name


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_cross_entropy_ignores_targets_of_minus_100_as_torch_does(chunks):
    """PyTorch's mean over the targets not ignored, of the whole batch: each micro-batch weighs by
    its counted targets; one whose targets are all ignored counts for nothing (not NaN)."""
    model, reference = mlp(), mlp()
    (x, y), = batches(1, 16)
    y[:4] = -100  # with chunks=4, the first micro-batch is all padding
    y[9] = -100
    pipe = gpipe.GPipe(model, balance=[3, 5], chunks=chunks)
    loss = pipe.train_step(x, y)
    expected = torch.nn.functional.cross_entropy(reference(x), y)
    expected.backward()
    assert abs(loss - expected.item()) <= 1e-6 * abs(expected.item())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=RTOL, atol=1e-7)


def test_cross_entropy_takes_class_probabilities_as_torch_does():
    model, reference = mlp(), mlp()
    (x, _), = batches(1, 16)
    probabilities = torch.softmax(torch.randn(16, 5, generator=torch.Generator().manual_seed(2)), 1)
    loss = gpipe.GPipe(model, balance=[3, 5], chunks=4).train_step(x, probabilities)
    expected = torch.nn.functional.cross_entropy(reference(x), probabilities)
    expected.backward()
    assert abs(loss - expected.item()) <= 1e-6 * abs(expected.item())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=RTOL, atol=1e-7)


@pytest.mark.parametrize("schedule,balance", [("gpipe", [3, 5]), ("zb1p", [3, 5]), ("interleaved", [2, 2, 2, 2])])
def test_an_input_that_requires_grad_gets_its_gradient_as_backward_gives_it(schedule, balance):
    model, reference = mlp(), mlp()
    (x, y), = batches(1, 16)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    gpipe.GPipe(model, balance=balance, chunks=4, schedule=schedule).train_step(x1, y)
    torch.nn.functional.cross_entropy(reference(x2), y).backward()
    assert x1.grad is not None
    assert torch.allclose(x1.grad, x2.grad, rtol=RTOL, atol=1e-8)
    # A tensor computed from a leaf: the gradient goes on to the leaf, as backward's would.
    w1, w2 = torch.ones(12, requires_grad=True), torch.ones(12, requires_grad=True)
    gpipe.GPipe(mlp(), balance=balance, chunks=4, schedule=schedule).train_step(x * w1, y)
    torch.nn.functional.cross_entropy(mlp()(x * w2), y).backward()
    assert torch.allclose(w1.grad, w2.grad, rtol=RTOL, atol=1e-7)


def test_a_subclass_of_sequential_that_keeps_its_forward_trains_as_one():
    class Named(torch.nn.Sequential):
        pass

    model, reference = Named(*mlp()), mlp()
    data = batches(2, 8)
    pipe = gpipe.GPipe(model, balance=[3, 5], chunks=2)
    train_gpipe(pipe, model, data, "cross_entropy",
                lambda p: torch.optim.SGD(p, lr=0.1))
    train_reference(reference, data, torch.nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1))
    assert_same_parameters(model, reference)


def test_a_layer_left_in_eval_mode_stays_so_when_wrapped():
    # A frozen BatchNorm (model.train(), then bn.eval()): wrapping keeps its mode, and a training
    # step uses its running statistics without updating them, as plain PyTorch does.
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 5))
    model.train()
    model[1].eval()
    reference = copy.deepcopy(model)
    pipe = gpipe.GPipe(model, balance=[2, 2], chunks=2)
    assert model.training and not model[1].training
    data = batches(2, 8)
    train_reference(reference, data, torch.nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1))
    train_gpipe(pipe, model, data, "cross_entropy", lambda p: torch.optim.SGD(p, lr=0.1))
    assert int(model[1].num_batches_tracked) == 0
    assert torch.equal(model[1].running_mean, reference[1].running_mean)
    assert_same_parameters(model, reference)
