// scoring.cc: the scorings the built-in tasks share (builtin.h): each reads an evaluation in its
// metric and prints it, with its unit and its data's references, as gpipe train's lines and JSON
// have it. A new metric is a Scoring written in the task file that uses it.
#include "tasks/builtin.h"

#include <cmath>
#include <iomanip>
#include <sstream>

namespace gpipe {

namespace {

using Figures = std::vector<std::pair<std::string, double>>;

// `value` with `digits` after the point, as every score is printed.
std::string fixed(double value, int digits) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << value;
  return out.str();
}

// The cross-entropy `loss` (in nats per byte) in bits per byte.
double bits_of(double loss) { return loss / std::log(2.0); }

}  // namespace

Scoring accuracy_scoring() {
  Scoring s;
  s.name = "accuracy";
  s.classification = true;
  s.format = [](const Evaluation& e, const TaskData& d, bool summary) {
    return d.test_name + (summary ? " accuracy  " : " accuracy ") + fixed(100 * e.accuracy, 2) + "%";
  };
  s.figures = [](const Evaluation& e, const TaskData& d, bool) { return Figures{{d.test_name + "_accuracy", e.accuracy}}; };
  return s;
}

namespace tasks {

Scoring psnr_scoring() {
  Scoring s;
  s.name = "psnr_db";
  s.format = [](const Evaluation& e, const TaskData& d, bool summary) {
    return d.test_name + (summary ? " PSNR      " : " PSNR ") + fixed(psnr_db(e.loss), 2) + " dB (noisy input " +
           fixed(d.noisy_psnr_db, 2) + " dB)";
  };
  s.figures = [](const Evaluation& e, const TaskData& d, bool references) {
    Figures out{{d.test_name + "_psnr_db", psnr_db(e.loss)}};
    if (references) out.emplace_back("noisy_" + d.test_name + "_psnr_db", d.noisy_psnr_db);
    return out;
  };
  return s;
}

Scoring bits_per_byte_scoring() {
  Scoring s;
  s.name = "bits_per_byte";
  s.format = [](const Evaluation& e, const TaskData& d, bool summary) {
    const std::string bits = fixed(bits_of(e.loss), 3);
    return d.test_name + (summary ? " bits per byte  " + bits : " " + bits + " bits per byte") + " (bigram " +
           fixed(d.bigram_bits_per_byte, 3) + ", gzip -9 " + fixed(d.gzip_bits_per_byte, 3) + ")";
  };
  s.figures = [](const Evaluation& e, const TaskData& d, bool references) {
    Figures out{{d.test_name + "_bits_per_byte", bits_of(e.loss)}};
    if (references)
      out.insert(out.end(), {{"bigram_bits_per_byte", d.bigram_bits_per_byte}, {"gzip_bits_per_byte", d.gzip_bits_per_byte}});
    return out;
  };
  return s;
}

Scoring loss_scoring() {
  Scoring s;
  s.name = "loss";
  s.format = [](const Evaluation& e, const TaskData& d, bool summary) {
    return d.test_name + (summary ? " loss  " : " loss ") + fixed(e.loss, summary ? 6 : 4);
  };
  s.figures = [](const Evaluation&, const TaskData&, bool) { return Figures{}; };
  return s;
}

}  // namespace tasks
}  // namespace gpipe
