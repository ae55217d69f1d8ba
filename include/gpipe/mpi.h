// mpi.h: GPipe across processes: one device per MPI rank (one stage, or V with the interleaved
// schedule), on one machine or many, times D data-parallel pipeline replicas. The step driver, the
// executors and the program are those of a one-process Pipeline; the transport and the sums over
// ranks (src/transport/mpi/, declared in mpi_backend.h) differ.
//
//   world rank r = replica · K + device        (K devices, D replicas, np = K·D)
//
//        replica 0:  rank 0 ──▶ rank 1 ──▶ … ──▶ rank K-1     pipeline communicator
//        replica 1:  rank K ──▶ rank K+1 ─▶ … ──▶ rank 2K-1
//                      │          │                 │
//                      └── replica communicators (one per device): gradients summed across replicas
//
// Available when gpipe is built with GPIPE_MPI (the CMake option, on when
// MPI is found); the macro GPIPE_HAS_MPI is then 1.
#pragma once

#include "gpipe/mpi_backend.h"
#include "gpipe/pipeline.h"

#include <mpi.h>

#include <torch/nn/modules/container/sequential.h>

#include <utility>

namespace gpipe::mpi {

/// A pipeline whose devices are the ranks of an MPI job: a Pipeline over MPI's
/// backend (make_backend), kept for programs that name it; make_pipeline
/// builds the same pipeline without naming MPI. This rank runs one
/// device of one replica (placement()) with the stages the plan puts there.
/// Every rank builds only its device's layers (device_layers), with the same
/// initial values as the whole model in one process. It is a Pipeline: the
/// same step driver, plan and programs; what differs is the transport and the
/// sums over ranks.
///
/// The constructor is collective: every rank checks that all ranks agree on
/// the layer count, K, V, M, the checkpoint mode, the schedule, the balance and
/// the dtype, and each throws the same std::invalid_argument if not.
///
/// Every call is collective too: call it on every rank, in the same order,
/// with the same whole mini-batch (a rank reads only what its stages need:
/// the first device the input, the last the target; replica r its share r of
/// the rows). After a step each stage's gradients are summed over the
/// replicas, and a tied weight's over its copies.
///
/// Errors: bad input throws std::invalid_argument on every rank before any
/// work, whichever rank found it. A stage that throws makes its rank throw
/// StageError and every other rank RemoteError with that message; the
/// gradients are then as before the step. The pipeline can go on: the next
/// call (on every rank, as always) starts on fresh communicators, leaving the
/// failed step's messages behind, so the step can be retried.
class MpiPipeline : public Pipeline {
 public:
  /// `layers`: this rank's device's layers, in stage order (device_layers);
  /// `options` must give the balance of the whole model. `comm`: the ranks of
  /// the job (np = K·D); gpipe duplicates it, so its messages never meet the caller's.
  MpiPipeline(torch::nn::Sequential layers, PipelineOptions options, MPI_Comm comm = MPI_COMM_WORLD)
      : Pipeline(make_backend(comm), std::move(layers), std::move(options)) {}
  /// The same with the plan make_plan made for `options` (every rank's alike): the plan is used as it
  /// is, its skip connections routed once they are gathered from every rank (route_skips).
  MpiPipeline(torch::nn::Sequential layers, const PipelinePlan& plan, PipelineOptions options,
              MPI_Comm comm = MPI_COMM_WORLD)
      : Pipeline(make_backend(comm, &plan), std::move(layers), std::move(options)) {}

  const Placement& placement() const { return placement_of(backend()); }
};

}  // namespace gpipe::mpi
