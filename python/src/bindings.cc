// bindings.cc: the `gpipe._gpipe` extension: a TorchScript nn.Sequential from Python run by gpipe's
// pipeline, its devices C++ threads (or the ranks of a job: MPI, c10d) that take the GIL only for the work a Python
// layer gives them before a stage (GPipe.update_on_devices' torch.optim update). The Python layer
// (python/gpipe/pipe.py) checks the arguments and scripts the model; this file only translates.
#include <gpipe/gpipe.h>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/jit/api/compilation_unit.h>
#include <torch/optim/sgd.h>
#include <torch/python.h>

#include "gil.h"


#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace gpipe::python {
namespace {

// The backends whose launcher started this process (mpirun -np K python3 train.py: MPI) started for
// the rest of the process, and the one `runtime` names even without its launcher.
void start_backends_for(Runtime runtime) {
  if (runtime != Runtime::kAuto && runtime != Runtime::kThreads) backend(runtime, ", or use runtime=\"threads\"");
  start_backends(runtime);
}

// A loss: "cross_entropy", "mse", or a torch.jit.script-ed function (output, target) -> scalar.
LossFn loss_of(const py::object& loss) {
  if (py::isinstance<py::str>(loss)) {
    const std::string name = loss.cast<std::string>();
    if (name == "cross_entropy") return cross_entropy_loss;
    if (name == "mse") return mse_loss;
    GPIPE_CHECK(false, "loss must be \"cross_entropy\", \"mse\" or a torch.jit.script-ed function (got \"", name,
                "\")");
  }
  const auto function = loss.cast<torch::jit::StrongFunctionPtr>();
  return [function](const torch::Tensor& output, const torch::Tensor& target) {
    const torch::IValue value = (*function.function_)({output, target});
    GPIPE_CHECK(value.isTensor() && value.toTensor().numel() == 1,
                "the loss function must return a scalar tensor, the mean over the batch");
    return value.toTensor();
  };
}

// What the Python GPipe object asks for (its keyword arguments, checked for type there): the
// pipeline's shape as a PipelineRequest (schedule "auto" or a name; M and the checkpoint left open to
// "auto" where not given; K taken from the balance where not given), and how it runs.
struct Settings {
  PipelineRequest request = [] {
    PipelineRequest r;
    r.schedule = "auto";
    r.devices = 2;
    return r;
  }();
  bool deferred_batch_norm = true;
  int threads = 1;
  std::string runtime = "auto";
  // What "auto" predicts of the update: the optimizer timed ("sgd", "momentum", "adam"), and whether it
  // runs on the devices (GPipe.update_on_devices) or on the calling thread after the step.
  std::string optimizer = "momentum";
  bool update_on_devices = false;
  // The loop's own optimizer's update, timed in Python (seconds per parameter byte); 0: libtorch's
  // optimizer of `optimizer`'s kind, as the profile times it.
  double update_s_per_parameter_byte = 0;
  // The keyword arguments GPipe takes from the settings' table (settings.h) beyond those above:
  // set by name (Settings.set), carried to the request (with_request_settings) and the pipeline's
  // options (with_pipeline_settings).
  TrainSettings table;

  bool chosen() const { return request.schedule == "auto"; }
  int devices() const { return request.devices.value_or(0); }  // 0: the balance's length
  int virtual_stages() const { return request.virtual_stages.value_or(0); }  // 0: the schedule's own

  // The options of a pipeline made as asked (schedule "auto": fill-drain until it is chosen).
  PipelineOptions options() const {
    return with_pipeline_settings(PipelineOptions(), table)
        .precision(request.precision.value_or(Precision::kFloat32))
        .devices(devices())
        .balance(request.balance)
        .micro_batches(request.micro_batches.value_or(1))
        .checkpoint(request.checkpoint.value_or(Checkpoint::kExceptLast))
        .schedule(chosen() ? ScheduleKind::kGPipe : parse_schedule(request.schedule))
        .virtual_stages(chosen() ? 0 : virtual_stages())
        .deferred_batch_norm(deferred_batch_norm)
        .threads_per_device(threads);
  }
};

// The plan `settings` make for a model of `layers` layers: throws (ValueError) what make_plan refuses.
// With schedule "auto", K and M are checked under fill-drain, or interleaved for a V given (a given
// balance by its length when V is not given); M left to it as 4 per stage, which every schedule takes;
// the schedule and V come on the first batch.
PipelinePlan check_plan(int layers, const Settings& settings) {
  parse_runtime(settings.runtime);
  Settings checked = settings;
  PipelineRequest& r = checked.request;
  if (settings.chosen() && !r.micro_batches)
    r.micro_batches = 4 * std::max({1, settings.devices(), static_cast<int>(r.balance.size())});
  if (settings.chosen() && settings.virtual_stages() > 1) r.schedule = "interleaved";
  // The stages are CPU threads.
  check_precision_runs(checked.options().precision(), c10::DeviceType::CPU);
  return make_plan(layers, checked.options());
}

// In a job of several processes (MPI, c10d), refuses on every rank a model that is not the same on every
// rank (its parameters' shapes and values, by a fingerprint): each rank trains its stages of what it
// was given.
void check_same_model(const torch::jit::Module& module) {
  if (running_backend() == Runtime::kThreads) return;
  std::array<double, 4> mine{0, 0, 0, 0};  // parameters, elements, Σ sums, Σ position·sum
  for (const torch::Tensor& p : module.parameters()) {
    const double sum = p.detach().sum(torch::kDouble).item<double>();
    mine[0] += 1;
    mine[1] += static_cast<double>(p.numel());
    mine[2] += sum;
    mine[3] += mine[0] * sum;
  }
  const std::vector<std::string> all =
      all_gather_processes(std::string(reinterpret_cast<const char*>(mine.data()), sizeof(mine)));
  for (size_t r = 1; r < all.size(); ++r)
    GPIPE_CHECK(all[r] == all[0], "rank ", r, "'s model differs from rank 0's (the shapes or the initial values of "
                "its parameters); every rank builds the same model: seed its initialisation (torch.manual_seed "
                "before building it) and give every rank the same layers");
}

// A pipeline of a scripted nn.Sequential, owned by the Python GPipe object.
class PythonPipeline {
 public:
  // Runs `work` with the GIL released, one call at a time (another Python thread's call waits its
  // turn: the pipeline takes one call at a time). If Ctrl-C came meanwhile, the KeyboardInterrupt
  // that Python's handler left pending is raised, whatever else stopped the step.
  template <typename Work>
  auto released(Work&& work) {
    std::optional<decltype(work())> result;
    std::exception_ptr failure;
    {
      const GilReleased free;  // the interpreter exited meanwhile (a daemon thread's call): waits there
      try {
        const std::lock_guard<std::mutex> one_call(calling_);
        result.emplace(work());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    if (failure) {
      if (PyErr_Occurred()) throw py::error_already_set();
      std::rethrow_exception(failure);
    }
    return std::move(*result);
  }

  // Without a balance in `settings`, the model is cut by its layers' measured time on `batch`'s first
  // micro-batch (schedule "auto": by prediction, each M on its own rows); under MPI every rank takes
  // rank 0's cut.
  PythonPipeline(const py::object& scripted, const Settings& settings, const std::optional<torch::Tensor>& batch)
      : model_(Model::of("model", script_model(scripted.attr("_c").cast<torch::jit::Module>(), "the scripted model"))) {
    const Runtime kind = parse_runtime(settings.runtime);
    PipelineOptions options = settings.options();
    options.tied_parameters(model_.tied);
    const GilReleased free;
    start_backends_for(kind);
    check_same_model(*model_.script);
    if (settings.chosen()) {
      GPIPE_CHECK(batch.has_value(), "schedule=\"auto\" is chosen on the first batch; no batch was given");
      choose(settings, *batch, options);
    } else if (options.balance().empty() && batch) {
      const int M = options.micro_batches();
      const torch::Tensor sample = batch->narrow(0, 0, first_micro_batch_rows(batch->size(0), M));
      const CostBalance by = balance_by(model_, sample,
                                        BalanceByOptions()
                                            .method("time")
                                            .devices(settings.devices())
                                            .virtual_stages(settings.virtual_stages())
                                            .schedule(options.schedule())
                                            .micro_batches(M)
                                            .checkpoint(options.checkpoint())
                                            .threads(settings.threads)
                                            .optimizer_copies(2.0)
                                            .precision(options.precision()));
      // Rank 0's cut, and the order its V schedule was predicted in: every rank runs the same program.
      options.balance(by.balance).stage_times(by.stage_times);
      options.config(first_rank_config(make_plan(model_.layers, options).config()));
    }
    pipe_ = make_pipeline(model_.build, model_.layers, options, kind);
    // Ctrl-C while the devices work: Python's handler runs on this (the calling) thread.
    pipe_->set_interrupt([this] {
      const int64_t begin = now_ns();
      const GilTaken gil;
      // An interpreter that is exiting (a daemon thread's step outliving the main thread) ends the step.
      if (!gil.held()) return true;
      const bool interrupted = PyErr_CheckSignals() != 0;
      gil_held_ns_ += now_ns() - begin;
      return interrupted;
    });
  }

  // schedule="auto": the layers profiled on `batch`'s micro-batches of each M weighed (the M given, or
  // each left open), and the fastest predicted schedule, V, (without chunks) M, (without a checkpoint)
  // re-materialization and (without a balance) cut at K (choose_schedule). In a job of several
  // processes rank 0 alone profiles (on a machine the others leave to it) and every rank takes its
  // choice and prediction; a failure there fails every rank.
  void choose(const Settings& settings, const torch::Tensor& batch, PipelineOptions& options) {
    const Runtime running = running_backend();
    const int processes = running == Runtime::kThreads ? 1 : backend(running).process().second;
    // A Python exception's text needs the GIL, which this thread has not: rank 0 tells the others it
    // was one, and raises it itself.
    std::exception_ptr python_error;
    try {
      const ScheduleChoice c = *chosen_on_first_rank(
          [&] {
            try {
              return profile_and_choose(settings, batch, processes);
            } catch (const py::error_already_set&) {
              if (running == Runtime::kThreads) throw;
              python_error = std::current_exception();
              throw std::runtime_error("a Python exception there (KeyboardInterrupt, say)");
            }
          },
          "schedule=\"auto\"");
      options.config(c.config);
      predicted_.step_s = c.predicted.step_s;  // what every rank has of it
      predicted_.bubble = c.predicted.bubble;
    } catch (...) {
      if (python_error) std::rethrow_exception(python_error);
      throw;
    }
  }

  // choose's profile and prediction, made on this process (of `processes`, each running its share of
  // `batch` where there are replicas).
  ScheduleChoice profile_and_choose(const Settings& settings, const torch::Tensor& batch, int processes) {
    keep_freed_memory();  // profiled with the allocator's settings the pipeline runs with
    const RandomStateGuard guard;
    const torch::nn::Sequential whole = model_.build(LayerRange{});
    // A replica's share of the batch (under MPI or c10d with replicas), which its pipeline runs. A first
    // batch of fewer rows than a given M runs one row per micro-batch: predicted at M, on those rows.
    const std::optional<int> M = settings.request.micro_batches;
    const int64_t share = first_micro_batch_rows(batch.size(0), std::max(1, processes / settings.devices()));
    const int64_t planned = M ? std::max<int64_t>(share, *M) : share;
    // A weight shared by layers may be tied across stages, which update_on_devices refuses.
    const torch::Tensor first = batch.narrow(0, 0, first_micro_batch_rows(share, M.value_or(1)));
    const int64_t least_rows = least_micro_batch_rows(whole, first);
    const CostsAtRows profiled = profiles_at_rows(
        whole, batch.narrow(0, 0, share), torch::Tensor(), planned,
        PlanProfileOptions().optimizer(settings.optimizer).layers(
            ProfileLayersOptions()
                .threads(settings.threads)
                .between(throw_if_interrupted)
                .precision(settings.request.precision.value_or(Precision::kFloat32))),
        settings.update_on_devices && shared_tensors(whole).empty(),
        profiled_rows(settings.request, planned, least_rows));
    const double update_s = settings.update_s_per_parameter_byte;
    const CostsAtRows profile_at = [profiled, update_s](int64_t rows) {
      CostModel costs = profiled(rows);
      if (update_s > 0) costs.update_s_per_parameter_byte = update_s;
      return costs;
    };
    return choose_schedule(profile_at, settings.request, planned, 0, least_rows,
                           std::max(1, machine_cores() / settings.threads));
  }

  // With `scaler`, each micro-batch's loss is scaled by it and the step skipped on every stage and rank
  // where a gradient is not finite, its gradients left None (LossScaler::check_and_update).
  double train_step(const torch::Tensor& input, const torch::Tensor& target, const py::object& loss, bool training,
                    LossScaler* scaler) {
    const LossFn fn = loss_of(loss);
    gil_held_ns_ = 0;
    const int64_t begin = now_ns();
    const double value = released([&] {
      set_training(training);
      const double loss = pipe_->train_step(input, target, fn, scaler ? scaler->scale() : 1.0).item<double>();
      if (scaler != nullptr) scaler->check_and_update(*pipe_, std::isfinite(loss));
      return loss;
    });
    gil_free_s_ = static_cast<double>(now_ns() - begin - gil_held_ns_.load()) * 1e-9;
    // Ctrl-C as the step ended, after its last interrupt check: the step counts, and the caller raises
    // KeyboardInterrupt once it has taken it in (take_interrupt), not in the middle of that.
    if (PyErr_CheckSignals() != 0) {
      if (!PyErr_ExceptionMatches(PyExc_KeyboardInterrupt)) throw py::error_already_set();
      PyErr_Clear();
      interrupted_after_step_ = true;
    }
    return value;
  }

  // Whether Ctrl-C came as the last step ended (train_step); asking forgets it.
  bool take_interrupt() { return std::exchange(interrupted_after_step_, false); }

  /// Seconds of the last train_step during which this process did not hold the GIL.
  double gil_free_seconds() const { return gil_free_s_; }

  std::optional<torch::Tensor> forward(const torch::Tensor& input, bool training) {
    const torch::Tensor out = released([&] {
      set_training(training);
      return pipe_->forward(input);
    });
    if (!out.defined()) return std::nullopt;
    return out;
  }

  // The whole model's parameters and buffers in one TorchScript file, gathered from every rank
  // (collective; rank 0 writes it), in the library's snapshot format, without optimizer state.
  void save(const std::string& path) {
    torch::optim::SGD no_optimizer(std::vector<torch::Tensor>{}, torch::optim::SGDOptions(0.1));
    at::Generator generator = at::globalContext().defaultGenerator(torch::kCPU);
    const TrainState state{0, generator.get_state(), generator.get_state(), std::nullopt, std::nullopt};
    released([&] {
      on_every_rank(path, [&] { save_whole_snapshot(*pipe_, model_, no_optimizer, "none", state, path); });
      return 0;
    });
  }

  // The last step's timeline, gathered from every rank, written by rank 0.
  void write_step_trace(const std::string& path) {
    released([&] {
      on_every_rank(path, [&] {
        const StepTrace trace = pipe_->trace();
        if (pipe_->root()) write_trace(trace, path);
      });
      return 0;
    });
  }

  Pipeline& pipe() { return *pipe_; }
  const Prediction& predicted() const { return predicted_; }  // schedule="auto": the choice's

  // `work(stage)` run by the stage's device before the stage's first action of each step (Python, the
  // GIL taken there); None: nothing. What it raises fails the step as a stage's error, named by it.
  void set_before_stage(const py::object& work) {
    if (work.is_none()) {
      pipe_->set_before_stage(nullptr);
      before_stage_ = py::none();
      return;
    }
    before_stage_ = work;
    pipe_->set_before_stage([this](int stage) {
      const int64_t begin = now_ns();
      std::optional<std::string> failure;
      {
        const GilTaken gil;
        // An interpreter that is exiting cannot give this thread the GIL: the step fails instead.
        if (!gil.held()) throw std::runtime_error("the Python interpreter is exiting");
        try {
          before_stage_(stage);
        } catch (py::error_already_set& e) {
          failure = e.what();
        }
      }
      gil_held_ns_ += now_ns() - begin;
      if (failure) throw std::runtime_error(*failure);
    });
  }

  // This process's stages' parameters (each once), by stage.
  std::map<int, std::vector<torch::Tensor>> stage_parameters() const {
    std::map<int, std::vector<torch::Tensor>> out;
    for (int s : pipe_->stages_here()) out[s] = unique_parameters(*pipe_->stage(s));
    return out;
  }

 private:
  // Runs `write` (collective, rank 0 writing `path`); if it fails on any rank it raises on every
  // rank: the failing rank its own error, the others one that points to it.
  void on_every_rank(const std::string& path, const std::function<void()>& write) {
    std::exception_ptr failure;
    try {
      write();
    } catch (...) {
      failure = std::current_exception();
    }
    const double failed = pipe_->sum(failure ? 1.0 : 0.0);
    if (failure) std::rethrow_exception(failure);
    if (failed > 0)
      throw std::runtime_error("gpipe: writing " + path + " failed on another rank; its error says why");
  }

  // The layers in the mode of the Python model (model.train() / model.eval()), as its forward would run.
  void set_training(bool training) {
    if (pipe_->layers()->is_training() != training) pipe_->layers()->train(training);
  }

  Model model_;
  std::unique_ptr<Pipeline> pipe_;
  Prediction predicted_;
  py::object before_stage_ = py::none();
  bool interrupted_after_step_ = false;
  std::mutex calling_;
  // In the last step's interrupt checks and its devices' work before a stage (update_on_devices).
  std::atomic<int64_t> gil_held_ns_{0};
  double gil_free_s_ = 0;
};

}  // namespace
void add_planning(py::module_& m);  // planning.cc: the planner, profile, prediction and tasks
// `fields` (pipeline_config.h's serializer) into `dict`, each value as Python has it (planning.cc).
void add_fields(py::dict& dict, const Fields& fields);
void add_loss_scale(py::module_& m);  // loss_scale.cc
void add_job(py::module_& m);         // job.cc
}  // namespace gpipe::python

namespace {

// What a pipeline runs, as the one serializer writes it (pipeline_config.h): GPipe.config.
void add_config(py::module_& m) {
  using namespace gpipe;
  py::class_<PipelineConfig>(m, "PipelineConfig")
      .def_property_readonly("schedule", [](const PipelineConfig& c) { return to_string(c.schedule); })
      .def_readonly("devices", &PipelineConfig::devices)
      .def_readonly("virtual_stages", &PipelineConfig::virtual_stages)
      .def_readonly("micro_batches", &PipelineConfig::micro_batches)
      .def_readonly("balance", &PipelineConfig::balance)
      .def_property_readonly("checkpoint", [](const PipelineConfig& c) { return to_string(c.checkpoint); })
      .def_property_readonly("stage_times",
                             [](const PipelineConfig& c) {
                               std::vector<std::tuple<double, double, double>> out;
                               for (const ActionTimes& t : c.stage_times)
                                 out.emplace_back(t.forward, t.input_grad, t.weight_grad);
                               return out;
                             })
      .def("fields",
           [](const PipelineConfig& c) {
             py::dict out;
             gpipe::python::add_fields(out, fields_of(c));
             return out;
           })
      .def("__eq__", [](const PipelineConfig& a, const PipelineConfig& b) { return a == b; })
      .def("__repr__", [](const PipelineConfig& c) {
        return "gpipe.PipelineConfig(" + describe(c) + ", K=" + std::to_string(c.devices) + ", cut " +
               format_cut(c.balance) + ")";
      });
}

// The pipeline's settings and the table's rows behind them, and what is checked of a model and a plan
// before any batch.
void add_settings(py::module_& m) {
  using namespace gpipe;
  using gpipe::python::Settings;
  py::class_<Settings>(m, "Settings")
      .def(py::init<>())
      // The request's fields; None: left open (M and the checkpoint to schedule "auto", K to the balance).
      .def_property("balance", [](const Settings& s) { return s.request.balance; },
                    [](Settings& s, const std::vector<int>& b) { s.request.balance = b; })
      .def_property("micro_batches", [](const Settings& s) { return s.request.micro_batches; },
                    [](Settings& s, std::optional<int> m) { s.request.micro_batches = m; })
      .def_property("checkpoint",
                    [](const Settings& s) {
                      return s.request.checkpoint ? std::optional<std::string>(to_string(*s.request.checkpoint))
                                                  : std::nullopt;
                    },
                    [](Settings& s, const std::optional<std::string>& c) {
                      s.request.checkpoint = c ? std::optional<Checkpoint>(parse_checkpoint(*c)) : std::nullopt;
                    })
      .def_property("schedule", [](const Settings& s) { return s.request.schedule; },
                    [](Settings& s, const std::string& name) { s.request.schedule = name; })
      .def_property("devices", [](const Settings& s) { return s.request.devices; },
                    [](Settings& s, std::optional<int> k) { s.request.devices = k; })
      .def_property("virtual_stages", [](const Settings& s) { return s.request.virtual_stages; },
                    [](Settings& s, std::optional<int> v) { s.request.virtual_stages = v; })
      .def_readwrite("deferred_batch_norm", &Settings::deferred_batch_norm)
      .def_readwrite("threads", &Settings::threads)
      .def_readwrite("runtime", &Settings::runtime)
      .def_readwrite("optimizer", &Settings::optimizer)
      .def_readwrite("update_on_devices", &Settings::update_on_devices)
      .def_readwrite("update_s_per_parameter_byte", &Settings::update_s_per_parameter_byte)
      // Whether GPipe scales its loss: `loss_scale` dynamic, or auto under fp16 (scales_loss).
      .def("scales_loss",
           [](const Settings& s) {
             return scales_loss(loss_scale_of(s.table), s.request.precision.value_or(Precision::kFloat32));
           })
      .def("set", [](Settings& s, const std::string& name, const std::string& text) {
        set_setting(find_setting(name), s.table, text);
        s.request = with_request_settings(s.request, s.table);
      }, py::arg("name"), py::arg("text"));
  // The settings' table's rows that are keyword arguments of GPipe: keyword -> (name, shape, help).
  m.def("keyword_settings", [] {
    py::dict out;
    for (const Setting& row : train_settings())
      if (!row.keyword.empty()) out[py::str(row.keyword)] = py::make_tuple(row.name, row.check.shape, row.help);
    return out;
  });
  // "" where the setting `name` takes `text`, else what is wrong: "must be at least 1 (got 0)".
  m.def("check_field", [](const std::string& name, const std::string& text) {
    return gpipe::check_field(find_setting(name), text);
  }, py::arg("name"), py::arg("text"));
  // What the pipeline refuses of a scripted model (a Pop's merge with parameters...), before any batch.
  m.def("check_model", [](const py::object& scripted) {
    script_model(scripted.attr("_c").cast<torch::jit::Module>(), "the scripted model");
  }, py::arg("scripted"));
  // The plan's K and V, or ValueError naming what the settings get wrong.
  m.def("check_threads_per_device", [](int threads) { gpipe::check_threads_per_device(threads, "threads="); },
        py::arg("threads"));
  m.def("check_plan",
        [](int layers, const Settings& settings) {
          const PipelinePlan plan = gpipe::python::check_plan(layers, settings);
          return std::make_pair(plan.devices, plan.virtual_stages);
        },
        py::arg("layers"), py::arg("settings"));
}

// The Pipeline: built from a scripted model and its settings, trained and run step by step.
void add_pipeline(py::module_& m) {
  using namespace gpipe;
  using gpipe::python::PythonPipeline;
  using gpipe::python::Settings;
  // Calls that wait for the devices or for other ranks release the GIL (PythonPipeline::released),
  // so that other Python threads run.
  py::class_<PythonPipeline>(m, "Pipeline")
      .def(py::init<const py::object&, const Settings&, const std::optional<torch::Tensor>&>(), py::arg("scripted"),
           py::arg("settings"), py::arg("batch"))
      .def("parameters", [](PythonPipeline& p) { return p.pipe().parameters(); })
      .def("stage_parameters", &PythonPipeline::stage_parameters)
      .def("take_interrupt", &PythonPipeline::take_interrupt)
      .def("set_before_stage", &PythonPipeline::set_before_stage, py::arg("work"))
      .def("train_step", &PythonPipeline::train_step, py::arg("input"), py::arg("target"), py::arg("loss"),
           py::arg("training"), py::arg("scaler") = nullptr)
      .def("forward", &PythonPipeline::forward, py::arg("input"), py::arg("training"))
      .def("save", &PythonPipeline::save, py::arg("path"))
      .def_property_readonly("gil_free_seconds", &PythonPipeline::gil_free_seconds)
      .def_property_readonly("balance", [](PythonPipeline& p) { return p.pipe().balance(); })
      .def_property_readonly("placement", [](PythonPipeline& p) { return p.pipe().plan().placement; })
      .def("bubble", [](PythonPipeline& p) { return p.released([&] { return p.pipe().bubble(); }); })
      .def("write_trace", &PythonPipeline::write_step_trace, py::arg("path"))
      .def("schedule_text", [](PythonPipeline& p) { return format_grid(p.pipe().schedule()); })
      .def_property_readonly("schedule", [](PythonPipeline& p) { return to_string(p.pipe().plan().schedule); })
      .def_property_readonly("virtual_stages", [](PythonPipeline& p) { return p.pipe().plan().virtual_stages; })
      .def_property_readonly("micro_batches", [](PythonPipeline& p) { return p.pipe().plan().micro_batches; })
      .def_property_readonly("checkpoint", [](PythonPipeline& p) { return to_string(p.pipe().plan().checkpoint); })
      .def_property_readonly("config", [](PythonPipeline& p) { return p.pipe().plan().config(); })
      .def_property_readonly("predicted", [](PythonPipeline& p) {
        return std::make_pair(p.predicted().step_s, p.predicted().bubble);
      })
      .def("describe", [](PythonPipeline& p) { return p.pipe().describe(); })
      .def("sum", [](PythonPipeline& p, double value) { return p.released([&] { return p.pipe().sum(value); }); })
      .def("clip_grad_norm",
           [](PythonPipeline& p, double max_norm) {
             return p.released([&] { return p.pipe().clip_gradients(max_norm); });
           })
      .def("output_rows", [](PythonPipeline& p, int64_t rows) { return p.pipe().output_rows(rows); }, py::arg("rows"))
      .def_property_readonly("rank", [](PythonPipeline& p) { return p.pipe().rank(); })
      .def_property_readonly("has_trace", [](PythonPipeline& p) {
        return p.released([&] { return p.pipe().last_trace().end_ns > 0; });
      });
}

}  // namespace

PYBIND11_MODULE(_gpipe, m) {
  using namespace gpipe;
  m.doc() = "gpipe's C++ pipeline (use the gpipe package: gpipe.GPipe)";

  // Errors as Python sees them: bad arguments are ValueError (pybind11 maps std::invalid_argument);
  // a failure inside a stage a RuntimeError naming the stage, micro-batch and action; libtorch's own
  // errors as torch raises them, without their C++ stack. Local: other modules keep their own mapping.
  py::register_local_exception_translator([](std::exception_ptr failure) {
    try {
      if (failure) std::rethrow_exception(failure);
    } catch (const c10::Error& e) {
      PyObject* kind = dynamic_cast<const c10::ValueError*>(&e)            ? PyExc_ValueError
                       : dynamic_cast<const c10::IndexError*>(&e)          ? PyExc_IndexError
                       : dynamic_cast<const c10::TypeError*>(&e)           ? PyExc_TypeError
                       : dynamic_cast<const c10::NotImplementedError*>(&e) ? PyExc_NotImplementedError
                                                                           : PyExc_RuntimeError;
      PyErr_SetString(kind, short_error(e).c_str());
    }
  });

  add_config(m);
  gpipe::python::add_loss_scale(m);
  add_settings(m);
  add_pipeline(m);
  gpipe::python::add_job(m);
  gpipe::python::add_planning(m);
  gpipe::python::close_gil_gate_at_exit();
}
