// skip_connections.cc: connecting a model's stashes and pops into its skip connections, by name.
#include "gpipe/skip_connections.h"

#include "gpipe/check.h"

#include <algorithm>
#include <map>

namespace gpipe {
namespace {

std::string in_quotes(const std::string& name) { return "\"" + name + "\""; }

}  // namespace

std::vector<SkipConnection> connect_skips(const std::vector<SkipUse>& uses) {
  std::map<std::string, const SkipUse*> stashes, pops;
  std::vector<SkipConnection> out;
  for (const SkipUse& use : uses) {
    auto& seen = use.pop ? pops : stashes;
    const auto [it, fresh] = seen.emplace(use.name, &use);
    GPIPE_CHECK(fresh, "the name ", in_quotes(use.name), " is ", use.pop ? "popped" : "stashed", " twice, by layers ",
                it->second->layer, " and ", use.layer, "; give each skip connection its own name");
  }
  for (const auto& [name, stash] : stashes) {
    auto pop = pops.find(name);
    GPIPE_CHECK(pop != pops.end(), "Stash(", in_quotes(name), ") at layer ", stash->layer,
                " is never popped; add a Pop(", in_quotes(name), ") to a later layer, or remove the Stash");
    GPIPE_CHECK(pop->second->layer >= stash->layer, "Pop(", in_quotes(name), ") at layer ", pop->second->layer,
                " comes before its Stash(", in_quotes(name), ") at layer ", stash->layer,
                "; a skip connection goes forward: pop after the stash");
    out.push_back({name, stash->layer, pop->second->layer});
  }
  for (const auto& [name, pop] : pops)
    GPIPE_CHECK(stashes.count(name) > 0, "Pop(", in_quotes(name), ") at layer ", pop->layer, " has no Stash(",
                in_quotes(name), ") before it; stash the tensor under that name in an earlier layer");
  std::sort(out.begin(), out.end(), [](const SkipConnection& a, const SkipConnection& b) {
    return a.stash_layer != b.stash_layer ? a.stash_layer < b.stash_layer : a.name < b.name;
  });
  return out;
}

}  // namespace gpipe
