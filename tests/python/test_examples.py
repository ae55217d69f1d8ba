"""The Python examples run as the README shows them, on a little data: each trains, evaluates and
prints gpipe train's summary."""
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python")
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


def run_example(name, *flags):
    result = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *flags], capture_output=True, text=True,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "\nsummary\n" in result.stdout, output
    assert "samples/s" in result.stdout, output
    return result.stdout


@pytest.mark.parametrize("name", ["fashion_mnist.py", "resnet.py", "torchvision_resnet.py"])
def test_a_fashion_mnist_example_trains_and_prints_the_summary(name):
    if not os.path.isdir(FASHION_MNIST):
        pytest.skip("Fashion-MNIST is not installed (dataset-fashion-mnist)")
    out = run_example(name, "--epochs", "1", "--train-samples", "512", "--test-samples", "500", "--batch-size", "64")
    assert "epoch 1: loss" in out and "test accuracy" in out, out


def test_the_transformer_example_trains_and_prints_a_sample(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    out = run_example("transformer.py", "--text", str(text), "--epochs", "1", "--length", "32", "--batch-size", "16")
    assert "held-out loss" in out and "sample: " in out, out


def test_the_gpt2_example_trains_unchanged_and_prints_a_sample(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    out = run_example("gpt2.py", "--text", str(text), "--epochs", "1", "--length", "32", "--batch-size", "16")
    assert "GPT traced in" in out and "held-out loss" in out and "sample: " in out, out
