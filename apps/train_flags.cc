// train_flags.cc: `gpipe train`'s flags, their help and their checks that need no file.
#include "commands.h"
#include "common.h"
#include "train.h"

#include <CLI/CLI.hpp>

#include <csignal>
#include <functional>
#include <memory>
#include <sstream>
#include <string>

namespace gpipe::cli {

namespace {

// "cnn 8, resnet 14, ...": a default of each built-in task, for a help text.
std::string per_task(const std::function<std::string(const TaskDefaults&)>& value) {
  std::string out;
  for (const std::string& name : task_names()) out += (out.empty() ? "" : ", ") + name + " " + value(find_task(name).defaults);
  return out;
}

// Each built-in task and what it is, for --model's help.
std::string task_list() {
  std::string out;
  for (const std::string& name : task_names()) out += name + " (" + find_task(name).summary + "), ";
  std::string workloads;
  for (const std::string& name : task_names(true))
    if (find_task(name).workload) workloads += (workloads.empty() ? "" : ", ") + name;
  return out + "a benchmark workload on its random batch (" + workloads + ")";
}

}  // namespace

void add_train_command(CLI::App& app, const std::string&, int& status) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* sub = app.add_subcommand(
      "train", "Train through a GPipe pipeline: a CNN on Fashion-MNIST by default, or --model/--data from Python");
  sub->add_option("--data-dir", o->data_dir,
                  "folder with the gzipped IDX files of Fashion-MNIST; with --model gpt, the folder of fortune "
                  "files (default " + std::string(kFortunesDir) + ")")
      ->check(non_empty())->capture_default_str();
  sub->add_option("--model", o->model,
                  "a built-in task: " + task_list() + "; or FILE: a TorchScript nn.Sequential saved in Python "
                  "(torch.jit.script(model).save(FILE)) whose top-level children are the layers cut into stages; "
                  "default: cnn")->check(non_empty());
  sub->add_option("--data", o->data,
                  "a dataset saved in Python with torch.save({'input': X, 'target': Y}, FILE), "
                  "instead of Fashion-MNIST (evaluated on itself)")->check(non_empty());
  sub->add_option("--loss", o->loss, "cross_entropy (integer class targets) or mse (mean reduction)")
      ->check(CLI::IsMember({"cross_entropy", "mse"}))->capture_default_str();
  sub->add_option("--stages", o->devices,
                  "K, the number of devices (with --schedule interleaved each runs V stages); cut as --schedule "
                  "auto predicts fastest, or with another schedule: the built-in CNN on 2 {3, 1, 2, 5} interleaved "
                  "(--schedule task), or {3, 8}; otherwise evenly; under mpirun -np N or torchrun --nproc_per_node N, one rank per "
                  "device and N/K pipeline replicas")
      ->check(at_least(1))->capture_default_str();
  sub->add_option("--balance", o->balance, "layers per stage, K x V entries, e.g. --balance 3,8 (overrides the cut)")
      ->delimiter(',')->check(at_least(1));
  sub->add_option("--balance-by", o->balance_by,
                  "cut the --stages stages by per-layer cost on one micro-batch: params (parameter counts), "
                  "time (profiled forward+backward) or memory (activations kept, parameters, gradients, "
                  "optimizer state); the exact min-max cut (of the devices where a schedule puts several stages "
                  "on one), printed with its predicted step")
      ->check(CLI::IsMember({"params", "time", "memory"}));
  sub->add_option("--micro-batches", o->micro_batches, "micro-batches M per mini-batch (default: chosen by "
                  "--schedule auto; 4 with a schedule named, or task)")
      ->check(at_least(1));
  sub->add_option("--checkpoint", o->checkpoint,
                  "re-materialization: always, except_last or never (the CNN's activations are small)")
      ->check(CLI::IsMember(checkpoint_names()))->capture_default_str();
  sub->add_option("--batch-norm", o->batch_norm,
                  "BatchNorm layers in training: deferred (as the paper: each micro-batch normalized by its own "
                  "statistics, the running statistics updated once per step from all its rows) or per-micro-batch "
                  "(updated by each micro-batch, as M small batches would)")
      ->check(CLI::IsMember({"deferred", "per-micro-batch"}))->capture_default_str();
  sub->add_option("--augment", o->augment,
                  "flip: mirror each training image left to right in about half the epochs (chosen per image and "
                  "epoch from --seed, so a resumed run mirrors alike); none; auto: flip for --model resnet, none "
                  "otherwise")
      ->check(CLI::IsMember({"auto", "none", "flip"}))->capture_default_str();
  sub->add_option("--schedule", o->schedule,
                  "the order of forwards and backwards: " + schedule_help() + "; auto (the "
                  "default): the layers profiled (about 8 forward and backward passes of the batch for each M weighed: "
                  "a few seconds for the CNN), every schedule x V x M (M only when "
                  "--micro-batches is not given) that fits this machine's memory at --stages and --batch-size "
                  "simulated, and the fastest predicted run with its cut (unless --balance, or --balance-by's from the "
                  "same profile); printed with its predicted and measured step and bubble; with --resume, the "
                  "pipeline the file was trained with; under mpirun or torchrun: task. The choice follows measured "
                  "times, so two runs may choose differently and differ in the last bits: name a schedule, or task, "
                  "for runs that repeat bit for bit. task: the task's own, interleaved with the cut {3, 1, 2, 5} for "
                  "the built-in CNN on 2 stages, gpipe otherwise. See gpipe schedule and docs/schedules.md")
      ->check(CLI::IsMember([] {
        std::vector<std::string> names = schedule_names();
        names.insert(names.begin(), {"task", "auto"});
        return names;
      }()))
      ->capture_default_str();
  sub->add_option("--virtual-stages", o->virtual_stages,
                  "V, stages per device (" + virtual_stages_help() + "): the model is cut into K x V stages, "
                  "stage s on device s mod K unless placed as a V")
      ->check(at_least(1));
  sub->add_option("--batch-size", o->batch_size,
                  "samples per mini-batch (one optimizer step), at most the training samples; default: the task's own (" +
                      per_task([](const TaskDefaults& d) { return std::to_string(d.batch_size); }) + ")")
      ->check(at_least(1, kMostInt64))->capture_default_str();
  sub->add_flag("--drop-last", o->drop_last,
                "leave out each epoch's last batch when it is smaller than --batch-size (kept by default, as "
                "PyTorch's DataLoader keeps it)");
  sub->add_flag("--no-shuffle{false}", o->shuffle, "take the samples in their order every epoch, instead of shuffled");
  sub->add_option("--epochs", o->epochs,
                  "passes over the training set (default: the task's own: " +
                      per_task([](const TaskDefaults& d) { return std::to_string(d.epochs); }) + "); 0 with --resume: no training, only the evaluation (and --generate) of the "
                      "checkpoint's model")
      ->check(at_least(0));
  sub->add_option("--steps", o->steps, "stop after this many optimizer steps in all, resumed ones included (0: no limit)")
      ->check(at_least(0, kMostInt64))->capture_default_str();
  sub->add_option("--optimizer", o->optimizer, "sgd, adam or adamw (torch.optim's)")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))->capture_default_str();
  sub->add_option("--lr", o->lr, "learning rate (default: the task's own: " +
                  per_task([](const TaskDefaults& d) { return [&] { std::ostringstream lr; lr << d.lr; return lr.str(); }(); }) + ")")->check(positive_number())->capture_default_str();
  sub->add_option("--momentum", o->momentum, "SGD's momentum (as torch.optim.SGD: default 0)")
      ->check(non_negative_number())->capture_default_str();
  sub->add_flag("--nesterov", o->nesterov, "SGD with Nesterov momentum (needs --momentum above 0)");
  sub->add_option("--weight-decay", o->weight_decay,
                  "L2 penalty (SGD, Adam) or decoupled weight decay (AdamW); default 0, and 0.01 for adamw, as "
                  "torch.optim")
      ->check(non_negative_number());
  sub->add_option("--betas", o->betas, "Adam's and AdamW's two betas, e.g. --betas 0.9,0.999")
      ->expected(2)->delimiter(',')->check(fraction_below_one());
  sub->add_option("--lr-schedule", o->lr_schedule,
                  "constant (cosine for --model resnet and gpt); cosine (from --lr down to 0 over the run); step (times "
                  "--lr-gamma every --lr-step-size steps); after --warmup-steps of linear warm-up")
      ->check(CLI::IsMember({"constant", "cosine", "step"}))->capture_default_str();
  sub->add_option("--warmup-steps", o->warmup_steps, "steps of linear warm-up: step t runs at --lr x (t+1)/W; at most the run's steps (a longer "
                  "warm-up would never reach --lr)")
      ->check(at_least(0, kMostInt64))->capture_default_str();
  sub->add_option("--lr-step-size", o->lr_step_size, "--lr-schedule step: steps between decays (default: one epoch)")
      ->check(at_least(1, kMostInt64));
  sub->add_option("--lr-gamma", o->lr_gamma, "--lr-schedule step: the factor of each decay")
      ->check(positive_number())->capture_default_str();
  sub->add_option("--clip-grad-norm", o->clip_grad_norm,
                  "scale the gradient down to this L2 norm when it is larger: the norm of the whole model's "
                  "gradient, over every stage and rank, as torch.nn.utils.clip_grad_norm_ on one device")
      ->check(positive_number());
  sub->add_option("--seed", o->seed_text, "seed of the model, the shuffling and dropout (0 to 2^64-1)")
      ->capture_default_str();
  sub->add_option("--threads-per-stage", o->threads_per_device, "intra-op threads of each device (at most the machine's cores)")
      ->check(at_least(1))->capture_default_str();
  sub->add_option("--train-samples", o->train_samples, "use only the first N training samples (0: all)")
      ->check(at_least(0, kMostInt64))->capture_default_str();
  sub->add_option("--test-samples", o->test_samples, "use only the first N Fashion-MNIST test images (0: all)")
      ->check(at_least(0, kMostInt64))->capture_default_str();
  sub->add_option("--save", o->save,
                  "write a checkpoint file (model, optimizer, step, random states) after every epoch and at the end, "
                  "whole or not at all; with --model it is TorchScript that torch.jit.load reads; under mpirun or torchrun "
                  "the first rank gathers every stage into this one file. With --save, SIGINT (Ctrl-C), SIGTERM or "
                  "SIGHUP lets the step in progress finish (one abandoned after 10 s is undone), saves, prints the "
                  "command that resumes, and exits 130, 143 or 129; a second signal ends at once, the file saved before intact. "
                  "Without --save they end the run at once")->check(non_empty());
  sub->add_option("--save-every", o->save_every,
                  "with --save: also save every STEPS optimizer steps (counted over the whole run), so that a "
                  "killed run or a dead MPI rank loses at most STEPS steps")
      ->check(at_least(1, kMostInt64));
  sub->add_option("--resume", o->resume,
                  "continue from a checkpoint file written by --save, with the same model and optimizer and any "
                  "--stages, schedule or number of ranks; under --schedule auto in one process, with the pipeline "
                  "the file records, where the run has its --stages and --batch-size and names no other "
                  "--micro-batches, --virtual-stages or --balance")->check(non_empty());
  sub->add_flag("--update-after-step", o->update_after_step,
                "apply each step's optimizer update after the step on one thread, while the devices wait (default: "
                "each stage's share on its device during the next step, before the stage's first action, in time "
                "the device would wait for its input; the same update to the bit)");
  sub->add_flag("--per-device-files,--per-stage-files", o->per_device_files,
                "under mpirun or torchrun, --save and --resume use one file per device (its stages), "
                "FILE.stage<j>-of-<K>, for checkpoint files above the 2 GiB one MPI gather carries (or too large for rank 0's memory) (resume with the same K); "
                "--per-stage-files is its old name");
  sub->add_option("--trace", o->trace,
                  "write the last training step's timeline: an SVG chart if FILE ends in .svg (any case), otherwise "
                  "Chrome-trace JSON (open it in Perfetto)")->check(non_empty());
  sub->add_option("--samples", o->samples,
                  "--model unet: write FILE.png, the first 8 test images noisy, denoised and clean, one row each "
                  "(the noise, of standard deviation 0.3 in pixel values, is drawn once from --seed)")->check(non_empty());
  sub->add_option("--generate", o->generate,
                  "--model gpt: after training (or with --resume FILE --epochs 0), print this many bytes sampled "
                  "from the model, continuing --prompt as a new fortune; bytes other than printable ASCII, "
                  "newline and tab are shown as \\xNN; where standard output is not a terminal, progress every 2 s "
                  "on standard error")
      ->check(at_least(0));
  sub->add_option("--prompt", o->prompt, "--generate: the text the sample continues (default: none)");
  sub->add_option("--temperature", o->temperature,
                  "--generate: the scores are divided by this before sampling (lower: more likely bytes; seeded "
                  "by --seed)")
      ->check(positive_number())->capture_default_str();
  sub->add_flag("--json", o->json, "print the summary as JSON on standard output (progress stays on standard error)");
  sub->callback([o, sub, &status] {
    // A closed standard output (gpipe train ... | head) stops the printing, not the training; SIGINT
    // and SIGTERM end the run, no half-written file left (with --save, train_run.cc stops it saved).
    std::signal(SIGPIPE, SIG_IGN);
    install_signal_handlers(OnSignal::kEndNow);
    o->devices_given = sub->count("--stages") > 0;
    o->micro_batches_given = sub->count("--micro-batches") > 0;
    o->schedule_given = sub->count("--schedule") > 0;
    o->data_dir_given = sub->count("--data-dir") > 0;
    o->batch_size_given = sub->count("--batch-size") > 0;
    o->epochs_given = sub->count("--epochs") > 0;
    o->lr_given = sub->count("--lr") > 0;
    o->prompt_given = sub->count("--prompt") > 0;
    o->temperature_given = sub->count("--temperature") > 0;
    o->loss_given = sub->count("--loss") > 0;
    o->lr_schedule_given = sub->count("--lr-schedule") > 0;
    o->weight_decay_given = sub->count("--weight-decay") > 0;
    o->betas_given = sub->count("--betas") > 0;
    o->step_settings_given = sub->count("--lr-step-size") + sub->count("--lr-gamma") > 0;
    status = run_train(*o);
  });
}

}  // namespace gpipe::cli
