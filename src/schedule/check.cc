// check.cc: the structural checks of a schedule or a program (validate() runs them, then a simulation
// for deadlocks): its shape and placement, each action's stage, micro-batch and route, the order of
// each (stage, micro-batch)'s actions, and sends and receives in pairs. The first failure throws.
#include "schedule/schedule_parts.h"

#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

namespace gpipe {
namespace detail {

[[noreturn]] void fail(const Schedule& schedule, int bad_device, const std::string& why) {
  throw std::invalid_argument("gpipe: invalid " + (schedule.name.empty() ? std::string() : schedule.name + " ") +
                              "schedule: " + why + "\n" + format_lists(schedule, bad_device));
}

CommKey comm_key(const Action& a) {
  const bool send = a.kind == ActionKind::kSend;
  return {send ? a.stage : a.peer, send ? a.peer : a.stage, static_cast<int>(a.channel), a.micro_batch};
}

namespace {

// Per (stage, micro-batch): how many F, B, I, W, in order of appearance on its device.
using ComputeCounts = std::map<std::pair<int, int>, std::map<char, int>>;
// (stage, channel, micro-batch) a device has taken in, so far in its row.
using Received = std::set<std::tuple<int, int, int>>;

// At least one device and micro-batch, each stage placed on one of the devices, and a row per device.
void check_placement(const Schedule& schedule) {
  const int K = schedule.devices, S = schedule.stages, M = schedule.micro_batches;
  if (K < 1 || M < 1 || S < K) fail(schedule, -1, "devices and micro-batches must be at least 1, and stages at least devices");
  if (static_cast<int>(schedule.placement.size()) != S)
    fail(schedule, -1, "the placement names " + std::to_string(schedule.placement.size()) + " stages, expected " +
                           std::to_string(S));
  for (int s = 0; s < S; ++s) {
    const int d = schedule.placement[static_cast<size_t>(s)];
    if (d < 0 || d >= K) fail(schedule, -1, "stage " + std::to_string(s) + " is placed on device " + std::to_string(d) +
                                                ", outside 0.." + std::to_string(K - 1));
  }
  if (static_cast<int>(schedule.actions.size()) != K)
    fail(schedule, -1, "expected " + std::to_string(K) + " rows (one per device), got " +
                           std::to_string(schedule.actions.size()));
}

// Action `a` of device d's row names a stage placed on d and a micro-batch of the step.
void check_action_in_row(const Schedule& schedule, int d, const Action& a) {
  const int S = schedule.stages, M = schedule.micro_batches;
  if (a.stage < 0 || a.stage >= S) fail(schedule, d, a.str() + " names a stage outside 0.." + std::to_string(S - 1));
  if (schedule.placement[static_cast<size_t>(a.stage)] != d)
    fail(schedule, d, a.str() + " is in the row of device " + std::to_string(d) + ", but stage " +
                          std::to_string(a.stage) + " is placed on device " +
                          std::to_string(schedule.placement[static_cast<size_t>(a.stage)]));
  if (a.micro_batch < 0 || a.micro_batch >= M)
    fail(schedule, d, a.str() + " names a micro-batch outside 0.." + std::to_string(M - 1));
}

// Send or receive `a` of device d moves its tensor the way it goes.
void check_route(const Schedule& schedule, int d, const Action& a) {
  const int S = schedule.stages;
  if (a.peer < 0 || a.peer >= S) fail(schedule, d, a.str() + " names a stage outside 0.." + std::to_string(S - 1));
  const int skip = skip_of(a.channel);
  if (skip < 0) {
    // Activations go to the next stage, gradients to the previous one.
    const bool towards_next = (a.kind == ActionKind::kSend) == (a.channel == Channel::kActivation);
    if (a.peer != a.stage + (towards_next ? 1 : -1))
      fail(schedule, d, a.str() + (a.channel == Channel::kActivation ? " moves an activation" : " moves a gradient") +
                            " the wrong way: activations go from stage s to s+1, gradients from s+1 to s");
    return;
  }
  // A skip connection's tensor goes from its stash to its pop, its gradient back.
  if (skip >= static_cast<int>(schedule.skips.size()))
    fail(schedule, d, a.str() + " names skip connection " + std::to_string(skip) + ", but the program has " +
                          std::to_string(schedule.skips.size()));
  const SkipRoute& r = schedule.skips[static_cast<size_t>(skip)];
  const bool towards_pop = (a.kind == ActionKind::kSend) != carries_gradient(a.channel);
  if (a.stage != (towards_pop ? r.from : r.to) || a.peer != (towards_pop ? r.to : r.from))
    fail(schedule, d, a.str() + " moves skip connection " + std::to_string(skip) + " the wrong way: it goes from "
                          "stage " + std::to_string(r.from) + " to stage " + std::to_string(r.to) +
                          ", its gradient back");
}

// Compute action `a` of device d comes, in a program (`received` given), after the receive of the
// tensor it needs from another stage; and after its forward (a W after its I), once, as B or as I
// then W. `count`: its (stage, micro-batch)'s actions before it.
void check_compute_order(const Schedule& schedule, int d, const Action& a, const Received* received,
                         std::map<char, int>& count) {
  const int S = schedule.stages;
  const bool needs_activation = a.kind == ActionKind::kForward && a.stage > 0;
  const bool needs_gradient = a.is_backward() && a.stage < S - 1;
  if (received != nullptr && (needs_activation || needs_gradient) &&
      received->count({a.stage, static_cast<int>(needs_activation ? Channel::kActivation : Channel::kGradient),
                       a.micro_batch}) == 0)
    fail(schedule, d, a.str() + " has no earlier receive of its " +
                          (needs_activation ? "input from stage " + std::to_string(a.stage - 1)
                                            : "output's gradient from stage " + std::to_string(a.stage + 1)));
  const char k = static_cast<char>(a.kind);
  if (a.kind != ActionKind::kForward && !schedule.backward)
    fail(schedule, d, a.str() + " is a backward in a forward-only schedule");
  if (a.kind != ActionKind::kForward && count['F'] == 0) fail(schedule, d, a.str() + " comes before its forward");
  if (a.kind == ActionKind::kWeightGrad && count['I'] == 0) fail(schedule, d, a.str() + " comes before its I");
  if (count[k] > 0) fail(schedule, d, a.str() + " appears twice");
  if ((a.kind == ActionKind::kBackward && (count['I'] || count['W'])) ||
      (a.kind == ActionKind::kInputGrad && count['B']))
    fail(schedule, d, a.str() + ": a micro-batch's backward is either B, or I then W, not both");
  ++count[k];
}

// Every (stage, micro-batch) has its F and, in a training schedule, its B or its I and W.
void check_complete(const Schedule& schedule, ComputeCounts& seen) {
  for (int s = 0; s < schedule.stages; ++s) {
    const int d = schedule.placement[static_cast<size_t>(s)];
    for (int i = 0; i < schedule.micro_batches; ++i) {
      auto& count = seen[{s, i}];
      const std::string name = std::to_string(s) + "F" + std::to_string(i);
      if (count['F'] != 1) fail(schedule, d, name + " is missing");
      if (schedule.backward && count['B'] == 0 && count['I'] == 0)
        fail(schedule, d, std::to_string(s) + "B" + std::to_string(i) + " (or its I and W) is missing");
      if (count['I'] == 1 && count['W'] == 0) fail(schedule, d, std::to_string(s) + "W" + std::to_string(i) + " is missing");
    }
  }
}

// Each message is sent once and received once.
void check_pairs(const Schedule& schedule, const std::map<CommKey, int>& sends, const std::map<CommKey, int>& recvs) {
  for (const auto& [key, n] : sends) {
    const auto received = recvs.find(key);
    const int times_received = received == recvs.end() ? 0 : received->second;
    if (n != 1 || times_received != 1) {
      const auto [from, to, channel, i] = key;
      Action a = compute(from, ActionKind::kSend, i);
      a.channel = static_cast<Channel>(channel);
      a.peer = to;
      fail(schedule, schedule.placement[static_cast<size_t>(from)],
           a.str() + " is sent " + std::to_string(n) + " time(s) and received " + std::to_string(times_received) +
               " time(s); each message needs exactly one of each");
    }
  }
  for (const auto& [key, n] : recvs)
    if (sends.count(key) == 0) {
      const auto [from, to, channel, i] = key;
      Action a = compute(to, ActionKind::kRecv, i);
      a.channel = static_cast<Channel>(channel);
      a.peer = from;
      fail(schedule, schedule.placement[static_cast<size_t>(to)], a.str() + " waits for a message no stage sends");
    }
}

}  // namespace

void check_structure(const Schedule& schedule) {
  check_placement(schedule);
  ComputeCounts seen;
  std::map<CommKey, int> sends, recvs;
  const bool lowered = schedule.lowered();
  for (int d = 0; d < schedule.devices; ++d) {
    Received received;
    for (const Action& a : schedule.actions[static_cast<size_t>(d)]) {
      check_action_in_row(schedule, d, a);
      if (a.is_compute()) {
        check_compute_order(schedule, d, a, lowered ? &received : nullptr, seen[{a.stage, a.micro_batch}]);
        continue;
      }
      check_route(schedule, d, a);
      ++(a.kind == ActionKind::kSend ? sends : recvs)[comm_key(a)];
      if (a.kind == ActionKind::kRecv) received.insert({a.stage, static_cast<int>(a.channel), a.micro_batch});
    }
  }
  check_complete(schedule, seen);
  check_pairs(schedule, sends, recvs);
}

}  // namespace detail
}  // namespace gpipe
