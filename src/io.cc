// io.cc: whole-or-nothing file writes (a temporary file, then a rename).
#include "gpipe/io.h"

#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace gpipe {

void write_file_atomically(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    out << contents;
    out.close();
    if (!out) {
      std::remove(tmp.c_str());
      throw std::runtime_error("gpipe: cannot write " + tmp);
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::runtime_error("gpipe: cannot move " + tmp + " to " + path);
  }
}

}  // namespace gpipe
