// extras.cc: what a task shows beyond its metric: text sampled from a language model, and a
// picture of denoised images.
#include "gpipe/tasks.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <cmath>
#include <iomanip>
#include <sstream>

namespace gpipe {

void GenerateOptions::check() const {
  GPIPE_CHECK(bytes() >= 0 && bytes() <= kMostGeneratedBytes, "`bytes` ", bytes(), ": at most ", kMostGeneratedBytes,
              " bytes (each is one pass of the model); sample more in several runs with other `seed` values");
  // The scores are divided by the temperature: a tiny one makes them infinite, and no byte can be drawn.
  GPIPE_CHECK(std::isfinite(temperature()) && temperature() > 0 && std::isfinite(1.0 / temperature()) &&
                  std::isfinite(100.0 / temperature()),
              "`temperature` ", temperature(), ": the scores are divided by it, so it must be a finite number above 0 "
              "whose inverse is finite too; use 0.01 for nearly the likeliest byte each time, 1 for the model's own odds");
}

std::string generate_text(Pipeline& pipeline, int64_t context, const GenerateOptions& options,
                          const std::function<void(char)>& on_byte) {
  options.check();
  GPIPE_CHECK(context >= 1, "a language model's context is at least 1 byte (got ", context, ")");
  std::string text = "%\n" + options.prompt();  // the context starts as a fortune does, after a line "%"
  torch::Generator random = at::detail::createCPUGenerator(options.seed());
  const EvalScope eval(pipeline.layers());
  for (int64_t n = 0; n < options.bytes(); ++n) {
    const size_t from = text.size() > static_cast<size_t>(context) ? text.size() - static_cast<size_t>(context) : 0;
    std::vector<int64_t> window;
    for (size_t k = from; k < text.size(); ++k) window.push_back(static_cast<uint8_t>(text[k]));
    const torch::Tensor x = torch::tensor(window, torch::kLong).view({1, -1});
    const torch::Tensor scores = pipeline.forward(x).select(1, x.size(1) - 1).squeeze(0);
    const torch::Tensor p = torch::softmax(scores.to(torch::kDouble) / options.temperature(), -1);
    text += static_cast<char>(torch::multinomial(p, 1, false, random).item<int64_t>());
    if (on_byte) on_byte(text.back());
  }
  return text.substr(2);
}

std::string shown_text(const std::string& bytes) {
  std::ostringstream out;
  for (const char c : bytes) {
    const auto b = static_cast<uint8_t>(c);
    if ((b >= 0x20 && b < 0x7f && b != '\\') || b == '\n' || b == '\t') {
      out << c;
    } else if (b == '\\') {
      out << "\\\\";
    } else {
      out << "\\x" << std::hex << std::setw(2) << std::setfill('0') << static_cast<int>(b) << std::dec;
    }
  }
  return out.str();
}

torch::Tensor denoising_picture(Pipeline& pipeline, const Dataset& test, int64_t shown, int replicas) {
  GPIPE_CHECK(shown >= 1 && replicas >= 1, "a picture shows at least one image of at least one replica");
  // Each of the replicas runs its share of the rows: `shown` each, so that the first replica holds
  // the ones one process shows.
  const int64_t n = std::min<int64_t>(shown * replicas, test.size());
  const torch::Tensor noisy = test.input.narrow(0, 0, n);
  torch::Tensor out;
  {
    const EvalScope eval(pipeline.layers());
    out = pipeline.forward(noisy);  // inference keeps no graph
  }
  if (!out.defined() || pipeline.output_rows(n).first != 0) return {};
  shown = std::min(shown, out.size(0));  // fewer only when the test set is small
  out = out.narrow(0, 0, shown);
  auto row = [shown](const torch::Tensor& images) {  // [n, 1, 28, 28] normalized -> [58, n * 58] pixels
    const torch::Tensor pixels = (images.detach().cpu() * kFashionStd + kFashionMean).clamp(0, 1).mul(255).round();
    const torch::Tensor big = torch::nn::functional::interpolate(
        pixels, torch::nn::functional::InterpolateFuncOptions().scale_factor(std::vector<double>{2, 2})
                    .mode(torch::kNearest));
    const torch::Tensor framed = torch::constant_pad_nd(big, {1, 1, 1, 1}, 255);  // white gaps
    return framed.squeeze(1).permute({1, 0, 2}).reshape({framed.size(2), shown * framed.size(3)});
  };
  return torch::cat({row(noisy.narrow(0, 0, shown)), row(out), row(test.target.narrow(0, 0, shown))}, 0)
      .to(torch::kUInt8);
}

}  // namespace gpipe
