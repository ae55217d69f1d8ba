// gpt.cc: a byte-level GPT (models.h) on the quotations, jokes and poems of Debian's fortunes,
// scored in bits per byte beside a bigram model's and gzip -9's on the same test bytes.
#include "tasks/builtin.h"

#include "gpipe/check.h"
#include "gpipe/models.h"

#include <torch/torch.h>

namespace gpipe::tasks {

namespace {

// The model's shape, chosen by measurement on 2 cores (docs/models.md).
GptOptions gpt_shape() {
  GptOptions s;
  s.context = 128;
  s.width = 64;
  s.heads = 4;
  s.blocks = 4;
  s.feed_forward = 256;
  return s;
}

TaskData fortunes(const TaskOptions& o) {
  const std::string dir = o.data_dir().empty() ? kFortunesDir : o.data_dir();
  const TextCorpus text = load_fortunes(dir);
  const int64_t T = gpt_shape().context;
  for (const auto& [part, bytes] : {std::pair<const char*, size_t>{"train on", text.train.size()}, {"test on", text.test.size()}})
    GPIPE_CHECK(static_cast<int64_t>(bytes) > T, "the fortune files of ", dir, " hold too little text: ",
                text.train.size(), " bytes to train on and ", text.test.size(), " to test on (the fortunes in the "
                "last tenth of each file), but the gpt task needs more than ", T, " bytes to ", part, ": a window of ",
                T, " bytes and the byte after it; give a folder with more fortunes");
  TaskData d;
  d.train = byte_windows(text.train, T).first(o.train_samples());
  d.test = byte_windows(text.test, T).first(o.test_samples());
  d.train_bytes = static_cast<int64_t>(text.train.size());
  d.test_bytes = static_cast<int64_t>(text.test.size());
  d.source = "fortunes (" + dir + ", " + std::to_string(d.train_bytes) + " training bytes, " +
             std::to_string(d.test_bytes) + " test bytes)";
  // The references see the test bytes the model is scored on (all of them, or the first windows').
  const std::string test = text.test.substr(0, static_cast<size_t>(d.test.size() * T + 1));
  d.bigram_bits_per_byte = bigram_bits_per_byte(text.train, test);
  d.gzip_bits_per_byte = gzip_bits_per_byte(test);
  return d;
}

}  // namespace

Task gpt() {
  Task t;
  t.name = "gpt";
  t.title = "GPT";
  t.summary = "a byte-level Transformer language model on Debian's fortunes (its head tied to its embedding); "
              "bits per byte";
  const GptOptions s = gpt_shape();
  t.layers = s.layers();
  t.scoring = bits_per_byte_scoring();
  t.loss = cross_entropy_loss;
  t.loss_name = "cross_entropy";
  t.data_dir = kFortunesDir;
  t.context = s.context;
  t.defaults.epochs = 4;
  t.defaults.batch_size = 16;
  t.defaults.lr = 2e-3;
  t.defaults.lr_schedule = LrSchedule::kCosine;
  t.model = [s](const TaskOptions& o) {
    Model model = seeded_model("GPT", s.layers(), o.seed(), [s](LayerRange keep) { return byte_gpt(s, keep); });
    model.tied = s.tied();  // the head reads the embedding's bytes: one tensor, or copies summed under MPI
    return model;
  };
  t.data = fortunes;
  t.batch = [s](const TaskOptions& o) {
    torch::manual_seed(o.seed());
    const torch::Tensor bytes = torch::randint(256, {16, s.context + 1}, torch::kLong);
    return Dataset{bytes.narrow(1, 0, s.context).contiguous(), bytes.narrow(1, 1, s.context).contiguous()};
  };
  // The blocks split evenly, the embedding with the first stage, the last LayerNorm and the head
  // with the last (an even cut of the layers would give the first stage one block more).
  t.cut = [s](int devices, ScheduleKind, int V) {
    const int blocks = static_cast<int>(s.blocks);
    return devices * V <= blocks ? CutRequest::blocks(std::vector<int>(static_cast<size_t>(blocks), 1), 1, 2)
                                 : CutRequest::even();
  };
  return t;
}

}  // namespace gpipe::tasks
