// tied.cc: a weight tied across ranks (an input embedding and an output projection, say): each rank
// that holds one keeps a copy; the copies start equal and their gradients are summed before the update.
#include "transport/mpi/group.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <climits>
#include <sstream>

namespace gpipe::mpi::detail {

void MpiGroup::find_tied_copies(const torch::nn::Sequential& layers, const PipelineOptions& options) {
  const auto named = layers->named_parameters();
  // What each rank holds of each group, a line "group name numel dtype" per copy; every rank
  // judges the same lines alike, so all throw the same error or none does.
  std::string mine;
  const auto& groups = options.tied_parameters();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const std::string& name : groups[g])
      if (named.contains(name)) {
        std::ostringstream line;
        line << g << " " << name << " " << named[name].sizes() << " " << c10::toString(named[name].scalar_type());
        mine += line.str() + "\n";
      }
  const auto held = first_ranks_lines(control_.get(), mine, placement_.devices);
  for (size_t g = 0; g < groups.size(); ++g) {
    std::string shape;  // "[sizes] dtype" of the group's first copy
    for (const std::string& name : groups[g]) {
      const std::string key = std::to_string(g) + " " + name + " ";
      std::string found;
      for (const auto& lines : held)
        for (const std::string& line : lines)
          if (found.empty() && line.rfind(key, 0) == 0) found = line.substr(key.size());
      GPIPE_CHECK(!found.empty(), "tied_parameters: no rank holds a parameter ", name, "; name parameters as in the "
                  "whole model (the layer's index in it, then the parameter's name, e.g. 0.weight)");
      if (shape.empty()) shape = found;
      GPIPE_CHECK(found == shape, "tied parameters ", groups[g].front(), " and ", name, " differ: ", shape, " against ",
                  found, "; tie parameters of one shape and dtype");
      GPIPE_CHECK(found.find(" Float") != std::string::npos || found.find(" Double") != std::string::npos,
                  "tied parameter ", name, " is ", found, "; tied parameters are float32 or float64");
    }
    Tie tie;
    for (const std::string& name : groups[g]) {
      if (!named.contains(name)) continue;
      const torch::Tensor& p = named[name];
      bool seen = false;
      for (const auto& c : tie.copies) seen = seen || c.is_same(p);
      if (!seen) tie.copies.push_back(p);
    }
    // Sums over the whole model count the group once: the first copy of the lowest device holding one.
    int owner = -1;
    for (int d = 0; d < placement_.devices && owner < 0; ++d)
      for (const std::string& line : held[static_cast<size_t>(d)])
        if (line.rfind(std::to_string(g) + " ", 0) == 0) owner = d;
    for (size_t c = 0; c < tie.copies.size(); ++c)
      if (placement_.device != owner || c > 0) uncounted_.insert(tie.copies[c].unsafeGetTensorImpl());
    ties_.push_back(std::move(tie));
  }
}

void MpiGroup::share_tied_values() {
  // Every copy of a tied weight starts as the lowest device's.
  for (Tie& tie : ties_) {
    if (tie.copies.empty()) continue;
    torch::NoGradGuard no_grad;
    torch::Tensor first = tie.copies.front().detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
    GPIPE_CHECK(first.numel() * first.element_size() <= INT_MAX, "a tied parameter has ",
                first.numel() * first.element_size(), " bytes, more than one MPI broadcast carries");
    check_mpi(MPI_Bcast(first.data_ptr(), static_cast<int>(first.numel() * first.element_size()), MPI_BYTE, 0,
                        tie.comm.get()),
              "MPI_Bcast");
    for (torch::Tensor& copy : tie.copies) copy.copy_(first);
  }
}

void MpiGroup::sum_tied_gradients() {
  torch::NoGradGuard no_grad;
  for (Tie& tie : ties_) {
    if (tie.copies.empty()) continue;
    torch::Tensor sum;
    for (const torch::Tensor& p : tie.copies) {
      const torch::Tensor g = p.grad().defined() ? p.grad() : torch::zeros_like(p);
      sum = sum.defined() ? sum + g : g.clone();
    }
    auto kept = std::make_shared<torch::Tensor>(sum.to(torch::kCPU).contiguous());
    const torch::Tensor total = *kept;
    allreduce_sum(*errors_, tie.comm.get(), kept, "a tied parameter");
    for (torch::Tensor p : tie.copies) p.mutable_grad() = total.to(p.device(), /*non_blocking=*/false, /*copy=*/true);
  }
}

bool MpiGroup::counts(const torch::Tensor& parameter) const {
  return uncounted_.count(parameter.unsafeGetTensorImpl()) == 0;
}

}  // namespace gpipe::mpi::detail
