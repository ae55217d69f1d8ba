// replicas.cc: D pipeline replicas as one data-parallel step: each device's gradients and BatchNorm
// statistics summed over the replicas that run it.
#include "transport/mpi/group.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <climits>

namespace gpipe::mpi::detail {

void allreduce_sum(ErrorChannel& errors, MPI_Comm comm, std::shared_ptr<torch::Tensor> buffer, const char* what) {
  GPIPE_CHECK(buffer->numel() <= INT_MAX, what, " has ", buffer->numel(),
              " elements, more than one MPI allreduce carries; use more devices");
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer->data_ptr(), static_cast<int>(buffer->numel()),
                           buffer->scalar_type() == torch::kFloat ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM, comm, &request),
            "MPI_Iallreduce");
  wait_or_keep(errors, request, std::move(buffer));
}

void MpiGroup::reduce_gradients(const std::vector<torch::Tensor>& params) {
  if (placement_.replicas > 1 && !params.empty()) {
    torch::NoGradGuard no_grad;
    bool all_float = true;
    std::vector<torch::Tensor> flat;
    for (const auto& p : params) {
      all_float = all_float && p.scalar_type() == torch::kFloat;
      flat.push_back((p.grad().defined() ? p.grad() : torch::zeros_like(p)).reshape({-1}).to(torch::kCPU));
    }
    auto kept =
        std::make_shared<torch::Tensor>(torch::cat(flat).to(all_float ? torch::kFloat : torch::kDouble).contiguous());
    const torch::Tensor buffer = *kept;
    allreduce_sum(*errors_, replicas_.get(), kept, "a device's gradients");
    int64_t at = 0;
    for (torch::Tensor p : params) {
      p.mutable_grad() = buffer.narrow(0, at, p.numel()).view(p.sizes()).to(p.options(), false, /*copy=*/true);
      at += p.numel();
    }
  }
  sum_tied_gradients();
}

void MpiGroup::sum_over_replicas(const std::shared_ptr<torch::Tensor>& values) {
  if (placement_.replicas > 1) allreduce_sum(*errors_, replicas_.get(), values, "a device's BatchNorm statistics");
}

}  // namespace gpipe::mpi::detail
