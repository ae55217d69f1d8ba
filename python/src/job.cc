// job.cc: what a run reports (RunFigures), the job's processes (abort, leave, a torch.distributed
// process group), the names of schedules, checkpoints and runtimes, and the BLAS kernel, for Python.
#include <gpipe/gpipe.h>
#if defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D
#include <gpipe/c10d_backend.h>
#endif

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "gil.h"

#include <string>
#include <vector>

namespace py = pybind11;

namespace gpipe::python {

// What a run reports, the job's processes, the schedules', checkpoints' and runtimes' names, and the
// BLAS kernel.
void add_job(py::module_& m) {
  using namespace gpipe;
  py::class_<RunFigures>(m, "RunFigures")
      .def(py::init<>())
      .def_readwrite("train_seconds", &RunFigures::train_seconds)
      .def_readwrite("steps", &RunFigures::steps)
      .def_readwrite("samples_per_s", &RunFigures::samples_per_s)
      .def_readwrite("bubble", &RunFigures::bubble)
      .def_readwrite("balance", &RunFigures::balance)
      .def_readwrite("placement", &RunFigures::placement)
      .def_readwrite("devices", &RunFigures::devices)
      .def_readwrite("median_step_s", &RunFigures::median_step_s)
      .def_readwrite("loss_scale", &RunFigures::loss_scale)
      .def_readwrite("skipped_steps", &RunFigures::skipped_steps);
  m.def("format_run_figures", &format_run_figures, py::arg("figures"));
  // An uncaught exception on one rank of a job of several processes (MPI, c10d) ends the job (the others
  // would wait for it).
  m.def("abort_job", [](int status) { abort_processes(status); }, py::arg("status"));
  // At the script's end (atexit): the other ranks of a job of several processes, still in a call or
  // making one, stop with an error naming this rank instead of waiting for it (leave_processes).
  m.def("leave_job", [] { leave_processes(); });
  // process_group=: the c10d backend over a torch.distributed process group's store (pipe.py finds it).
  m.def("use_process_group", [](const py::object& store, int rank, int size, const std::string& scope,
                                 const std::vector<int>& known_as, bool let_go) {
#if defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D
    const auto given = store.cast<c10::intrusive_ptr<::c10d::Store>>();
    const GilReleased free;  // the ranks' vote on a new group waits for them all; Ctrl-C stops it
    gpipe::c10d::start_over(given, rank, size, scope, known_as, let_go, throw_if_interrupted);
#else
    (void)store, (void)rank, (void)size, (void)scope, (void)known_as, (void)let_go;
    throw std::invalid_argument("this gpipe was built without the c10d backend, which process_group needs; install "
                                "libgloo-dev and rebuild with it (cmake -DGPIPE_C10D=ON)");
#endif
  }, py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("scope"), py::arg("known_as"), py::arg("let_go"));
  m.def("schedule_names", &schedule_names);
  m.def("schedule_help", &schedule_help);
  m.def("virtual_stages_help", &virtual_stages_help);
  m.def("checkpoint_names", &checkpoint_names);
  // The BLAS kernel (blas.h): what gpipe.blas_kernel() shows and the warning at import.
  py::class_<BlasKernel>(m, "BlasKernel")
      .def_readonly("running", &BlasKernel::running)
      .def_readonly("best", &BlasKernel::best)
      .def_readonly("coretype", &BlasKernel::coretype)
      .def_readonly("vector_isa", &BlasKernel::vector_isa)
      .def_readonly("chosen_by", &BlasKernel::chosen_by)
      .def_property_readonly("generic", &BlasKernel::generic)
      .def_property_readonly("advice", &BlasKernel::advice)
      .def("__repr__", [](const BlasKernel& k) {
        return "BlasKernel(running='" + k.running + "', best='" + k.best + "', chosen_by='" + k.chosen_by + "')";
      });
  m.def("blas_kernel", &blas_kernel);
  m.def("blas_warning", &blas_warning);
  m.def("blas_gflops", &blas_gflops, py::call_guard<py::gil_scoped_release>());
  // gpipe.export's file, whole or not at all (io.h).
  m.def("write_file_atomically", [](const std::string& path, const py::bytes& contents) {
    std::string data = contents;
    py::gil_scoped_release release;
    write_file_atomically(path, data);
  });
  // runtime=: "auto", "threads", then each backend's name (backends(), built in or not).
  m.def("runtime_names", [] {
    std::vector<std::string> names = {"auto", "threads"};
    for (const BackendEntry& entry : backends()) names.push_back(entry.name);
    return names;
  });
}

}  // namespace gpipe::python
