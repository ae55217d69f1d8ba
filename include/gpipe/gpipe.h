// gpipe.h: the umbrella header: everything a user of gpipe needs.
#pragma once

#include "gpipe/check.h"
#include "gpipe/cost_model.h"
#include "gpipe/data.h"
#include "gpipe/device.h"
#include "gpipe/executor.h"
#include "gpipe/io.h"
#include "gpipe/layers.h"
#include "gpipe/memory.h"
#include "gpipe/microbatch.h"
#include "gpipe/models.h"
#include "gpipe/partition.h"
#include "gpipe/pipeline.h"
#include "gpipe/plan.h"
#include "gpipe/schedule.h"
#include "gpipe/script_model.h"
#include "gpipe/skip.h"
#include "gpipe/snapshot.h"
#include "gpipe/stage.h"
#include "gpipe/stop.h"
#include "gpipe/trace.h"
#include "gpipe/train.h"
#include "gpipe/transport.h"
#include "gpipe/workloads.h"
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
#include "gpipe/mpi.h"
#endif
