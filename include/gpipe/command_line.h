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
/// (check_same_settings, job.h): each flag with its values ("--micro-batches" = "8", the same for
/// --micro-batches=8; a flag alone = ""), the words before any flag by place ("word 1" = "train"),
/// sorted by name, so that the order in which flags are given does not matter.
std::vector<std::pair<std::string, std::string>> settings_of_command_line(int argc, char** argv);

/// Of `names`, the one nearest to `word` in edits (insertions, deletions, substitutions), for
/// "did you mean": "" when none is within 2 edits.
std::string nearest_name(const std::string& word, const std::vector<std::string>& names);

}  // namespace gpipe
