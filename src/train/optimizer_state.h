// optimizer_state.h: how libtorch keys an optimizer's state of a parameter (snapshots read and write
// it, StageUpdates moves it between optimizers).
#pragma once

#include <torch/optim/optimizer.h>

#include <sstream>
#include <string>
#include <type_traits>

namespace gpipe::detail {

/// The key of `p` in an optimizer's state(): a string of the TensorImpl's address in libtorch 1.13,
/// the address itself in 2.x.
template <typename States>
auto state_key(const States&, const torch::Tensor& p) {
  using Key = typename States::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream out;
    out << p.unsafeGetTensorImpl();
    return out.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

}  // namespace gpipe::detail
