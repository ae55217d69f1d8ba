// skip_connections.h: a model's skip connections as plain data, for the plan to route between
// stages: which layer stashes a tensor under a name and which later layer pops it. The layers that
// do it, Stash and Pop, and finding them in a model (skip_uses, skip_connections) are in skip.h.
#pragma once

#include <string>
#include <vector>

namespace gpipe {

/// One skip connection of a model: the layers of the model that stash and pop it.
struct SkipConnection {
  std::string name;
  int stash_layer = 0;
  int pop_layer = 0;
};

/// A Stash or Pop of a model, and the layer that holds it.
struct SkipUse {
  std::string name;
  bool pop = false;
  int layer = 0;
};

/// Connects the stashes and pops of a model into its skip connections, in the
/// order of their stashes. Throws std::invalid_argument naming the layers and
/// the name for a pop without a stash, a name stashed (or popped) twice, a
/// stash never popped, and a pop before its stash in layer order.
std::vector<SkipConnection> connect_skips(const std::vector<SkipUse>& uses);

}  // namespace gpipe
