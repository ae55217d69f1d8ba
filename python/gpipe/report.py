"""Summary: what `gpipe train` prints at the end of a run, for a training loop of your own."""
import contextlib
import time

from . import _gpipe


class Summary:
    """Times the steps of a training loop and prints `gpipe train`'s summary:

        summary = gpipe.Summary(pipe)
        for x, y in loader:
            with summary.step(len(x)):
                opt.zero_grad()
                pipe.train_step(x, y)
                opt.step()
        summary.print(accuracy=0.9196)
    """

    def __init__(self, pipe):
        self.pipe = pipe
        self.samples = 0
        self.seconds = 0.0
        self.steps = 0
        self.bubble_sum = 0.0

    @contextlib.contextmanager
    def step(self, samples):
        """Times one training step (forward, backward, optimizer) of `samples` samples; not the
        pipeline's build on the first batch (schedule="auto" profiles the layers), as `gpipe train`
        does not count it either."""
        begin, built = time.perf_counter(), self.pipe.build_seconds
        yield
        self.seconds += time.perf_counter() - begin - (self.pipe.build_seconds - built)
        self.samples += samples
        self.steps += 1
        self.bubble_sum += self.pipe.bubble

    @property
    def samples_per_s(self):
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def text(self, accuracy=None, loss=None, evaluated_on="test"):
        lines = ["", "summary"]
        if accuracy is not None:
            lines.append(f"  {evaluated_on} accuracy  {100 * accuracy:.2f}%")
        if loss is not None:
            lines.append(f"  {evaluated_on} loss  {loss:.6f}")
        figures = _gpipe.RunFigures()  # the lines gpipe train prints, from the same code
        figures.train_seconds, figures.steps, figures.samples_per_s = self.seconds, self.steps, self.samples_per_s
        figures.bubble = self.bubble_sum / self.steps if self.steps else 0.0
        figures.balance, figures.placement = self.pipe.balance or [], self.pipe.placement or []
        figures.devices = self.pipe.devices
        scaler = self.pipe.loss_scaler
        if scaler is not None:  # where the scale ended, and the steps it skipped since it was made
            figures.loss_scale, figures.skipped_steps = scaler.scale, scaler.skipped
        return "\n".join(lines) + "\n" + _gpipe.format_run_figures(figures).rstrip("\n")

    def print(self, accuracy=None, loss=None, evaluated_on="test"):
        """Prints the summary on rank 0 (the only process outside MPI)."""
        if self.pipe.rank == 0:
            print(self.text(accuracy, loss, evaluated_on), flush=True)
