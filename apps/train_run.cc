// train_run.cc: `gpipe train`'s run: the library's trainer with progress, the evaluation after
// every epoch, the timeline, --samples, --generate and the summary; a stop on SIGINT or SIGTERM,
// saved, with the command that resumes; a closed standard output.
#include "common.h"
#include "png_image.h"
#include "train.h"
#include "world.h"

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

// ---------------------------------------------------------------- stopping on a signal

// `word` as a shell reads it back: itself, or in single quotes.
std::string shell_quoted(const std::string& word) {
  const bool plain = !word.empty() && word.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                             "0123456789_-+=./:,@%") == std::string::npos;
  if (plain) return word;
  std::string out = "'";
  for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// A process's arguments as the kernel has them (/proc/PID/cmdline); none when it cannot be read.
std::vector<std::string> arguments_of(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (size_t at = 0; at < all.size();) {
    const size_t end = all.find('\0', at);
    args.push_back(all.substr(at, end == std::string::npos ? std::string::npos : end - at));
    at = end == std::string::npos ? all.size() : end + 1;
  }
  return args;
}

// Under mpirun, the launcher's words before `program`: the parent's own (mpirun and every flag the
// user gave it, a hostfile, --allow-run-as-root) when the parent is mpirun, as it is for the ranks
// on its host; "mpirun -np N" otherwise.
std::string launcher_words(const std::string& program) {
  const std::vector<std::string> parent = arguments_of(std::to_string(getppid()));
  const std::string name = parent.empty() ? "" : parent[0].substr(parent[0].find_last_of('/') + 1);
  if (name == "mpirun" || name == "mpiexec" || name == "orterun" || name == "prterun") {
    for (size_t n = 1; n < parent.size(); ++n) {
      if (parent[n] != program) continue;
      std::string out;
      for (size_t k = 0; k < n; ++k) out += (k == 0 ? "" : " ") + shell_quoted(parent[k]);
      return out;
    }
  }
  return "mpirun -np " + std::to_string(world().size);
}

// The command that continues this run from `file`: this process's command line (as the kernel
// has it) with --resume FILE in place of any --resume; under mpirun, after the launcher's words.
std::string resume_command(const std::string& file) {
  const std::vector<std::string> args = arguments_of("self");
  std::string out = world().mpi && !args.empty() ? launcher_words(args[0]) : "";
  for (size_t n = 0; n < args.size(); ++n) {
    if (args[n] == "--resume") {  // and its value
      ++n;
      continue;
    }
    if (args[n].rfind("--resume=", 0) == 0) continue;
    out += (out.empty() ? "" : " ") + shell_quoted(args[n]);
  }
  return out + " --resume " + shell_quoted(file);
}

std::string signal_name(int signal) {
  return signal == SIGINT ? "SIGINT" : signal == SIGTERM ? "SIGTERM" : "signal " + std::to_string(signal);
}

// ---------------------------------------------------------------- the run

// How the library's trainer runs the flags' training.
TrainerOptions trainer_options(const TrainOptions& o, const Choice& c) {
  TrainerOptions options;
  options.optimizer(optimizer_options(o))
      .lr_schedule(LrScheduleOptions()
                       .kind(parse_lr_schedule(o.lr_schedule))
                       .warmup_steps(o.warmup_steps)
                       .step_size(o.lr_step_size)
                       .gamma(o.lr_gamma))
      .clip_grad_norm(o.clip_grad_norm)
      .batch_size(o.batch_size)
      .drop_last(o.drop_last)
      .shuffle(o.shuffle)
      .seed(o.seed)
      .epochs(std::max(1, o.epochs))  // --epochs 0: no fit(), only the evaluation
      .steps(o.steps)
      .loss(c.task.loss)
      .classification(c.task.metric == Metric::kAccuracy)
      .save(o.save)
      .save_every(o.save_every)
      .per_device_files(o.per_stage_files);
  if (o.augment == "flip") {
    const uint64_t seed = o.seed;
    options.augment([seed](const torch::Tensor& x, const torch::Tensor& rows, int epoch) {
      return mirrored(x, rows, epoch, seed);
    });
  }
  return options;
}

// One run of `gpipe train`: the library's trainer (whose test hook GPIPE_TEST_FAULT injects faults,
// train.h), and the report of what the trainer measured.
class Run {
 public:
  Run(const TrainOptions& o, const Choice& c)
      : o_(o), c_(c), data_(c.data),
        trainer_(c.model, pipeline_options(o).balance(c.balance), trainer_options(o, c), c.data.train),
        pipeline_(trainer_.pipeline()), K_(pipeline_.devices()) {}

  void resume() {
    if (o_.resume.empty()) return;
    try {
      trainer_.resume(o_.resume);
    } catch (const std::invalid_argument& e) {  // a refused file; a failed rank is not a usage error
      usage_error("--resume: " + without_prefix(e.what()));
    }
  }

  // After a stop request (SIGINT, SIGTERM with --save): where the run stopped, what holds it, and
  // the command that continues it; returns the exit status, 128 + the signal.
  int stopped() {
    const int signal = trainer_.stopped_by();
    if (world().prints()) {
      const int64_t step = trainer_.step(), per_epoch = trainer_.steps_per_epoch();
      print_error_line("gpipe: stopped by " + signal_name(signal) + " at step " + std::to_string(step) + " of " +
                       std::to_string(trainer_.total_steps()) + " (epoch " + std::to_string(step / per_epoch + 1) +
                       ", " + std::to_string(step % per_epoch) + " of its " + std::to_string(per_epoch) +
                       " steps done); the run is saved in " +
                       (o_.per_stage_files ? trainer_.snapshot_file(o_.save, 0) + " .. " +
                                                 trainer_.snapshot_file(o_.save, K_ - 1) + " and " +
                                                 trainer_.manifest_file(o_.save)
                                           : o_.save));
      print_error_line("gpipe: resume with: " + resume_command(o_.save));
    }
    return 128 + signal;
  }

  int stopped_by() const { return trainer_.stopped_by(); }

  void print_header() {
    if (!printing()) return;
    const std::string devices = std::to_string(K_) + (K_ == 1 ? " device" : " devices");
    std::cout << "gpipe train: " << c_.model.name << " on " << data_.source << ", " << trainer_.samples()
              << (language_model() ? " training windows of " + std::to_string(data_.train.input.size(1)) + " bytes; "
                                   : " training samples; ")
              << (o_.virtual_stages > 1 ? devices + " x " + std::to_string(o_.virtual_stages) + " stages "
                                        : std::to_string(K_) + (K_ == 1 ? " stage " : " stages "))
              << nlohmann::json(c_.balance).dump() << ", " << o_.micro_batches << " micro-batches of a batch of "
              << o_.batch_size << ", schedule " << o_.schedule << ", checkpoint " << o_.checkpoint << ", "
              << o_.optimizer << " lr " << o_.lr << (o_.lr_schedule != "constant" ? " (" + o_.lr_schedule + ")" : "")
              << (world().mpi ? ", " + pipeline_.describe() : "")
              << (o_.resume.empty() ? "" : ", resumed at step " + std::to_string(trainer_.start_step())) << "\n";
    check_stdout();
  }

  // Trains with progress on standard error, and the evaluation after every epoch.
  void train() {
    if (o_.epochs == 0) return;  // --resume FILE --epochs 0: the checkpoint's model, evaluated
    Progress progress(o_.epochs, trainer_.steps_per_epoch(), world().prints());
    TrainerCallbacks callbacks;
    callbacks.after_step = [&](int epoch, int64_t batch) {
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
    if (trainer_.step() == trainer_.start_step()) evaluation_ = evaluate();  // no step ran: say what the restored model does
    int status = 0;
    if (!o_.trace.empty() && world().prints()) {
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
    if (!world().prints() || stdout_closed_) return status;
    print_summary(checksum);
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
  bool printing() const { return world().prints() && !o_.json && !stdout_closed_; }

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
  bool denoising() const { return c_.task.metric == Metric::kPsnr; }
  bool language_model() const { return c_.task.metric == Metric::kBitsPerByte; }
  bool classification() const { return c_.task.metric == Metric::kAccuracy; }
  static double bits_per_byte(double loss) { return metric_of_loss(Metric::kBitsPerByte, loss); }

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
    generated_ = shown_text(generate_text(pipeline_, c_.task.context, options, [this](char byte) {
      if (!printing()) return;
      std::cout << shown_text(std::string(1, byte)) << std::flush;
      check_stdout();
    }));
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

  void report(int epoch) {
    evaluation_ = evaluate();
    const std::string& eval = data_.test_name;
    epochs_.push_back({{"epoch", epoch}, {"step", trainer_.step()}, {"loss", trainer_.stats().last_loss}, {eval + "_loss", evaluation_.loss}});
    if (classification()) epochs_.back()[eval + "_accuracy"] = evaluation_.accuracy;
    if (denoising()) epochs_.back()[eval + "_psnr_db"] = psnr_db(evaluation_.loss);
    if (language_model()) epochs_.back()[eval + "_bits_per_byte"] = bits_per_byte(evaluation_.loss);
    if (!printing()) return;
    std::cout << "epoch " << epoch << ": loss " << std::fixed << std::setprecision(4) << trainer_.stats().last_loss;
    if (classification())
      std::cout << ", " << eval << " accuracy " << std::setprecision(2) << 100 * evaluation_.accuracy << "%";
    else if (denoising())
      std::cout << ", " << eval << " PSNR " << std::setprecision(2) << psnr_db(evaluation_.loss) << " dB (noisy input "
                << data_.noisy_psnr_db << " dB)";
    else if (language_model())
      std::cout << ", " << eval << " " << std::setprecision(3) << bits_per_byte(evaluation_.loss)
                << " bits per byte (bigram " << data_.bigram_bits_per_byte << ", gzip -9 " << data_.gzip_bits_per_byte
                << ")";
    else
      std::cout << ", " << eval << " loss " << evaluation_.loss;
    std::cout << std::endl;
    check_stdout();
  }

  void print_summary(double checksum) {
    const nlohmann::json s = summary(checksum);
    if (o_.json) {
      std::cout << s.dump(2) << std::endl;
      return;
    }
    const std::string& eval = data_.test_name;
    const int64_t run_steps = trainer_.step() - trainer_.start_step();
    std::cout << "\nsummary\n";
    if (run_steps == 0 && o_.epochs == 0)
      std::cout << "  no step ran (--epochs 0): the checkpoint file's model, at step " << trainer_.step() << "\n";
    else if (run_steps == 0)
      std::cout << "  no step ran: the checkpoint file is at step " << trainer_.step() << ", and the run ends at step "
                << trainer_.total_steps() << "\n";
    if (classification())
      std::cout << "  " << eval << " accuracy  " << std::fixed << std::setprecision(2) << 100 * evaluation_.accuracy
                << "%\n";
    else if (denoising())
      std::cout << "  " << eval << " PSNR      " << std::fixed << std::setprecision(2) << psnr_db(evaluation_.loss)
                << " dB (noisy input " << data_.noisy_psnr_db << " dB)\n";
    else if (language_model())
      std::cout << "  " << eval << " bits per byte  " << std::fixed << std::setprecision(3)
                << bits_per_byte(evaluation_.loss) << " (bigram " << data_.bigram_bits_per_byte << ", gzip -9 "
                << data_.gzip_bits_per_byte << ")\n";
    else
      std::cout << "  " << eval << " loss  " << std::fixed << std::setprecision(6) << evaluation_.loss << "\n";
    std::cout << format_run_figures({trainer_.stats().train_seconds, run_steps, s["samples_per_s"].get<double>(),
                                     s["bubble"].get<double>(), c_.balance, pipeline_.plan().placement, K_})
              << std::flush;
    if (!o_.save.empty())
      std::cout << "  saved to       "
                << (o_.per_stage_files ? trainer_.snapshot_file(o_.save, 0) + " .. " + trainer_.snapshot_file(o_.save, K_ - 1)
                                       : o_.save)
                << std::endl;
  }

  nlohmann::json summary(double checksum) const {
    const int64_t run_steps = trainer_.step() - trainer_.start_step();
    const std::string& eval = data_.test_name;
    nlohmann::json stages = nlohmann::json::array();
    for (int j = 0; j < static_cast<int>(c_.balance.size()); ++j) {
      stages.push_back({{"stage", j},
                        {"device", pipeline_.plan().placement[static_cast<size_t>(j)]},
                        {"layers", c_.balance[static_cast<size_t>(j)]}});
      if (!world().mpi) {
        nlohmann::json names = nlohmann::json::array();
        const int first = stage_offsets(c_.balance)[static_cast<size_t>(j)];
        const auto children = pipeline_.layers()->children();
        for (int n = first; n < first + c_.balance[static_cast<size_t>(j)]; ++n)
          names.push_back(children[static_cast<size_t>(n)]->name());
        stages.back()["modules"] = names;
      }
    }
    const nlohmann::json none;  // null: no step ran, so no loss was measured
    nlohmann::json s = {{"evaluated_on", eval},
                        {eval + "_loss", evaluation_.loss},
                        {"first_loss", run_steps > 0 ? nlohmann::json(trainer_.stats().first_loss) : none},
                        {"final_loss", run_steps > 0 ? nlohmann::json(trainer_.stats().last_loss) : none},
                        {"no_step_ran", run_steps == 0},
                        {"train_seconds", trainer_.stats().train_seconds},
                        {"samples_per_s", trainer_.stats().samples_per_s()},
                        {"steps", trainer_.step()},
                        {"steps_this_run", run_steps},
                        {"steps_per_epoch", trainer_.steps_per_epoch()},
                        {"epochs", epochs_},
                        {"stages", K_},
                        {"balance", c_.balance},
                        {"partition", stages},
                        {"plan", c_.plan},
                        {"micro_batches", o_.micro_batches},
                        {"checkpoint", o_.checkpoint},
                        {"schedule", o_.schedule},
                        {"virtual_stages", o_.virtual_stages},
                        {"batch_size", o_.batch_size},
                        {"drop_last", o_.drop_last},
                        {"shuffle", o_.shuffle},
                        {"optimizer", o_.optimizer},
                        {"lr", o_.lr},
                        {"lr_schedule", o_.lr_schedule},
                        {"augment", o_.augment},
                        {"batch_norm", o_.batch_norm},
                        {"warmup_steps", o_.warmup_steps},
                        {"weight_decay", o_.weight_decay},
                        {"clip_grad_norm", o_.clip_grad_norm},
                        {"seed", o_.seed},
                        {"bubble", run_steps > 0 ? trainer_.stats().bubble_sum / static_cast<double>(run_steps) : 0.0},
                        {"parameter_checksum", checksum},
                        {"machine", machine()}};
    if (o_.optimizer == "sgd") {
      s["momentum"] = o_.momentum;
      s["nesterov"] = o_.nesterov;
    } else {
      s["betas"] = o_.betas;
    }
    if (world().mpi) s["mpi"] = {{"ranks", world().size}, {"replicas", world().size / K_}};
    if (classification()) s[eval + "_accuracy"] = evaluation_.accuracy;
    if (denoising()) {
      s[eval + "_psnr_db"] = psnr_db(evaluation_.loss);
      s["noisy_" + eval + "_psnr_db"] = data_.noisy_psnr_db;
    }
    if (language_model()) {
      s[eval + "_bits_per_byte"] = bits_per_byte(evaluation_.loss);
      s["bigram_bits_per_byte"] = data_.bigram_bits_per_byte;
      s["gzip_bits_per_byte"] = data_.gzip_bits_per_byte;
      s["train_bytes"] = data_.train_bytes;
      s["test_bytes"] = data_.test_bytes;
      s["context"] = data_.train.input.size(1);
    }
    if (o_.generate > 0) {
      s["generated"] = generated_;
      s["prompt"] = shown_text(o_.prompt);
      s["temperature"] = o_.temperature;
    }
    return s;
  }

  const TrainOptions& o_;
  const Choice& c_;
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

int train_and_report(const TrainOptions& o, const Choice& c) {
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
