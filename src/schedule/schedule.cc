// schedule.cc: the schedule as data: checkpoint modes, channels, an action and its text form, and a
// schedule's placement. The generators are in generators.cc and v_schedules.cc, the table of
// schedules in table.cc, lowering and the program's text in program.cc, the checks in check.cc and
// the simulator in simulate.cc.
#include "gpipe/schedule.h"

#include "gpipe/check.h"

#include <ostream>
#include <regex>
#include <string>

namespace gpipe {

std::string to_string(Checkpoint mode) {
  switch (mode) {
    case Checkpoint::kAlways: return "always";
    case Checkpoint::kExceptLast: return "except_last";
    case Checkpoint::kNever: return "never";
  }
  return "?";
}

Checkpoint parse_checkpoint(const std::string& text) {
  for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever})
    if (text == to_string(mode)) return mode;
  GPIPE_CHECK(false, "unknown checkpoint mode \"", text, "\"; use always, except_last or never");
  return Checkpoint::kNever;
}

std::vector<std::string> checkpoint_names() {
  return {to_string(Checkpoint::kAlways), to_string(Checkpoint::kExceptLast), to_string(Checkpoint::kNever)};
}

// ---------------------------------------------------------------- actions

Channel skip_channel(int skip, bool gradient) { return static_cast<Channel>(2 + 2 * skip + (gradient ? 1 : 0)); }

int skip_of(Channel channel) {
  const int c = static_cast<int>(channel);
  return c >= 2 ? (c - 2) / 2 : -1;
}

bool carries_gradient(Channel channel) { return static_cast<int>(channel) % 2 == 1; }

std::string Action::str() const {
  const std::string s = std::to_string(stage), i = std::to_string(micro_batch);
  const int skip = skip_of(channel);
  const std::string what = skip < 0 ? (channel == Channel::kActivation ? "F" : "B")
                                    : (carries_gradient(channel) ? "G" : "S") + std::to_string(skip) + ".";
  switch (kind) {
    case ActionKind::kSend: return s + "SEND_" + what + i + ">" + std::to_string(peer);
    case ActionKind::kRecv: return s + "RECV_" + what + i + "<" + std::to_string(peer);
    default: return s + static_cast<char>(kind) + i + (recompute ? "r" : "");
  }
}

std::ostream& operator<<(std::ostream& out, const Action& action) { return out << action.str(); }

bool Action::operator==(const Action& other) const {
  return stage == other.stage && kind == other.kind && micro_batch == other.micro_batch &&
         recompute == other.recompute && (is_compute() || (channel == other.channel && peer == other.peer));
}

Action Action::parse(const std::string& text) {
  static const std::regex compute(R"((\d{1,9})([FBIW])(\d{1,9})(r?))");
  static const std::regex comm(R"((\d{1,9})(SEND|RECV)_([FB]|[SG]\d{1,6}\.)(\d{1,9})([<>])(\d{1,9}))");
  std::smatch m;
  Action a;
  if (std::regex_match(text, m, compute)) {
    a.stage = std::stoi(m[1]);
    a.kind = static_cast<ActionKind>(m[2].str()[0]);
    a.micro_batch = std::stoi(m[3]);
    a.recompute = m[4].length() > 0;
    GPIPE_CHECK(!a.recompute || a.kind == ActionKind::kForward, "cannot parse action \"", text,
                "\": only a forward carries the recompute flag r");
    return a;
  }
  if (std::regex_match(text, m, comm)) {
    a.stage = std::stoi(m[1]);
    a.kind = m[2] == "SEND" ? ActionKind::kSend : ActionKind::kRecv;
    const std::string what = m[3];
    if (what == "F" || what == "B")
      a.channel = what == "F" ? Channel::kActivation : Channel::kGradient;
    else
      a.channel = skip_channel(std::stoi(what.substr(1)), what[0] == 'G');
    a.micro_batch = std::stoi(m[4]);
    GPIPE_CHECK((m[5] == ">") == (a.kind == ActionKind::kSend), "cannot parse action \"", text,
                "\": a send is written SEND_F0>2 (to stage 2), a receive RECV_F0<1 (from stage 1)");
    a.peer = std::stoi(m[6]);
    return a;
  }
  GPIPE_CHECK(false, "cannot parse action \"", text,
              "\": expected <stage><F|B|I|W><micro-batch>[r] such as \"1F0\", or a send or receive such as "
              "\"1SEND_F0>2\" / \"2RECV_F0<1\" (a skip connection's: \"0SEND_S1.0>2\", \"2SEND_G1.0>0\")");
  return a;
}

bool Schedule::lowered() const {
  for (const auto& row : actions)
    for (const Action& a : row)
      if (!a.is_compute()) return true;
  return false;
}

std::vector<int> Schedule::stages_of(int device) const {
  std::vector<int> out;
  for (int s = 0; s < static_cast<int>(placement.size()); ++s)
    if (placement[static_cast<size_t>(s)] == device) out.push_back(s);
  return out;
}

}  // namespace gpipe
