// loss_scale.cc: the loss scale for Python (gpipe.LossScaler, loss_scale.h): GPipe.train_step scales
// each micro-batch's loss by it, unscales the gradients, and skips a step whose gradients are not all
// finite on every stage and rank; its state_dict goes in the user's checkpoint, as GradScaler's does.
#include <gpipe/gpipe.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace gpipe::python {

void add_loss_scale(py::module_& m) {
  py::class_<LossScaler>(m, "LossScaler")
      .def(py::init([](double init_scale, double growth_factor, double backoff_factor, int64_t growth_interval) {
             return LossScaler(LossScaleOptions()
                                   .init_scale(init_scale)
                                   .growth_factor(growth_factor)
                                   .backoff_factor(backoff_factor)
                                   .growth_interval(growth_interval));
           }),
           py::arg("init_scale") = 65536.0, py::arg("growth_factor") = 2.0, py::arg("backoff_factor") = 0.5,
           py::arg("growth_interval") = 2000)
      .def_property_readonly("scale", &LossScaler::scale)
      .def_property_readonly("growth_tracker", [](const LossScaler& s) { return s.state().growth_tracker; })
      .def_property_readonly("skipped", [](const LossScaler& s) { return s.state().skipped; })
      .def("update", &LossScaler::update, py::arg("finite"))
      .def("state_dict",
           [](const LossScaler& s) {
             py::dict out;
             out["scale"] = s.scale();
             out["growth_tracker"] = s.state().growth_tracker;
             out["skipped"] = s.state().skipped;
             return out;
           })
      .def("load_state_dict",
           [](LossScaler& s, const py::dict& state) {
             for (const char* key : {"scale", "growth_tracker", "skipped"})
               if (!state.contains(key))
                 throw std::invalid_argument(std::string("gpipe: the loss scale's state has no ") + key +
                                             "; give a dict that GPipe.loss_scaler.state_dict() returned");
             s.set_state({state["scale"].cast<double>(), state["growth_tracker"].cast<int64_t>(),
                          state["skipped"].cast<int64_t>()});
           },
           py::arg("state"));
}

}  // namespace gpipe::python
