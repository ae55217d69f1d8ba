// digest.h: 64-bit digests of bytes, to tell whether two processes read or hold the same thing.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe {

/// A digest of a file's bytes; throws std::runtime_error when it cannot be read.
uint64_t file_digest(const std::string& path);

/// A digest of a text's bytes.
uint64_t text_digest(const std::string& text);

/// A digest of tensors' dtypes, shapes and values (undefined tensors are left out).
uint64_t tensors_digest(const std::vector<torch::Tensor>& tensors);

}  // namespace gpipe
