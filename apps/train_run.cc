// train_run.cc: `gpipe train`'s run: the library's trainer with progress, the evaluation after
// every epoch, the timeline, --samples, --generate and the summary; a stop on SIGINT or SIGTERM,
// saved, with the command that resumes; a closed standard output.
#include "common.h"
#include "train.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <cerrno>
#include <cmath>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <sstream>
#include <vector>

#include <poll.h>
#include <unistd.h>

namespace gpipe::cli {
namespace {

// One run of `gpipe train`: the library's trainer (whose test hook GPIPE_TEST_FAULT injects faults,
// train.h), and the report of what the trainer measured.
class Run {
 public:
  Run(const TrainOptions& o, const TrainingRun& c)
      : o_(o), c_(c), data_(c.data),
        trainer_(c.model, c.plan, c.options, trainer_options_of(o, c.task), c.data.train),
        pipeline_(trainer_.pipeline()), K_(pipeline_.devices()) {}

  void resume() {
    if (o_.resume.empty()) return;
    try {
      trainer_.resume(o_.resume);
      check_resumed_precision(o_, trainer_);
    } catch (const std::invalid_argument& e) {  // a refused file; a failed rank is not a usage error
      usage_error("--resume: " + without_prefix(e.what()));
    }
  }

  // After a stop request (SIGINT, SIGTERM with --save): where the run stopped, what holds it, and
  // the command that continues it; returns the exit status, 128 + the signal.
  int stopped() {
    if (job().prints())
      for (const std::string& line : trainer_.stop_report("--resume")) print_error_line(line);
    return 128 + trainer_.stopped_by();
  }

  int stopped_by() const { return trainer_.stopped_by(); }

  void print_header() {
    if (!printing()) return;
    const std::string devices = std::to_string(K_) + (K_ == 1 ? " device" : " devices");
    std::cout << "gpipe train: " << c_.model.name << " on " << data_.source << ", " << trainer_.samples()
              << (c_.task.context > 0 ? " training windows of " + std::to_string(data_.train.input.size(1)) + " bytes; "
                                      : trainer_.samples() == 1 ? " training sample; " : " training samples; ")
              << (o_.virtual_stages > 1 ? devices + " x " + std::to_string(o_.virtual_stages) + " stages "
                                        : std::to_string(K_) + (K_ == 1 ? " stage " : " stages "))
              << nlohmann::json(c_.plan.balance).dump() << ", " << o_.micro_batches
              << (o_.micro_batches == 1 ? " micro-batch" : " micro-batches") << " of a batch of "
              << std::min(o_.batch_size, trainer_.samples()) << ", schedule " << o_.schedule << ", checkpoint " << o_.checkpoint
              << (c_.plan.precision != Precision::kFloat32 ? ", precision " + to_string(c_.plan.precision) : "") << ", "
              << o_.optimizer << " lr " << o_.lr << (o_.lr_schedule != "constant" ? " (" + o_.lr_schedule + ")" : "")
              << (job().distributed ? ", " + pipeline_.describe() : "")
              << (o_.resume.empty() ? "" : ", resumed at step " + std::to_string(trainer_.start_step())) << "\n";
    check_stdout();
  }

  // Trains with progress on standard error, and the evaluation after every epoch.
  void train() {
    if (o_.epochs == 0) return;  // --resume FILE --epochs 0: the checkpoint's model, evaluated
    TrainingProgress progress(o_.epochs, trainer_.steps_per_epoch(), job().prints());
    TrainerCallbacks callbacks;
    callbacks.progress = [&](int epoch, int64_t batch) {
      if (!o_.trace.empty() && trainer_.step() == trainer_.total_steps()) last_trace_ = pipeline_.trace();
      const TrainStats& t = trainer_.stats();
      progress.update(epoch, batch, t.last_loss, t.samples_per_s(),
                      static_cast<double>(trainer_.total_steps() - trainer_.step()) * t.train_seconds /
                          static_cast<double>(trainer_.step() - trainer_.start_step()));
    };
    callbacks.after_epoch = [&](int epoch) {
      progress.end_epoch();
      report(epoch);
    };
    trainer_.fit(callbacks);
  }

  // The trace, the summary; returns the exit status (1 if an output could not be written).
  int finish() {
    if (trainer_.step() == trainer_.start_step()) {  // no step ran: say what the restored model does
      evaluation_ = evaluate();
      check_finite_evaluation(0);
    }
    int status = 0;
    if (!o_.trace.empty() && job().prints()) {
      if (trainer_.step() == trainer_.start_step()) {
        print_error_line("gpipe: --trace: no step ran, so there is no timeline to write");
      } else {
        try {
          write_trace(last_trace_, o_.trace);
        } catch (const std::exception& e) {  // the summary still comes
          print_error_line("gpipe: --trace: " + without_prefix(e.what()));
          status = 1;
        }
      }
    }
    try {
      write_samples();
    } catch (const std::exception& e) {  // the summary still comes
      print_error_line("gpipe: --samples: " + without_prefix(e.what()));
      status = 1;
    }
    generate();
    const double checksum = pipeline_.checksum();
    if (!job().prints() || stdout_closed_) return status;
    const std::string saved_to = o_.save.empty() || !o_.per_device_files ? o_.save
        : trainer_.snapshot_file(o_.save, 0) + " .. " + trainer_.snapshot_file(o_.save, K_ - 1);
    print_summary(o_, c_, summarize_run(trainer_, c_.task, data_, evaluation_, checksum), epochs_, generated_, saved_to);
    check_stdout();
    if (!std::cout && !stdout_closed_) {
      const int error = stdout_error_;
      print_error_line(std::string("gpipe: cannot write to standard output: ") +
                       (error != 0 ? std::strerror(error) : "write error"));
      return 1;
    }
    return status;
  }

 private:
  bool printing() const { return job().prints() && !o_.json && !stdout_closed_; }

  // A closed standard output (gpipe train ... | head; SIGPIPE is ignored) stops the printing,
  // not the training: said once on standard error. Other write errors are reported by finish().
  void check_stdout() {
    std::cout.flush();
    if (std::cout || stdout_closed_) return;
    if (stdout_error_ == 0) stdout_error_ = errno;  // that of the first failed write
    pollfd out{STDOUT_FILENO, POLLOUT, 0};  // a pipe whose reader has gone polls as an error
    if (stdout_error_ != EPIPE && !(::poll(&out, 1, 0) == 1 && (out.revents & POLLERR))) return;
    stdout_closed_ = true;
    print_error_line("gpipe: standard output is closed (its reader has gone): training goes on, without printing "
                     "to it");
  }
  // --generate: bytes sampled from the model (generate_text), printed as they are sampled (the JSON
  // summary holds them whole).
  void generate() {
    if (o_.generate == 0) return;
    const GenerateOptions options =
        GenerateOptions().bytes(o_.generate).prompt(o_.prompt).temperature(o_.temperature).seed(o_.seed);
    if (printing()) {
      std::cout << "\ngenerated (" << o_.generate << " bytes after the prompt, temperature " << o_.temperature
                << ", seed " << o_.seed << "):\n" << shown_text(o_.prompt) << std::flush;
      check_stdout();
    }
    // Where the bytes do not show as they come (standard output is a file or a pipe, or --json),
    // how far the sampling is, every 2 s, on standard error.
    ProgressLine progress(!(printing() && isatty(STDOUT_FILENO) != 0) && job().prints(), /*rewrite=*/false);
    int64_t done = 0;
    auto report = [&] {
      const double seconds = progress.seconds();
      const double left = seconds * static_cast<double>(o_.generate - done) / static_cast<double>(std::max<int64_t>(1, done));
      progress.show("gpipe: generated " + std::to_string(done) + " of " + std::to_string(o_.generate) + " bytes in " +
                    fixed(seconds, 0) + " s" +
                    (done < o_.generate ? ", about " + std::to_string(static_cast<int64_t>(left + 0.5)) + " s left" : ""));
    };
    generated_ = shown_text(generate_text(pipeline_, c_.task.context, options, [&](char byte) {
      ++done;
      if (progress.due(2.0)) report();
      if (!printing()) return;
      std::cout << shown_text(std::string(1, byte)) << std::flush;
      check_stdout();
    }));
    if (progress.shown()) report();
    if (printing()) std::cout << "\n";
  }

  // --samples: the first test images, noisy, denoised and clean, one row each, written by the
  // process that holds the model's output for them (under MPI, the first replica's last stage).
  void write_samples() {
    if (o_.samples.empty()) return;
    constexpr int64_t kShown = 8;
    const torch::Tensor picture = denoising_picture(pipeline_, data_.test, kShown, replicas_of(K_));
    if (!picture.defined()) return;
    write_png(o_.samples, picture);
    if (!o_.json)
      std::cout << "samples: " << o_.samples << " (rows: noisy, denoised, clean; " << picture.size(1) / 58
                << " test images)" << std::endl;
    check_stdout();
  }

  Evaluation evaluate() { return trainer_.evaluate(data_.test); }

  // A test loss that is NaN or infinite ends the run with an error (exit 1) before the epoch's save:
  // a diverged model does not replace the checkpoint file; the file keeps the last save before.
  void check_finite_evaluation(int epoch) {
    const std::string error = divergence_error(trainer_, evaluation_, data_, epoch, o_.resume);
    if (!error.empty()) throw std::runtime_error(in_flags(error));
  }

  void report(int epoch) {
    evaluation_ = evaluate();
    check_finite_evaluation(epoch);
    const std::string& eval = data_.test_name;
    epochs_.push_back({{"epoch", epoch}, {"step", trainer_.step()}, {"loss", trainer_.stats().last_loss}, {eval + "_loss", evaluation_.loss}});
    for (const auto& [name, value] : c_.task.scoring.figures(evaluation_, data_, false)) epochs_.back()[name] = value;
    if (!printing()) return;
    std::cout << "epoch " << epoch << ": loss " << fixed(trainer_.stats().last_loss, 4) << ", "
              << c_.task.scoring.format(evaluation_, data_, /*summary=*/false) << std::endl;
    check_stdout();
  }

  const TrainOptions& o_;
  const TrainingRun& c_;
  const TaskData& data_;
  bool stdout_closed_ = false;
  int stdout_error_ = 0;
  Trainer trainer_;
  Pipeline& pipeline_;
  const int K_;
  Evaluation evaluation_;
  nlohmann::json epochs_ = nlohmann::json::array();
  StepTrace last_trace_;  // of the last training step, for --trace
  std::string generated_;  // --generate: the prompt and the sample, as shown()
};

}  // namespace

int train_and_report(const TrainOptions& o, const TrainingRun& c) {
  Run run(o, c);
  run.resume();
  run.print_header();
  // With --save, SIGINT and SIGTERM stop at the next step boundary, saved (a second one ends at
  // once); without it they end the run as they always did (train_flags.cc installed that).
  if (!o.save.empty()) install_signal_handlers(OnSignal::kStopAtStep);
  run.train();
  if (run.stopped_by() != 0) return run.stopped();
  return run.finish();
}

}  // namespace gpipe::cli
