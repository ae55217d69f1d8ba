"""Models as their authors wrote them, not a torch.nn.Sequential: gpipe traces them with torch.fx,
cuts them into pieces and trains them as plain PyTorch on one device does (one step compared,
gradient by gradient, since several steps at a high rate amplify rounding chaotically); BatchNorms
inside blocks defer their running statistics to the end of the mini-batch (the paper's rule)."""
import copy
import os
import subprocess
import sys

import pytest
import torch

import gpipe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python"))
from gpt2 import GPT  # noqa: E402  (a ModuleList of blocks, a loop in forward, a tied head)

RTOL = 1e-5


@torch.jit.script
def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def assert_same_gradients(model, reference, rtol=RTOL):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:  # a branch not taken
            assert p.grad is None, name
            continue
        scale = q.grad.abs().max().item() + 1e-12
        assert (p.grad - q.grad).abs().max().item() <= rtol * scale + 1e-7, name


def one_step(make, x, y, loss, **options):
    """A GPipe step of a fresh model and one device's step of its copy; (model, reference, pipe, losses)."""
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    pipe = gpipe.GPipe(model, **options)
    value = pipe.train_step(x, y, loss=loss)
    expected = loss(reference(x), y) if callable(loss) else torch.nn.functional.cross_entropy(reference(x), y)
    expected.backward()
    return model, reference, pipe, (value, expected.item())


def gpt():
    return GPT(vocab=40, width=32, heads=2, blocks=4, length=16)


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1p", "interleaved", "zbv"])
def test_a_gpt2_written_with_a_module_list_trains_as_one_device(schedule, devices):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(40, (12, 16), generator=g), torch.randint(40, (12, 16), generator=g)
    model, reference, pipe, (loss, expected) = one_step(gpt, x, y, lm_loss, chunks=2 * devices, devices=devices,
                                                        schedule=schedule)
    assert loss == pytest.approx(expected, rel=RTOL)
    assert len(pipe.balance) == devices * pipe.virtual_stages
    assert model.head.weight is model.wte.weight  # the tied weight stays one, with one gradient
    assert_same_gradients(model, reference)


def test_split_points_begin_stages_at_the_modules_named():
    x, y = torch.randint(40, (6, 16)), torch.randint(40, (6, 16))
    model, reference, pipe, _ = one_step(gpt, x, y, lm_loss, chunks=3, schedule="1f1b",
                                         split_points=["blocks.1", "blocks.3.mlp"])
    starts = [sum(pipe.balance[:s]) for s in range(3)]
    assert [pipe.pieces[k] for k in starts] == [pipe.pieces[0], "blocks.1.ln_1", "blocks.3.mlp.0"]
    assert_same_gradients(model, reference)
    with pytest.raises(ValueError, match="no piece starts at 'blocks.0' after 'blocks.1.ln_1'"):
        gpipe.GPipe(gpt(), chunks=2, schedule="gpipe", split_points=["blocks.1", "blocks.0"]).train_step(x, y, lm_loss)


class Residual(torch.nn.Sequential):
    """A Sequential whose own forward is not the chain of its children."""

    def forward(self, x):
        return x + super().forward(x)


def test_a_sequential_that_overrides_its_forward_is_traced():
    def residual():
        return Residual(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))

    x, y = torch.randn(8, 6), torch.randint(6, (8,))
    model, reference, pipe, (loss, expected) = one_step(residual, x, y, "cross_entropy", chunks=2, schedule="gpipe")
    assert pipe.pieces == ["0", "1", "2"]
    assert loss == pytest.approx(expected, rel=RTOL)
    assert_same_gradients(model, reference)


def test_the_users_model_runs_and_saves_unchanged():
    model = gpt()
    x = torch.randint(40, (4, 16))
    before = model(x)
    pipe = gpipe.GPipe(model, chunks=2, schedule="gpipe")
    assert torch.allclose(pipe(x), before, rtol=RTOL, atol=1e-6)
    assert torch.equal(model(x), before) and isinstance(model, GPT)
    assert set(model.state_dict()) == set(gpt().state_dict())


class Optional(torch.nn.Module):
    """A forward with an optional argument, left at its default, and a long body before unpacking a
    size (fx's own reading of the instruction fails there on Python 3.11)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x, mask=None, scale: float = 2.0):
        y = self.a(x)
        y = y * scale
        y = y + 1
        y = y - 1
        y = torch.tanh(y)
        y = y * 1.5
        y = y / 1.5
        y = y + 0.0
        y = torch.relu(y) + y
        y = y.clone()
        rows, width = y.size()
        y = self.b(y.reshape(rows, width))
        return y if mask is None else y * mask


def test_optional_arguments_keep_their_defaults_and_sizes_unpack_anywhere():
    x, y = torch.randn(8, 6), torch.randint(6, (8,))
    model, reference, pipe, (loss, expected) = one_step(Optional, x, y, "cross_entropy", chunks=2, schedule="gpipe")
    assert pipe.pieces == ["a", "b"]
    assert loss == pytest.approx(expected, rel=RTOL)
    assert_same_gradients(model, reference)


class Routed(torch.nn.Module):
    """A block whose forward branches on its input's values, which fx cannot trace: kept whole."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


class WithARoutedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(8, 16)
        self.routed = Routed()
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x):
        return self.head(torch.relu(self.routed(torch.relu(self.stem(x)))))


class Encoder(torch.nn.Module):
    """torch.nn.TransformerEncoder, whose forward fx cannot trace, between an embedding and a head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(30, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2)
        self.head = torch.nn.Linear(32, 30)

    def forward(self, idx):
        return self.head(self.encoder(self.embed(idx)).mean(1))


@pytest.mark.parametrize("make,x,y,whole", [
    (WithARoutedBlock, torch.randn(8, 8), torch.randint(5, (8,)), "routed"),
    (Encoder, torch.randint(30, (8, 10)), torch.randint(30, (8,)), "encoder")])
def test_a_submodule_fx_cannot_trace_is_kept_whole(make, x, y, whole):
    model, reference, pipe, (loss, expected) = one_step(make, x, y, "cross_entropy", chunks=4, devices=2,
                                                        schedule="1f1b")
    assert whole in pipe.pieces
    assert loss == pytest.approx(expected, rel=RTOL)
    assert_same_gradients(model, reference)


def deferred_reference_step(reference, x, y, chunks):
    """One device's step by the paper's rule: micro-batches one by one, each normalized by its own
    statistics, the running statistics frozen and then updated once from every row."""
    norms = [m for m in reference.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats]
    inputs = {id(n): [] for n in norms}
    hooks = [n.register_forward_pre_hook(lambda m, a: inputs[id(m)].append(a[0].detach())) for n in norms]
    frozen = [(n.running_mean.clone(), n.running_var.clone(), n.num_batches_tracked.clone()) for n in norms]
    for xm, ym in zip(x.chunk(chunks), y.chunk(chunks)):
        (torch.nn.functional.cross_entropy(reference(xm), ym) * len(xm) / len(x)).backward()
    for h in hooks:
        h.remove()
    for n, (mean, var, count) in zip(norms, frozen):
        rows = torch.cat(inputs[id(n)]).transpose(0, 1).flatten(1)  # channels first
        factor = n.momentum if n.momentum is not None else 1.0 / float(count + 1)
        n.running_mean.copy_((1 - factor) * mean + factor * rows.mean(1))
        n.running_var.copy_((1 - factor) * var + factor * rows.var(1, unbiased=True))
        n.num_batches_tracked.copy_(count + 1)


def resnet18():
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(num_classes=10)


def mobilenet_v2():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.mobilenet_v2(num_classes=10)
    model.classifier[0].p = 0.0  # a pipeline draws Dropout's masks per micro-batch
    return model


class Nested(torch.nn.Module):
    """BatchNorms inside blocks: a SyncBatchNorm (deferred as a BatchNorm: on CPU, in one process,
    it is one), one without running statistics (each micro-batch by its own, nothing to defer) and
    one whose running statistics are a cumulative average (momentum None)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.SyncBatchNorm(8), torch.nn.ReLU())
        self.b = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3), torch.nn.BatchNorm2d(8, track_running_stats=False),
                                     torch.nn.BatchNorm2d(8, momentum=None))  # a cumulative average
        self.head = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.b(self.a(x)).mean((2, 3)))


@pytest.mark.parametrize("make,schedule,devices,chunks", [(resnet18, "1f1b", 2, 4), (resnet18, "zbv", 3, 4),
                                                          (mobilenet_v2, "interleaved", 2, 2), (Nested, "gpipe", 2, 4)])
def test_batch_norms_inside_blocks_update_once_per_mini_batch_from_every_row(make, schedule, devices, chunks):
    """(MobileNet ends in 1×1 pixels, where 2 rows per BatchNorm overflow its statistics: 4 rows.)"""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(10, (8,), generator=g)
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    for block in reference.modules():  # PyTorch runs SyncBatchNorm on GPUs only: its one-process twin
        for name, norm in block.named_children():
            if isinstance(norm, torch.nn.SyncBatchNorm):
                twin = torch.nn.BatchNorm2d(norm.num_features)
                twin.load_state_dict(norm.state_dict())
                setattr(block, name, twin)
    pipe = gpipe.GPipe(model, chunks=chunks, devices=devices, schedule=schedule)  # batch_norm="deferred": the default
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # two steps, small: MobileNet's statistics grow fast
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        pipe.train_step(x, y)
        opt.step()
        ref_opt.zero_grad()
        deferred_reference_step(reference, x, y, chunks)
        ref_opt.step()
    ours, theirs = model.state_dict(), reference.state_dict()
    for name, b in theirs.items():
        scale = b.float().abs().max().item()
        if name.endswith("running_mean"):  # a mean near 0 is rounding of the rows' spread
            scale = max(scale, theirs[name.replace("running_mean", "running_var")].max().sqrt().item())
        assert (ours[name].float() - b.float()).abs().max().item() <= 1e-5 * scale + 1e-7, name


def test_torchvisions_squeezenet_as_shipped_trains_as_one_device():
    torchvision = pytest.importorskip("torchvision")

    def squeezenet():
        model = torchvision.models.squeezenet1_1(num_classes=10)  # ReLU(inplace=True), Fire blocks, flatten
        model.classifier[0].p = 0.0
        return model

    x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
    model, reference, pipe, (loss, expected) = one_step(squeezenet, x, y, "cross_entropy", chunks=4, devices=2,
                                                        schedule="zb1p")
    assert loss == pytest.approx(expected, rel=RTOL)
    assert_same_gradients(model, reference, rtol=1e-4)


def blocks(script):
    """A Sequential whose second layer is a block holding a BatchNorm: compiled by TorchScript already
    (its code's call of the BatchNorm is rewritten into gpipe's op), or not (compiled by GPipe)."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.jit.script(block) if script else block,
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))


def test_a_batch_norm_inside_a_torchscript_layer_updates_once_per_mini_batch():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(10, (8,), generator=g)
    model, reference = blocks(script=True), blocks(script=False)
    pipe = gpipe.GPipe(model, chunks=4, balance=[2, 3], schedule="1f1b")
    pipe.train_step(x, y)
    deferred_reference_step(reference, x, y, 4)
    assert model.state_dict()["1.1.num_batches_tracked"] == 1
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=RTOL, atol=1e-6), name
    model[1].eval()  # the scripted block's own mode, changed after the build, is followed
    with torch.no_grad():
        assert torch.allclose(pipe(x), model(x), rtol=RTOL, atol=1e-6)


def test_a_model_in_eval_mode_trains_as_one_device_whatever_its_batch_norms():
    torchvision = pytest.importorskip("torchvision")

    def mobilenet():
        return torchvision.models.mobilenet_v2(num_classes=10).eval()

    x, y = torch.randn(8, 3, 32, 32), torch.randint(10, (8,))
    model, reference, pipe, (loss, expected) = one_step(mobilenet, x, y, "cross_entropy", chunks=4, devices=2,
                                                        schedule="zb1p")
    assert loss == pytest.approx(expected, rel=RTOL)
    assert_same_gradients(model, reference, rtol=1e-4)


class DropsInTraining(torch.nn.Module):
    """A block whose forward reads self.training (a trace would freeze it): kept whole."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x):
        return torch.nn.functional.dropout(self.linear(x), 0.5, self.training)


class WithAModeBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.block, self.head = torch.nn.Linear(6, 6), DropsInTraining(), torch.nn.Linear(6, 3)

    def forward(self, x):
        x.mul_(2.0)  # in place: where the pipeline keeps its input, on a copy
        return self.head(self.block(torch.tanh(self.stem(x))))


def test_a_block_that_reads_its_mode_is_kept_whole_and_follows_train_and_eval():
    model = WithAModeBlock()
    model.eval()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6)
    pipe = gpipe.GPipe(model, chunks=2, schedule="gpipe")
    before = x.clone()
    y = torch.randint(3, (8,))
    loss = pipe.train_step(x, y)  # the first batch, whose kinds of values are found on a copy
    assert torch.equal(x, before)  # gpipe never changes the caller's batch (the first stage runs on a copy)
    assert "block" in pipe.pieces
    expected = torch.nn.functional.cross_entropy(reference(before.clone()), y)
    assert loss == pytest.approx(expected.item(), rel=RTOL)
    model.train()
    with torch.no_grad():
        dropped = pipe(torch.ones(64, 6))
    assert (dropped == model.head.bias).all(1).any()  # some rows dropped whole: the mode followed
    model.eval()
    z = torch.randn(4, 6)
    assert torch.allclose(pipe(z.clone()), reference(z.clone()).detach(), rtol=RTOL, atol=1e-6)


class Branches(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # the model's own forward: nothing to keep whole
            return x
        return -x


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, mask):
        return self.linear(x) * mask


class ReturnsADict(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return {"logits": self.linear(x)}


class ReadsItsMode(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) * (0.5 if self.training else 1.0)


class Identity(torch.nn.Module):
    def forward(self, x):
        return x


class KeywordOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x, *, scale: float = 1.0):
        return self.linear(x) * scale


class Stashes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stash, self.linear, self.pop = gpipe.Stash("s"), torch.nn.Linear(4, 4), gpipe.Pop("s")

    def forward(self, x):
        return self.pop(self.linear(self.stash(x)))


def test_what_tracing_cannot_take_is_refused_with_the_way_out():
    with pytest.raises(ValueError, match=r"cannot be traced by torch.fx.*test_traced.py:\d+: if x.sum\(\) > 0.*"
                                         r"keep_whole.*torch.nn.Sequential"):
        gpipe.GPipe(Branches())
    with pytest.raises(ValueError, match=r"forward takes \(x, mask\); gpipe gives it one tensor"):
        gpipe.GPipe(TwoInputs())
    with pytest.raises(ValueError, match="returns a dict, where gpipe needs one tensor"):
        gpipe.GPipe(ReturnsADict())
    with pytest.raises(ValueError, match=r"balance counts the layers of a torch.nn.Sequential.*split_points="):
        gpipe.GPipe(gpt(), balance=[2, 2])
    with pytest.raises(ValueError, match="keep_whole names 'blocks.9', which is not a submodule's path"):
        gpipe.GPipe(gpt(), keep_whole=["blocks.9"])
    with pytest.raises(ValueError, match="split_points must be a list of module paths"):
        gpipe.GPipe(gpt(), split_points="blocks.1")
    with pytest.raises(ValueError, match="forward reads self.training, which a trace would freeze"):
        gpipe.GPipe(ReadsItsMode())
    with pytest.raises(ValueError, match="computes nothing from its input"):
        gpipe.GPipe(Identity())
    with pytest.raises(ValueError, match=r"forward takes \(x, \*, scale: float = 1.0\).*no \*args, keyword-only"):
        gpipe.GPipe(KeywordOnly())
    with pytest.raises(ValueError, match="'stash' is a gpipe.Stash.*without Stash and Pop"):
        gpipe.GPipe(Stashes())
    with pytest.raises(ValueError, match="split_points names 'blocks.1' twice"):
        gpipe.GPipe(gpt(), split_points=["blocks.1", "blocks.1"])
    with pytest.raises(ValueError, match=r"split_points=\['blocks.1', 'blocks.2', 'blocks.3'\]: 4 stages"):
        gpipe.GPipe(gpt(), split_points=["blocks.1", "blocks.2", "blocks.3"], devices=2, schedule="gpipe")
    with pytest.raises(ValueError, match="keep_whole names 'blocks', which the forward never calls as a whole"):
        gpipe.GPipe(gpt(), keep_whole=["blocks"])
    with pytest.raises(ValueError, match="split_points and keep_whole are for a model that gpipe traces"):
        gpipe.GPipe(torch.nn.Sequential(torch.nn.Linear(2, 2)), split_points=["0"])


@pytest.mark.skipif(not os.environ.get("GPIPE_CLI"), reason="GPIPE_CLI names the gpipe program (ctest sets it)")
def test_an_exported_model_trains_in_gpipe_train_as_one_device(tmp_path):
    """gpipe.export writes the traced pieces; `gpipe train --model` trains them one SGD step, and the
    parameters it saves, named by piece and then by path, are the model's after that step on one device."""
    model = gpt()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(40, (8, 16), generator=g), torch.randint(40, (8, 16), generator=g)
    gpipe.export(model, x, tmp_path / "gpt.pt")
    torch.save({"input": x, "target": y}, str(tmp_path / "data.pt"))
    done = subprocess.run([os.environ["GPIPE_CLI"], "train", "--model", str(tmp_path / "gpt.pt"), "--data",
                           str(tmp_path / "data.pt"), "--optimizer", "sgd", "--lr", "0.5", "--batch-size", "8",
                           "--steps", "1", "--stages", "2", "--micro-batches", "4", "--save",
                           str(tmp_path / "trained.pt")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lm_loss(reference(x), y).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    trained = {k.partition(".")[2]: v for k, v in torch.jit.load(str(tmp_path / "trained.pt")).state_dict().items()}
    model.load_state_dict(trained)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=RTOL, atol=1e-6), name


class Blocks(torch.nn.Module):
    """Convolutions with BatchNorms inside blocks, as gpipe train's data gives them: 1x28x28 images."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.block = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8))
        self.head = torch.nn.Linear(8, 10)

    def forward(self, x):
        x = self.stem(x)
        return self.head(torch.relu(x + self.block(x)).mean((2, 3)))


@pytest.mark.skipif(not os.environ.get("GPIPE_CLI"), reason="GPIPE_CLI names the gpipe program (ctest sets it)")
@pytest.mark.parametrize("saved_by", ["gpipe.export", "torch.jit.script"])
def test_a_model_with_batch_norms_inside_blocks_trains_in_gpipe_train_by_the_papers_rule(tmp_path, saved_by):
    """gpipe train defers the BatchNorms inside the layers of the file, gpipe.export's pieces (their
    DeferredBatchNorm) or TorchScript's (their calls of torch.nn's BatchNorm rewritten): 4
    micro-batches, each normalized by its own statistics, the running statistics once from every row."""
    torch.manual_seed(0)
    model = Blocks() if saved_by == "gpipe.export" else torch.nn.Sequential(Blocks())
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(16, 1, 28, 28, generator=g), torch.randint(10, (16,), generator=g)
    if saved_by == "gpipe.export":
        gpipe.export(model, x, tmp_path / "blocks.pt")
    else:  # one layer, a block whose code calls its BatchNorms
        torch.jit.script(model).save(str(tmp_path / "blocks.pt"))
    torch.save({"input": x, "target": y}, str(tmp_path / "data.pt"))
    done = subprocess.run([os.environ["GPIPE_CLI"], "train", "--model", str(tmp_path / "blocks.pt"), "--data",
                           str(tmp_path / "data.pt"), "--optimizer", "sgd", "--lr", "0.1", "--batch-size", "16",
                           "--no-shuffle", "--steps", "1", "--stages", "2" if saved_by == "gpipe.export" else "1",
                           "--micro-batches", "4", "--save",
                           str(tmp_path / "trained.pt")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    deferred_reference_step(reference, x, y, 4)
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    trained = torch.jit.load(str(tmp_path / "trained.pt")).state_dict()
    model.load_state_dict({k.partition(".")[2]: v for k, v in trained.items()} if saved_by == "gpipe.export" else trained)
    assert model.state_dict()[("" if saved_by == "gpipe.export" else "0.") + "stem.1.num_batches_tracked"] == 1
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=RTOL, atol=1e-6), name
