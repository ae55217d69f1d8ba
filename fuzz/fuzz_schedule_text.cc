// fuzz_schedule_text: the schedule text forms: actions ("1F0r", "1SEND_F0>2", "0SEND_S1.0>2"),
// re-materialization modes and schedule names, and the whole input as a program (parse_program).
// Promises: malformed text is refused with std::invalid_argument; text that parses prints back to
// text that parses to the same action (or program).
#include "fuzz_input.h"

#include <gpipe/schedule.h>

#include <sstream>
#include <stdexcept>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using gpipe::fuzz::promise;
  const std::string text = gpipe::fuzz::as_string(data, size);
  try {
    const gpipe::Schedule p = gpipe::parse_program(text);
    const gpipe::Schedule back = gpipe::parse_program(gpipe::format_program(p));
    promise(back.actions == p.actions && back.placement == p.placement && back.micro_batches == p.micro_batches,
            "parse_program(format_program(p)) is p");
  } catch (const std::invalid_argument&) {
  }
  std::istringstream words(text);
  std::string word;
  // The first 64 words: an exception per malformed word is slow under ASan, and a word's fate
  // does not depend on the words before it.
  for (int n = 0; n < 64 && words >> word; ++n) {
    try {
      const gpipe::Action a = gpipe::Action::parse(word);
      promise(gpipe::Action::parse(a.str()) == a, "Action::parse(a.str()) == a");
    } catch (const std::invalid_argument&) {
    }
    try {
      promise(gpipe::to_string(gpipe::parse_checkpoint(word)) == word, "checkpoint names round-trip");
    } catch (const std::invalid_argument&) {
    }
    try {
      promise(gpipe::to_string(gpipe::parse_schedule(word)) == word, "schedule names round-trip");
    } catch (const std::invalid_argument&) {
    }
  }
  return 0;
}
