// backend.h (internal): MPI's entry in the backends gpipe knows (gpipe/backend.h's backends()).
#pragma once

#include "gpipe/backend.h"

namespace gpipe::mpi {

/// MPI as backends() lists it: running when MPI is initialised, not finalised, with more than one rank.
BackendEntry backend_entry();

}  // namespace gpipe::mpi
