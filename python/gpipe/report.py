"""Summary: what `gpipe train` prints at the end of a run, for a training loop of your own."""
import contextlib
import time


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
        """Times one training step (forward, backward, optimizer) of `samples` samples."""
        begin = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - begin
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
        bubble = self.bubble_sum / self.steps if self.steps else 0.0
        balance = self.pipe.balance or []
        placement = self.pipe.placement or []
        stages = " | ".join(
            f"stage {j}" + (f" (device {placement[j]})" if len(balance) > self.pipe.devices else "")
            + f": {n} layer{'s' if n != 1 else ''}" for j, n in enumerate(balance))
        lines += [f"  training time  {self.seconds:.1f} s ({self.steps} steps)",
                  f"  throughput     {self.samples_per_s:.0f} samples/s",
                  f"  bubble         {100 * bubble:.1f}% of device time idle (measured)",
                  f"  partition      {stages}"]
        return "\n".join(lines)

    def print(self, accuracy=None, loss=None, evaluated_on="test"):
        """Prints the summary on rank 0 (the only process outside MPI)."""
        if self.pipe.rank == 0:
            print(self.text(accuracy, loss, evaluated_on), flush=True)
