// program.cc: a program, a schedule lowered (the sends and receives added, each forward's recompute
// flag set), and its text form, one row per device, both ways.
#include "schedule/schedule_parts.h"

#include "gpipe/check.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpipe {

Schedule lower(const Schedule& schedule, Checkpoint mode, const std::vector<SkipRoute>& skips) {
  GPIPE_CHECK(!schedule.lowered(), "the ", schedule.name, " schedule is already lowered");
  Schedule program = schedule;
  program.skips = skips;
  const int S = schedule.stages;
  for (size_t k = 0; k < skips.size(); ++k)
    GPIPE_CHECK(skips[k].from >= 0 && skips[k].from < skips[k].to && skips[k].to < S, "skip connection ", k,
                " goes from stage ", skips[k].from, " to stage ", skips[k].to,
                "; it must go forward, between two stages of 0..", S - 1);
  for (auto& row : program.actions) {
    std::vector<Action> out;
    for (size_t n = 0; n < row.size(); ++n) {
      Action a = row[n];
      auto comm = [&](ActionKind kind, Channel channel, int peer) {
        Action c = detail::compute(a.stage, kind, a.micro_batch);
        c.channel = channel;
        c.peer = peer;
        out.push_back(c);
      };
      // The skip connections this stage pops (stashed upstream) and stashes (popped downstream).
      auto skip_comm = [&](ActionKind kind, bool popped_here, bool gradient) {
        for (size_t k = 0; k < skips.size(); ++k) {
          const SkipRoute& r = skips[k];
          if ((popped_here ? r.to : r.from) == a.stage)
            comm(kind, skip_channel(static_cast<int>(k), gradient), popped_here ? r.from : r.to);
        }
      };
      if (a.kind == ActionKind::kForward) {
        if (schedule.backward) {
          // The next compute action of this device after the forward.
          const Action* next = n + 1 < row.size() ? &row[n + 1] : nullptr;
          const bool follows = next != nullptr && next->is_backward() && next->stage == a.stage &&
                               next->micro_batch == a.micro_batch;
          a.recompute = mode == Checkpoint::kAlways || (mode == Checkpoint::kExceptLast && !follows);
        }
        if (a.stage > 0) comm(ActionKind::kRecv, Channel::kActivation, a.stage - 1);
        skip_comm(ActionKind::kRecv, /*popped_here=*/true, /*gradient=*/false);
        out.push_back(a);
        if (a.stage < S - 1) comm(ActionKind::kSend, Channel::kActivation, a.stage + 1);
        skip_comm(ActionKind::kSend, /*popped_here=*/false, /*gradient=*/false);
      } else if (a.is_backward()) {
        if (a.stage < S - 1) comm(ActionKind::kRecv, Channel::kGradient, a.stage + 1);
        skip_comm(ActionKind::kRecv, /*popped_here=*/false, /*gradient=*/true);
        out.push_back(a);
        if (a.stage > 0) comm(ActionKind::kSend, Channel::kGradient, a.stage - 1);
        skip_comm(ActionKind::kSend, /*popped_here=*/true, /*gradient=*/true);
      } else {
        out.push_back(a);
      }
    }
    row = std::move(out);
  }
  return program;
}

namespace detail {

std::string format_lists(const Schedule& schedule, int bad_device) {
  std::ostringstream out;
  for (size_t d = 0; d < schedule.actions.size(); ++d) {
    out << "device " << d << " |";
    for (const Action& a : schedule.actions[d]) out << ' ' << a.str();
    if (static_cast<int>(d) == bad_device) out << "  <-- ERROR HERE";
    out << '\n';
  }
  return out.str();
}

}  // namespace detail

std::string format_program(const Schedule& program) { return detail::format_lists(program, -1); }

Schedule parse_program(const std::string& text, const std::string& name) {
  // The rows first (a row of device 0 begins the program again: gpipe schedule --program prints its
  // grid, whose idle slots are no actions, before it), then their actions.
  struct Row {
    int line;
    std::string actions;
  };
  std::vector<Row> rows;
  std::istringstream in(text);
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    const size_t bar = line.find('|'), first = line.find_first_not_of(" \t\r");
    if (bar == std::string::npos || line[first] == '#') continue;
    std::istringstream head(line.substr(0, bar));
    std::string word, rest;
    int device = -1;
    GPIPE_CHECK((head >> word) && word == "device" && (head >> device) && !(head >> rest), "line ", number,
                " of the program is not a row \"device D | actions\": \"", line.substr(0, bar),
                "|\"; give one row per device, as the program the gpipe schedule command prints");
    if (device == 0) rows.clear();
    GPIPE_CHECK(device == static_cast<int>(rows.size()), "line ", number, " of the program is the row of device ",
                device, " where the row of device ", rows.size(), " comes; give one row per device, in order from device 0");
    rows.push_back({number, line.substr(bar + 1)});
  }
  GPIPE_CHECK(!rows.empty(), "the program has no rows; give one line \"device D | actions\" per device, as the "
              "program the gpipe schedule command prints");

  Schedule program;
  program.name = name;
  program.devices = static_cast<int>(rows.size());
  size_t count = 0;
  for (const Row& row : rows) {
    std::vector<Action> actions;
    std::istringstream words(row.actions);
    for (std::string word; words >> word;) {
      try {
        actions.push_back(Action::parse(word));
      } catch (const std::invalid_argument& e) {
        GPIPE_CHECK(false, "line ", row.line, " of the program: ", without_program_name(e.what()),
                    word == "." ? " (an idle slot of the grid the gpipe schedule command prints: give the program it prints)"
                                : "");
      }
      program.stages = std::max(program.stages, actions.back().stage + 1);
      program.micro_batches = std::max(program.micro_batches, actions.back().micro_batch + 1);
    }
    count += actions.size();
    program.actions.push_back(std::move(actions));
  }
  // Every stage has at least its forwards, so a stage beyond the actions' count is a typo (and not a
  // placement of a billion entries).
  GPIPE_CHECK(static_cast<size_t>(program.stages) <= count, "the program names stage ", program.stages - 1,
              " but holds only ", count, " actions, too few for ", program.stages, " stages; check its stage numbers");
  program.placement.assign(static_cast<size_t>(program.stages), -1);
  for (int d = 0; d < program.devices; ++d)
    for (const Action& a : program.actions[static_cast<size_t>(d)]) {
      int& placed = program.placement[static_cast<size_t>(a.stage)];
      GPIPE_CHECK(placed < 0 || placed == d, "line ", rows[static_cast<size_t>(d)].line, " of the program: ", a.str(),
                  " is in the row of device ", d, ", but stage ", a.stage, " is in the row of device ", placed,
                  " (line ", rows[static_cast<size_t>(std::max(placed, 0))].line,
                  "); a stage runs on one device: keep its actions in one row");
      placed = d;
    }
  for (int s = 0; s < program.stages; ++s)
    GPIPE_CHECK(program.placement[static_cast<size_t>(s)] >= 0, "the program names stages up to ", program.stages - 1,
                " but no action of stage ", s, "; every stage needs its forwards and backwards");
  return program;
}

}  // namespace gpipe
