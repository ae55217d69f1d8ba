// executor.h: Executor: runs one device's program over the stages placed on that device.
//
// On a GPU each stage computes on a stream of its own (Stage::stream); the executor runs every
// action of a stage under that stream, stamps what it sends with an event recorded there, and
// makes the receiving stage's stream wait for that event, so that tensors cross stages (on one
// GPU or between GPUs) without the host waiting. A tensor from another device is copied on a copy
// stream of its own device, after its producer's event. At the end of a run the host waits
// for the stages' streams once: the step's results are then ready for the caller.
//
// The executor decides nothing: it dispatches each action of its program by
// kind, one function per kind (forward, backward or I, W, send, receive). A
// receive puts the tensor it took from the transport in the inbox of its stage;
// a compute action takes its input from there and leaves its output in the
// outbox; a send hands it to the transport. Who talks to whom was decided once,
// when the schedule was lowered (schedule.h). When an action fails, its
// StageError shows the device's program around it, the failing action marked:
//
//   gpipe: stage 1 failed in the forward of micro-batch 2 (action 1F2, input [2, 8]): ...
//   device 1's program at its action 8 of 24 (>>):
//   device 1 | ... 1F1 1SEND_F1>2 1RECV_F2<0 >> 1F2 1SEND_F2>2 1RECV_F3<0 1F3 1SEND_F3>2 ...
#pragma once

#include "gpipe/device.h"
#include "gpipe/memory.h"
#include "gpipe/schedule.h"
#include "gpipe/stage.h"
#include "gpipe/trace.h"
#include "gpipe/transport.h"

#include <map>
#include <memory>
#include <vector>

namespace gpipe {

/// The stages placed on one device, run by that device's program.
///
/// Thread: run() is called from one thread at a time (the device's
/// DeviceThread, or an MPI rank's main thread).
class Executor {
 public:
  /// `index`: the device's number in the schedule (d of K), which a failure's report names. With
  /// `memory` set, the device's CPU allocations are charged to it (see memory.h).
  /// set_transport gives it the transport before it runs.
  Executor(int index, std::vector<std::unique_ptr<Stage>> stages, Device device,
           std::shared_ptr<MemoryCounter> memory = nullptr);

  /// Runs `program` (this device's row of a lowered schedule) for `step`,
  /// appending each compute action's timespan to `trace` when given (its inputs
  /// have been received before it starts, and it ends before its output is
  /// sent, so a span is work alone). Before a stage's first action it runs
  /// step.before_stage (when set; for every stage at the start where the
  /// program starts with a receive), appending its span to `other` when given.
  /// Throws StageError for a failure in an action (its message first, then the
  /// program around the action), and Cancelled when another device failed; either
  /// way the stages drop what they kept for this step.
  void run(const std::vector<Action>& program, StepData& step, std::vector<ActionSpan>* trace,
           std::vector<WorkSpan>* other = nullptr);

  /// Where sends and receives go from now on (under MPI a new transport after
  /// a failed step).
  void set_transport(Transport* transport) { transport_ = transport; }
  /// On a GPU: what the next run's work waits for (on the device, not the host): an event
  /// recorded on the caller's stream after what it queued before the step (the optimizer's
  /// update, the inputs). Null: nothing to wait for.
  void set_start(std::shared_ptr<c10::Event> start) { start_ = std::move(start); }

  /// The device's number in the schedule.
  int index() const { return index_; }
  const Device& device() const { return device_; }
  /// The stages on this device, in increasing stage order.
  const std::vector<std::unique_ptr<Stage>>& stages() const { return stages_; }
  /// The device's memory counter, or null when memory is not tracked.
  const std::shared_ptr<MemoryCounter>& memory() const { return memory_; }

 private:
  // One run of a program: what its actions hand each other, and one function per kind (executor.cc).
  class Run;

  Stage& stage(int index);
  // The stages' streams wait for start_, and each stage begins the step on its own stream.
  void begin_step();
  // Every stage drops what it kept for the step.
  void clear_stages();
  // A message for stage `to` made usable on its stream: waited for, kept alive, or copied here.
  Tensors arrive(Tensors message, const Stage& to);
  // The copy stream on `device` (made on first use).
  const DeviceStream& copy_stream(const torch::Device& device);
  // The host waits for every stream of this device's stages and copies.
  void synchronize();

  std::vector<std::unique_ptr<Stage>> stages_;
  std::shared_ptr<c10::Event> start_;
  std::map<int, DeviceStream> copy_streams_;  // by CUDA device index
  int index_;
  Device device_;
  Transport* transport_ = nullptr;
  std::shared_ptr<MemoryCounter> memory_;
};

}  // namespace gpipe
