// group.h (internal): the runtime's own backend (gpipe/backend.h): this process alone.
#pragma once

#include "gpipe/backend.h"

#include <memory>

namespace gpipe::detail {

/// This process alone, a thread per device, the in-process transport.
std::unique_ptr<Backend> local_group();
/// The same with a plan made by make_plan for the pipeline's options, used as it is (route_skips).
std::unique_ptr<Backend> local_group(const PipelinePlan& plan);

}  // namespace gpipe::detail
