// command_line.h: a program's command line as the library reads it: one string for result files,
// the settings every rank of a job must share, the nearest of the names it could have meant.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace gpipe {

/// The command line as one string, for result files.
std::string command_line(int argc, char** argv);

/// The command line (after the program's name) as the settings every rank of a job must share
/// (check_same_settings, job.h): every word, in order, named by itself when it is a flag and by the
/// flag before it when it is a value ("--micro-batches" = "8"; "word 1" = "train").
std::vector<std::pair<std::string, std::string>> settings_of_command_line(int argc, char** argv);

/// Of `names`, the one nearest to `word` in edits (insertions, deletions, substitutions), for
/// "did you mean": "" when none is within 2 edits.
std::string nearest_name(const std::string& word, const std::vector<std::string>& names);

}  // namespace gpipe
