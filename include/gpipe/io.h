// io.h: writing files whole or not at all.
#pragma once

#include <string>

namespace gpipe {

/// Writes `contents` to `path` whole or not at all: to `path`.tmp first, then
/// renamed over `path`, so a reader never sees a partial file. Throws
/// std::runtime_error naming the path if it cannot, leaving no temporary file.
void write_file_atomically(const std::string& path, const std::string& contents);

}  // namespace gpipe
