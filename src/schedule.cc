// schedule.cc: schedule generators, the simulator that times and checks them, and the grid printer.
#include "gpipe/schedule.h"

#include "gpipe/check.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <ostream>
#include <sstream>
#include <stdexcept>

namespace gpipe {

std::string Action::str() const {
  return std::to_string(stage) + static_cast<char>(phase) + std::to_string(micro_batch);
}

std::ostream& operator<<(std::ostream& out, const Action& action) { return out << action.str(); }

Action Action::parse(const std::string& text) {
  // <digits><F|B><digits>
  size_t n = 0;
  while (n < text.size() && std::isdigit(static_cast<unsigned char>(text[n]))) ++n;
  const bool ok = n > 0 && n + 1 < text.size() && (text[n] == 'F' || text[n] == 'B') &&
                  std::all_of(text.begin() + static_cast<std::ptrdiff_t>(n) + 1, text.end(),
                              [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
  GPIPE_CHECK(ok, "cannot parse action \"", text,
              "\": expected <stage><F|B><micro-batch>, e.g. \"1F0\"");
  Action action;
  action.stage = std::stoi(text.substr(0, n));
  action.phase = static_cast<Phase>(text[n]);
  action.micro_batch = std::stoi(text.substr(n + 1));
  return action;
}

namespace {

void check_shape(int stages, int micro_batches) {
  GPIPE_CHECK(stages >= 1, "a schedule needs at least 1 stage (got ", stages, ")");
  GPIPE_CHECK(micro_batches >= 1, "a schedule needs at least 1 micro-batch (got ",
              micro_batches, ")");
}

// The lists, one row a stage, with `marker` after row `bad_stage`.
std::string format_lists(const Schedule& schedule, int bad_stage) {
  std::ostringstream out;
  for (size_t j = 0; j < schedule.actions.size(); ++j) {
    out << "stage " << j << " |";
    for (const Action& a : schedule.actions[j]) out << ' ' << a.str();
    if (static_cast<int>(j) == bad_stage) out << "  <-- ERROR HERE";
    out << '\n';
  }
  return out.str();
}

[[noreturn]] void fail(const Schedule& schedule, int bad_stage, const std::string& why) {
  throw std::logic_error("gpipe: invalid schedule: " + why + "\n" +
                         format_lists(schedule, bad_stage));
}

}  // namespace

Schedule fill_drain(int stages, int micro_batches) {
  check_shape(stages, micro_batches);
  Schedule schedule{stages, micro_batches, true, {}};
  schedule.actions.resize(static_cast<size_t>(stages));
  for (int j = 0; j < stages; ++j) {
    auto& row = schedule.actions[static_cast<size_t>(j)];
    for (int i = 0; i < micro_batches; ++i) row.push_back({j, Phase::kForward, i});
    for (int i = micro_batches - 1; i >= 0; --i) row.push_back({j, Phase::kBackward, i});
  }
  return schedule;
}

Schedule forward_only(int stages, int micro_batches) {
  check_shape(stages, micro_batches);
  Schedule schedule{stages, micro_batches, false, {}};
  schedule.actions.resize(static_cast<size_t>(stages));
  for (int j = 0; j < stages; ++j)
    for (int i = 0; i < micro_batches; ++i)
      schedule.actions[static_cast<size_t>(j)].push_back({j, Phase::kForward, i});
  return schedule;
}

int64_t unit_cost(const Action&) { return 1; }

SimulatedRun simulate(const Schedule& schedule,
                      const std::function<int64_t(const Action&)>& cost) {
  const size_t K = schedule.actions.size();
  // finish[{j, phase, i}]: when that action ends, once it has been placed.
  std::map<std::tuple<int, char, int>, int64_t> finish;
  auto done = [&](int j, Phase p, int i, int64_t* at) {
    auto it = finish.find({j, static_cast<char>(p), i});
    if (it == finish.end()) return false;
    *at = std::max(*at, it->second);
    return true;
  };

  SimulatedRun run;
  run.start.resize(K);
  std::vector<size_t> next(K, 0);
  std::vector<int64_t> free_at(K, 0);
  size_t remaining = 0;
  for (const auto& row : schedule.actions) remaining += row.size();

  while (remaining > 0) {
    bool progress = false;
    for (size_t j = 0; j < K; ++j) {
      const auto& row = schedule.actions[j];
      // Place as many of stage j's actions as have their inputs ready.
      while (next[j] < row.size()) {
        const Action& a = row[next[j]];
        int64_t ready = free_at[j];
        bool ok = true;
        if (a.phase == Phase::kForward) {
          if (a.stage > 0) ok = done(a.stage - 1, Phase::kForward, a.micro_batch, &ready);
        } else {
          ok = done(a.stage, Phase::kForward, a.micro_batch, &ready);
          if (ok && a.stage + 1 < static_cast<int>(K))
            ok = done(a.stage + 1, Phase::kBackward, a.micro_batch, &ready);
        }
        if (!ok) break;
        run.start[j].push_back(ready);
        free_at[j] = ready + cost(a);
        finish[{a.stage, static_cast<char>(a.phase), a.micro_batch}] = free_at[j];
        run.makespan = std::max(run.makespan, free_at[j]);
        ++next[j];
        --remaining;
        progress = true;
      }
    }
    if (!progress) {
      int stuck = 0;
      for (size_t j = 0; j < K; ++j)
        if (next[j] < schedule.actions[j].size()) { stuck = static_cast<int>(j); break; }
      fail(schedule, stuck,
           "deadlock: stage " + std::to_string(stuck) + " waits for " +
               schedule.actions[static_cast<size_t>(stuck)][next[static_cast<size_t>(stuck)]].str() +
               "'s input, which no stage can produce");
    }
  }
  return run;
}

void validate(const Schedule& schedule) {
  const int K = schedule.stages;
  const int M = schedule.micro_batches;
  if (K < 1 || M < 1) fail(schedule, -1, "stages and micro_batches must be at least 1");
  if (static_cast<int>(schedule.actions.size()) != K)
    fail(schedule, -1,
         "expected " + std::to_string(K) + " rows (one per stage), got " +
             std::to_string(schedule.actions.size()));
  for (int j = 0; j < K; ++j) {
    std::vector<int> forwards(static_cast<size_t>(M), 0), backwards(static_cast<size_t>(M), 0);
    for (const Action& a : schedule.actions[static_cast<size_t>(j)]) {
      if (a.stage != j) fail(schedule, j, a.str() + " is in the row of stage " + std::to_string(j));
      if (a.micro_batch < 0 || a.micro_batch >= M)
        fail(schedule, j, a.str() + " names a micro-batch outside 0.." + std::to_string(M - 1));
      if (a.phase == Phase::kForward) {
        ++forwards[static_cast<size_t>(a.micro_batch)];
      } else {
        if (!schedule.backward) fail(schedule, j, a.str() + " is a backward in a forward-only schedule");
        if (forwards[static_cast<size_t>(a.micro_batch)] == 0)
          fail(schedule, j, a.str() + " comes before its forward");
        ++backwards[static_cast<size_t>(a.micro_batch)];
      }
    }
    for (int i = 0; i < M; ++i) {
      const std::string f = Action{j, Phase::kForward, i}.str();
      const std::string b = Action{j, Phase::kBackward, i}.str();
      if (forwards[static_cast<size_t>(i)] != 1)
        fail(schedule, j, f + " appears " + std::to_string(forwards[static_cast<size_t>(i)]) + " times, expected once");
      if (schedule.backward && backwards[static_cast<size_t>(i)] != 1)
        fail(schedule, j, b + " appears " + std::to_string(backwards[static_cast<size_t>(i)]) + " times, expected once");
    }
  }
  simulate(schedule);  // throws on deadlock
}

std::string format_grid(const Schedule& schedule) {
  const SimulatedRun run = simulate(schedule);
  size_t width = 1;
  for (const auto& row : schedule.actions)
    for (const Action& a : row) width = std::max(width, a.str().size());

  std::ostringstream out;
  for (size_t j = 0; j < schedule.actions.size(); ++j) {
    std::vector<std::string> cells(static_cast<size_t>(run.makespan), "");
    for (size_t n = 0; n < schedule.actions[j].size(); ++n)
      cells[static_cast<size_t>(run.start[j][n])] = schedule.actions[j][n].str();
    out << "stage " << j << " |";
    for (const std::string& cell : cells) {
      const std::string text = cell.empty() ? "." : cell;
      const size_t pad = width - text.size();
      out << ' ' << std::string(pad - pad / 2, ' ') << text << std::string(pad / 2, ' ');
    }
    out << '\n';
  }
  return out.str();
}

double ideal_speedup(int stages, int micro_batches) {
  return static_cast<double>(stages) * micro_batches / (micro_batches + stages - 1);
}

double ideal_bubble(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / (micro_batches + stages - 1);
}

}  // namespace gpipe
