// io.h: writing files whole or not at all.
#pragma once

#include <string>

namespace gpipe {

/// Writes `contents` to `path` whole or not at all: into a new temporary file
/// beside it, synced to disk, then renamed over `path`, so a reader (or a run
/// killed midway) never sees a partial file. A symbolic link is followed and
/// its target written; a path that is a device or a pipe (/dev/null, a FIFO)
/// is written directly, as there is no file to replace; an existing file keeps
/// its permissions. Throws std::runtime_error naming the path and the system's
/// reason ("No such file or directory", "Permission denied", "No space left on
/// device") if it cannot, leaving no temporary file and the old file as it was.
void write_file_atomically(const std::string& path, const std::string& contents);

/// Throws std::runtime_error with the system's reason unless a file can be
/// written at `path` by write_file_atomically (its folder exists and takes new
/// files, or it is a writable device or pipe); creates nothing. For checking
/// output paths before long work.
void check_writable(const std::string& path);

/// The bytes of the file at `path`; throws std::runtime_error naming a
/// missing or unreadable file, or a folder.
std::string read_file(const std::string& path);

}  // namespace gpipe
