// collectives.cc (c10d): the Links' collectives, made of their point-to-point messages (which a
// failure elsewhere stops, as Gloo's own collectives would not be): combine, broadcast, gather and
// all_gather, under tags above every tag of the transport's.
#include "transport/c10d/c10d.h"

#include <torch/torch.h>

#include <cstring>
#include <string>
#include <vector>

namespace gpipe::c10d {

namespace {

// The collectives' tags, above every tag of the transport's (kTransportTags).
constexpr int kCombineTag = kTransportTags;
constexpr int kBroadcastTag = kTransportTags + 1;
constexpr int kGatherTag = kTransportTags + 2;

}  // namespace

void Links::combine(const std::vector<int>& ranks, torch::Tensor& values, bool largest) {
  const int root = ranks.front();
  if (rank_ != root) {
    send(root, kCombineTag, values.clone());
    auto work = post_recv(root, kCombineTag, values);
    wait(work, root);
    wait_sends();
    return;
  }
  for (size_t n = 1; n < ranks.size(); ++n) {
    torch::Tensor part = torch::empty_like(values);
    auto work = post_recv(ranks[n], kCombineTag, part);
    wait(work, ranks[n]);
    if (largest)
      values.copy_(torch::maximum(values, part));
    else
      values.add_(part);
  }
  for (size_t n = 1; n < ranks.size(); ++n) send(ranks[n], kCombineTag, values);
  wait_sends();
}

void Links::broadcast(const std::vector<int>& ranks, torch::Tensor& value) {
  const int root = ranks.front();
  if (rank_ == root) {
    for (size_t n = 1; n < ranks.size(); ++n) send(ranks[n], kBroadcastTag, value);
    wait_sends();
    return;
  }
  auto work = post_recv(root, kBroadcastTag, value);
  wait(work, root);
}

std::vector<std::string> Links::gather(const std::string& bytes) {
  const int size = world().size;
  if (rank_ != 0) {
    send(0, kGatherTag, torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong));
    if (!bytes.empty()) {
      torch::Tensor data = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
      std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
      send(0, kGatherTag, data);
    }
    wait_sends();
    return {};
  }
  std::vector<std::string> out{bytes};
  for (int r = 1; r < size; ++r) {
    torch::Tensor length = torch::empty({1}, torch::kLong);
    wait(post_recv(r, kGatherTag, length), r);
    const int64_t n = length.item<int64_t>();
    std::string part(static_cast<size_t>(n), '\0');
    if (n > 0) {
      torch::Tensor data = torch::empty({n}, torch::kUInt8);
      wait(post_recv(r, kGatherTag, data), r);
      std::memcpy(part.data(), data.data_ptr(), static_cast<size_t>(n));
    }
    out.push_back(std::move(part));
  }
  return out;
}

std::vector<std::string> Links::all_gather(const std::string& bytes) {
  std::vector<std::string> all = gather(bytes);
  // Rank 0 sends every part to every other rank: their lengths, then their bytes.
  const int size = world().size;
  torch::Tensor lengths = torch::empty({size}, torch::kLong);
  if (rank_ == 0) {
    std::string joined;
    for (int r = 0; r < size; ++r) {
      lengths[r] = static_cast<int64_t>(all[static_cast<size_t>(r)].size());
      joined += all[static_cast<size_t>(r)];
    }
    torch::Tensor data = torch::empty({static_cast<int64_t>(joined.size())}, torch::kUInt8);
    if (!joined.empty()) std::memcpy(data.data_ptr(), joined.data(), joined.size());
    for (int r = 1; r < size; ++r) {
      send(r, kGatherTag, lengths);
      if (!joined.empty()) send(r, kGatherTag, data);
    }
    wait_sends();
    return all;
  }
  wait(post_recv(0, kGatherTag, lengths), 0);
  const int64_t total = lengths.sum().item<int64_t>();
  std::string joined(static_cast<size_t>(total), '\0');
  if (total > 0) {
    torch::Tensor data = torch::empty({total}, torch::kUInt8);
    wait(post_recv(0, kGatherTag, data), 0);
    std::memcpy(joined.data(), data.data_ptr(), static_cast<size_t>(total));
  }
  all.clear();
  size_t at = 0;
  for (int r = 0; r < size; ++r) {
    const auto n = static_cast<size_t>(lengths[r].item<int64_t>());
    all.push_back(joined.substr(at, n));
    at += n;
  }
  return all;
}

}  // namespace gpipe::c10d
