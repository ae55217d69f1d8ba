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
///
/// A file-size limit (`ulimit -f`) below the file's size is such an error too
/// ("File too large"): SIGXFSZ is blocked on the writing thread meanwhile.
///
/// The temporary file is named PATH.tmp.<pid>.XXXXXX. While it is written,
/// remove_partial_files() (from a signal handler) deletes it; and each write
/// first deletes the PATH.tmp.* files that a process that no longer runs left
/// behind (one killed with SIGKILL midway, which no handler sees), as does
/// a resume from PATH (Trainer).
void write_file_atomically(const std::string& path, const std::string& contents);

/// Deletes the temporary files that write_file_atomically is writing now, in
/// any thread. Async-signal-safe: for a signal handler that then ends the
/// process (_exit), so that no PATH.tmp.* file outlives it.
void remove_partial_files();

/// Whether a process with this id runs on this machine (in this PID namespace): not one that
/// ended, nor a zombie whose parent has not yet reaped it.
bool process_runs(long pid);

/// Deletes the PATH.tmp.* files beside `path` that write_file_atomically left
/// in a process that no longer runs (or in this one). Errors are ignored.
void remove_stale_temporaries(const std::string& path);

/// Throws std::runtime_error with the system's reason unless a file can be
/// written at `path` by write_file_atomically (its folder exists and takes new
/// files, or it is a writable device or pipe). Creates the temporary file a
/// write would and removes it again; leaves `path` itself alone. For checking
/// output paths before long work.
void check_writable(const std::string& path);

/// Throws std::runtime_error unless `path` is a regular file (or a link to
/// one): the message says what it is instead ("a folder", "a FIFO (a named
/// pipe)", "a character device", a link that leads nowhere) or "no such file".
void check_input_file(const std::string& path);

/// The bytes of the file at `path`; throws std::runtime_error naming a
/// missing or unreadable file, or one that is not a regular file (check_input_file).
std::string read_file(const std::string& path);

/// Whether `path` ends in `extension` (".svg", ".png", ".json"), in any case: "x.SVG" and
/// "x.Svg" end in ".svg". What decides a file's format from its name.
bool has_extension(const std::string& path, const std::string& extension);

}  // namespace gpipe
