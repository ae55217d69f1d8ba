"""The planner, the per-layer profile, the predicted step and the built-in tasks from Python: the
answers of `gpipe plan`, as Python objects, for a model and a sample; profiling leaves the model as
it was; errors are ValueErrors that name the argument."""
import json
import os
import subprocess

import pytest
import torch

import gpipe

CLI = os.environ.get("GPIPE_CLI")
needs_cli = pytest.mark.skipif(not CLI, reason="GPIPE_CLI names the gpipe program (ctest sets it)")
FASHION = "/usr/share/datasets/fashion-mnist"
FORTUNES = "/usr/share/games/fortunes"


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def batch_norm_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                               torch.nn.ReLU(), torch.nn.Linear(8, 3))


def cli_plan(*args):
    done = subprocess.run([CLI, "plan", *args, "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def shape_of(row):
    """A configuration without its measured figures: what the search considered."""
    if isinstance(row, dict):
        return (row["stages"], row["replicas"], row["micro_batches"], row["schedule"], row["virtual_stages"],
                row["checkpoint"])
    return (row.devices, row.replicas, row.micro_batches, row.schedule, row.virtual_stages, row.checkpoint)


def test_plan_answers_configurations_as_python_objects_fastest_first():
    found = gpipe.plan(mlp(), torch.randn(8, 6), devices=4, batch=64, memory_per_device="1GiB")
    assert 0 < len(found) <= 10
    assert all(c.fits for c in found)
    assert [c.samples_per_s for c in found] == sorted((c.samples_per_s for c in found), reverse=True)
    best = found[0]
    assert best.devices * best.replicas == 4 and sum(best.balance) == 5
    assert len(best.balance) == best.devices * best.virtual_stages
    assert len(best.peak_bytes) == len(best.static_bytes) == len(best.total_bytes) == best.devices
    assert best.largest_total_bytes == max(best.total_bytes)
    assert best.step_s > 0 and 0 <= best.bubble < 1 and best.schedule in gpipe.schedule_names()
    assert found.description.startswith("model: 5 layers, ") and found.parameters == sum(
        p.numel() for p in mlp().parameters())
    every = gpipe.plan(mlp(), torch.randn(8, 6), devices=4, batch=64, top=None, schedules=["gpipe"],
                       checkpoints=["never"], micro_batches=[2, 4])
    assert {shape_of(c) for c in every} == {(k, 4 // k, m, "gpipe", 1, "never") for k in (1, 2, 4) for m in (2, 4)}


@needs_cli
def test_plan_of_a_sequential_agrees_with_gpipe_plan_on_its_torchscript_file(tmp_path):
    model = mlp()
    torch.jit.script(model).save(str(tmp_path / "mlp.pt"))
    args = ["--devices", "4", "--batch", "64", "--memory-per-device", "1GiB", "--all"]
    cli = cli_plan("--model", str(tmp_path / "mlp.pt"), "--input-shape", "6", *args)
    found = gpipe.plan(model, torch.randn(8, 6), devices=4, batch=64, memory_per_device="1GiB", top=None)
    # The same configurations fit; their times are measured, so the order may differ by noise.
    assert {shape_of(r) for r in cli} == {shape_of(c) for c in found}
    # Constrained to one configuration, the two answers agree on it.
    one = ["--stages", "2", "--micro-batches", "4", "--schedule", "1f1b", "--checkpoint", "never"]
    cli = cli_plan("--model", str(tmp_path / "mlp.pt"), "--input-shape", "6", *args, *one)
    found = gpipe.plan(model, torch.randn(8, 6), devices=4, batch=64, memory_per_device="1GiB", stages=[2],
                       micro_batches=[4], schedules=["1f1b"], checkpoints=["never"])
    assert len(cli) == len(found) == 1 and shape_of(cli[0]) == shape_of(found[0])
    assert cli[0]["predicted_static_bytes"] == found[0].static_bytes or cli[0]["balance"] != found[0].balance


@needs_cli
def test_plan_of_a_transformer_by_shape_is_gpipe_plans_to_the_byte():
    shape = dict(layers=8, width=256, heads=4, ffn=1024, vocab=1000, sequence=64)
    cli = cli_plan("--layers", "8", "--width", "256", "--heads", "4", "--ffn", "1024", "--vocab", "1000", "--seq", "64",
                   "--devices", "8", "--batch", "64", "--memory-per-device", "4GiB", "--top", "5")
    found = gpipe.plan(transformer=shape, devices=8, batch=64, memory_per_device="4GiB", top=5)
    assert [shape_of(r) for r in cli] == [shape_of(c) for c in found]
    for r, c in zip(cli, found):
        assert r["balance"] == c.balance and r["predicted_total_bytes"] == c.total_bytes
        assert r["predicted_samples_per_s"] == pytest.approx(c.samples_per_s, rel=1e-12)
    assert found.description.startswith("Transformer: 8 layers, width 256")


@needs_cli
def test_plan_of_a_task_agrees_with_gpipe_plan_of_the_workload():
    cli = cli_plan("--workload", "tiny", "--devices", "2", "--batch", "16", "--all")
    found = gpipe.plan(task="tiny", devices=2, batch=16, top=None)
    assert {shape_of(r) for r in cli} == {shape_of(c) for c in found}
    assert found.description.startswith("workload tiny: ")


def test_plan_leaves_out_one_row_micro_batches_of_a_model_with_batch_norm():
    found = gpipe.plan(batch_norm_model(), torch.randn(8, 6), devices=2, batch=8, top=None)
    assert found.least_micro_batch_rows == 2 and found
    assert all((8 // c.replicas) // c.micro_batches >= 2 for c in found)


def state_of(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_profile_has_one_entry_per_layer_and_leaves_the_model_as_it_was():
    model = batch_norm_model()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    model[1].running_mean.fill_(0.25)
    before, grads = state_of(model), [p.grad.clone() for p in model.parameters()]
    model.eval()
    x = torch.randn(8, 6)
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    profile = gpipe.profile(model, x)
    assert len(profile) == len(model) and profile.rows == 8 and profile.least_micro_batch_rows == 2
    assert all(layer.forward_s > 0 for layer in profile)
    assert profile[0].parameter_bytes == (6 * 8 + 8) * 4 and profile[3].parameter_bytes == 0
    assert profile[0].output_bytes == 8 * 4  # per sample
    assert gpipe.plan(model, x, devices=2, batch=8)
    assert gpipe.predict(model, x[:4], chunks=2, devices=2).step_s > 0
    after = state_of(model)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k  # running statistics and num_batches_tracked too
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert not model.training and not any(m.training for m in model.modules())
    assert torch.equal(rng, torch.get_rng_state())


def test_a_weight_two_layers_use_is_profiled_as_tied_and_held_once_per_device():
    shared = torch.nn.Linear(6, 6)
    model = torch.nn.Sequential(shared, torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(), shared)
    profile = gpipe.profile(model, torch.randn(8, 6))
    assert profile.tied == [(6 * 6 * 4, [0, 4]), (6 * 4, [0, 4])]  # the weight and the bias
    # On one device the tensors are held once: parameters and their gradients (plain SGD).
    one = gpipe.predict(model, torch.randn(8, 6), chunks=2, devices=1, optimizer="sgd")
    assert one.static_bytes == [2 * 4 * (6 * 6 + 6) * 2]


def test_profile_with_a_loss_profiles_its_bytes():
    x, y = torch.randn(8, 6), torch.randint(4, (8,))
    profile = gpipe.profile(mlp(), x, loss="cross_entropy", target=y, optimizer="adam")
    assert profile.loss_kept_bytes > 0 and profile.state_per_parameter_byte == 3


def test_predict_gives_the_step_bubble_and_peak_memory_per_device():
    model = mlp()
    p = gpipe.predict(model, torch.randn(4, 6), chunks=4, devices=2, schedule="1f1b", checkpoint="never")
    assert p.devices == 2 and p.virtual_stages == 1 and sum(p.balance) == 5 and p.placement == [0, 1]
    assert p.micro_batch_rows == [4, 4, 4, 4]
    assert p.step_s > 0 and 0 < p.bubble < 1
    assert len(p.peak_bytes) == len(p.static_bytes) == 2 and all(b > 0 for b in p.static_bytes)
    assert p.total_bytes == [a + b for a, b in zip(p.peak_bytes, p.static_bytes)]
    given = gpipe.predict(model, torch.randn(4, 6), chunks=4, balance=[1, 4], batch=10)
    assert given.balance == [1, 4] and given.devices == 2 and given.micro_batch_rows == [3, 3, 2, 2]
    many = gpipe.predict(model, torch.randn(4, 6), chunks=8, devices=2, checkpoint="never")
    few = gpipe.predict(model, torch.randn(4, 6), chunks=1, devices=2, checkpoint="never", batch=32)
    assert many.bubble < few.bubble  # (K-1)/(M+K-1)
    assert gpipe.predict(model, torch.randn(4, 6), chunks=4, devices=2, schedule="interleaved").virtual_stages == 2


def test_the_built_in_tasks():
    assert gpipe.tasks.names() == ["cnn", "resnet", "unet", "gpt"]
    assert "tiny" in gpipe.tasks.names(workloads=True)
    info = gpipe.tasks.info("gpt")
    assert info["metric"] == "bits_per_byte" and info["loss"] == "cross_entropy" and info["context"] == 128
    model = gpipe.tasks.model("cnn", seed=3)
    assert len(model.layers) == gpipe.tasks.info("cnn")["layers"] and model.loss == "cross_entropy"
    assert model.parameters == sum(v.numel() for k, v in model.state.items() if "running" not in k
                                   and "num_batches" not in k)
    again = gpipe.tasks.model("cnn", seed=3)
    assert all(torch.equal(v, again.state[k]) for k, v in model.state.items())
    assert not torch.equal(gpipe.tasks.model("cnn", seed=4).state["0.weight"], model.state["0.weight"])


@pytest.mark.skipif(not os.path.exists(FASHION + "/train-images-idx3-ubyte.gz"), reason="Fashion-MNIST not installed")
def test_task_data_of_the_cnn_is_fashion_mnist():
    d = gpipe.tasks.data("cnn", train_samples=100, test_samples=30)
    x, y = d.train
    assert x.shape == (100, 1, 28, 28) and y.shape == (100,) and y.dtype == torch.long
    assert d.test[0].shape == (30, 1, 28, 28) and d.test_name == "test"


@pytest.mark.skipif(not os.path.isdir(FORTUNES), reason="fortunes not installed")
def test_task_data_of_the_gpt_is_fortunes_with_its_references():
    d = gpipe.tasks.data("gpt", train_samples=20, test_samples=4)
    x, y = d.train
    assert x.shape == (20, 128) and y.shape == (20, 128) and torch.equal(x[0, 1:], y[0, :-1])
    assert d.test[0].shape == (4, 128)
    assert 0 < d.bigram_bits_per_byte < 8 and 0 < d.gzip_bits_per_byte < 8 and d.train_bytes > d.test_bytes > 0


def refused(match, call, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        call(*args, **kwargs)


def test_errors_are_value_errors_in_python_words():
    m, x = mlp(), torch.randn(8, 6)
    refused("no model given", gpipe.plan, devices=2, batch=8)
    refused("more than one model given", gpipe.plan, m, x, task="tiny", devices=2, batch=8)
    refused("needs a sample", gpipe.plan, m, devices=2, batch=8)
    refused(r"batch is out of range \(got 9223372036854775808\)", gpipe.plan, task="tiny", devices=2, batch=2**63)
    refused('"0GiB" is less than one byte', gpipe.plan, task="tiny", devices=2, batch=8, memory_per_device="0GiB")
    refused("devices must be at least 1", gpipe.plan, m, x, devices=0, batch=8)
    refused("batch must be a whole number", gpipe.plan, m, x, devices=2, batch=0)
    refused("memory_per_device: .*16gigs", gpipe.plan, m, x, devices=2, batch=8, memory_per_device="16gigs")
    refused("optimizer must be one of", gpipe.plan, m, x, devices=2, batch=8, optimizer="adagrad")
    refused("every entry of schedules must be one of", gpipe.plan, m, x, devices=2, batch=8, schedules=["fastest"])
    refused("task must be one of", gpipe.plan, task="nope", devices=2, batch=8)
    refused("speed must be a finite number above 0", gpipe.plan, m, x, devices=2, batch=8, speed=0)
    refused("K = 3 devices per pipeline does not divide", gpipe.plan, m, x, devices=2, batch=8, stages=[3])
    refused("micro_batches lists 2 twice; give each value once", gpipe.plan, m, x, devices=2, batch=8,
            micro_batches=[2, 2])
    refused("schedules lists gpipe twice", gpipe.plan, m, x, devices=2, batch=8, schedules=["gpipe", "gpipe"])
    refused("no configuration fits: .*; try .*or devices with more memory", gpipe.plan, m, x, devices=2, batch=8,
            memory_per_device=1000)
    refused("model must be a torch.nn.Sequential", gpipe.profile, torch.nn.Linear(3, 3), x)
    refused("sample must be a torch.Tensor", gpipe.profile, m, [1, 2])
    refused("sample has no rows", gpipe.profile, m, torch.randn(0, 6))
    refused("needs the sample's target", gpipe.profile, m, x, loss="mse")
    refused("chunks", gpipe.predict, m, x, chunks=0)
    refused("cannot cut 5 layers into 6 devices", gpipe.predict, m, x, devices=6)
    refused("schedule must be one of", gpipe.predict, m, x, schedule="fastest")
    refused("name must be one of", gpipe.tasks.data, "mnist")
    refused("train_samples must be a whole number", gpipe.tasks.data, "cnn", train_samples=-1)
    refused("seed must be a whole number", gpipe.tasks.model, "cnn", seed=-1)
    with pytest.raises(RuntimeError, match="/nonexistent"):
        gpipe.tasks.data("cnn", data_dir="/nonexistent")
