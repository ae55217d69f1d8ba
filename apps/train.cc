// train.cc: `gpipe train` (placeholder until the Fashion-MNIST trainer lands).
#include "commands.h"

namespace gpipe::cli {
void add_train_command(CLI::App&, const std::string&) {}
}  // namespace gpipe::cli
