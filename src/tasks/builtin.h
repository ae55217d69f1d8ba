// builtin.h: what the built-in tasks (one file each in src/tasks/, listed by registry.cc) share.
#pragma once

#include "gpipe/check.h"
#include "gpipe/tasks.h"

#include <exception>
#include <stdexcept>
#include <string>

namespace gpipe::tasks {

/// Fashion-MNIST from options.data_dir (or Debian's folder), the first train_samples and
/// test_samples of each split, with int64 class targets (fashion.cc).
TaskData fashion_data(const TaskOptions& options);

/// A batch of `rows` random Fashion-MNIST-shaped images [rows, 1, 28, 28] and random classes of 10,
/// drawn from `seed` (fashion.cc).
Dataset random_images(int64_t rows, uint64_t seed);

/// Task::batch of benchmark workload `name` (make_workload's input and target, workloads.cc).
std::function<Dataset(const TaskOptions&)> workload_batch(const std::string& name);

/// The seeded model of `build`: every layer range draws its weights as the whole model does, so a
/// rank's layers equal one process's (fashion.cc).
Model seeded_model(const std::string& title, int layers, uint64_t seed,
                   std::function<torch::nn::Sequential(LayerRange)> build);

/// The scorings the built-in tasks share (scoring.cc), each a Task::scoring, beside the accuracy's
/// (tasks.h): the PSNR of denoised images, beside the noisy input's (TaskData::noisy_psnr_db); bits
/// per byte of text, beside a bigram model's and gzip -9's; the loss itself.
Scoring psnr_scoring();
Scoring bits_per_byte_scoring();
Scoring loss_scoring();

/// fn()'s result; any exception it throws said as a std::invalid_argument after `context` (the
/// options it is about): "gpipe: `devices` 3: ...".
template <typename Fn>
auto said_about(const std::string& context, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    throw std::invalid_argument("gpipe: " + context + ": " + without_program_name(what_of(e)));
  }
}

}  // namespace gpipe::tasks
