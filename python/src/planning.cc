// planning.cc: the planner, the per-layer profile, the predicted step and the built-in tasks for
// Python (python/gpipe/planning.py and tasks.py check the arguments and make the answers Python
// objects; this file only translates). Long calls release the GIL.
#include <gpipe/gpipe.h>

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "gil.h"

#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace gpipe::python {

void add_fields(py::dict& dict, const Fields& fields);  // bindings.cc declares it too

namespace {

// The layers of a scripted nn.Sequential (python/gpipe/pipe.py's _script), sharing its tensors.
torch::nn::Sequential layers_of(const py::object& scripted) {
  return script_model(scripted.attr("_c").cast<torch::jit::Module>(), "the scripted model").layers;
}

// A sample: one tensor, or a tuple of them (a model whose input is a tuple).
Tensors sample_of(const std::vector<torch::Tensor>& items, bool tuple) {
  return tuple ? Tensors::tuple_of(items) : Tensors(items.front());
}

LossFn loss_named(const std::string& name) {
  if (name.empty()) return nullptr;
  if (name == "cross_entropy") return cross_entropy_loss;
  if (name == "mse") return mse_loss;
  GPIPE_CHECK(false, "`loss` must be \"cross_entropy\" or \"mse\" (got \"", name, "\")");
  return nullptr;
}

py::dict layer_dict(const LayerCost& c) {
  py::dict d;
  d["forward_s"] = c.forward_s;
  d["backward_s"] = c.backward_s;
  d["input_grad_s"] = c.input_grad_s;
  d["weight_grad_s"] = c.weight_grad_s;
  d["parameter_bytes"] = c.parameter_bytes;
  d["kept_bytes"] = c.kept_bytes;
  d["chain_kept_bytes"] = c.chain_kept_bytes;
  d["output_bytes"] = c.output_bytes;
  d["forward_peak_bytes"] = c.forward_peak_bytes;
  d["backward_peak_bytes"] = c.backward_peak_bytes;
  d["weight_kept_bytes"] = c.weight_kept_bytes;
  return d;
}

py::dict costs_dict(const CostModel& costs) {
  py::list layers, skips;
  for (const LayerCost& c : costs.layers) layers.append(layer_dict(c));
  for (const SkipCost& s : costs.skips) skips.append(py::make_tuple(s.connection.name, s.bytes));
  py::list tied;
  for (const TiedParameter& p : costs.tied) tied.append(py::make_tuple(p.bytes, p.layers));
  py::dict d;
  d["layers"] = layers;
  d["skips"] = skips;
  d["tied"] = tied;
  d["loss_kept_bytes"] = costs.loss_kept_bytes;
  d["loss_backward_peak_bytes"] = costs.loss_backward_peak_bytes;
  d["state_per_parameter_byte"] = costs.state_per_parameter_byte;
  d["update_s_per_parameter_byte"] = costs.update_s_per_parameter_byte;
  d["action_overhead_s"] = costs.action_overhead_s;
  d["step_overhead_s"] = costs.step_overhead_s;
  return d;
}

py::dict prediction_dict(const Prediction& p) {
  py::dict d;
  d["step_s"] = p.step_s;
  d["bubble"] = p.bubble;
  d["peak_bytes"] = p.peak_bytes;
  d["static_bytes"] = p.static_bytes;
  d["total_bytes"] = p.total_bytes();
  d["largest_device"] = p.largest_device();
  return d;
}

py::dict candidate_dict(const PlanCandidate& c) {
  py::dict d = prediction_dict(c.predicted);
  add_fields(d, fields_of(c.config));
  d["replicas"] = c.replicas;
  d["step_s"] = c.step_s;  // with the replicas' all-reduce
  d["samples_per_s"] = c.samples_per_s;
  d["largest_total_bytes"] = c.largest_total_bytes;
  d["fits"] = c.fits;
  return d;
}

py::dict planned_dict(const PlannedModel& m) {
  py::dict d;
  d["description"] = m.description;
  d["parameters"] = m.parameters;
  d["least_micro_batch_rows"] = m.least_micro_batch_rows;
  d["layers"] = m.costs.layer_count();
  return d;
}

// What Python's gpipe.plan asks of the search.
struct SearchSettings {
  int devices = 1;
  int64_t memory_per_device = 0;
  int64_t batch = 1;
  std::vector<std::string> schedules, checkpoints;
  std::vector<int> stages, micro_batches;
  double latency_s = 5e-6, bytes_per_s = 25e9;
};

// The search over `model`: the configurations (fits first, fastest first), and when none fits, why
// and what to try (no_fit_message, in gpipe.plan's arguments), with `optimizer` the model's and
// `half_precision_helps` for a Transformer of float32 values.
py::dict search(PlannedModel model, const SearchSettings& s, const std::string& optimizer,
                bool half_precision_helps = false) {
  PlanSearch search =
      plan_search_of(s.devices, s.memory_per_device, s.batch, s.schedules, s.checkpoints, s.stages, s.micro_batches);
  search.check();
  model.costs.link_latency_s = s.latency_s;
  model.costs.link_bytes_per_s = s.bytes_per_s;
  std::vector<PlanCandidate> found;
  {
    const GilReleased free;
    found = search_plans(model, search);
  }
  py::list rows;
  bool fits = false;
  for (const PlanCandidate& c : found) {
    rows.append(candidate_dict(c));
    fits = fits || c.fits;
  }
  py::dict out = planned_dict(model);
  out["configurations"] = rows;
  if (!fits) {
    const PlanSettingNames names{"checkpoints=[\"always\"]", "devices", "bytes_per_value 2", "optimizer"};
    out["no_fit"] = no_fit_message(found, model, search, optimizer, half_precision_helps, names);
  }
  return out;
}

PlanProfileOptions profile_options(const std::string& optimizer, double speed, int threads, const std::string& loss,
                                   const std::optional<torch::Tensor>& target) {
  PlanProfileOptions o;
  o.optimizer(optimizer).speed(speed).layers().threads(threads).loss(loss_named(loss));
  if (target) o.layers().target(*target);
  return o;
}

// The sample of a single tensor is checked as gpipe train checks a model (a model that cannot train
// fits nothing).
void check_trains(torch::nn::Sequential layers, const Tensors& sample) {
  if (sample.tuple) return;
  const RandomStateGuard guard;
  const bool training = layers->is_training();
  check_layers_train(layers, sample.items.front());
  layers->train(training);
}

py::dict task_data_dict(const TaskData& d) {
  py::dict out;
  out["train"] = py::make_tuple(d.train.input, d.train.target);
  out["test"] = py::make_tuple(d.test.input, d.test.target);
  out["test_name"] = d.test_name;
  out["source"] = d.source;
  out["noisy_psnr_db"] = d.noisy_psnr_db;
  out["train_bytes"] = d.train_bytes;
  out["test_bytes"] = d.test_bytes;
  out["bigram_bits_per_byte"] = d.bigram_bits_per_byte;
  out["gzip_bits_per_byte"] = d.gzip_bits_per_byte;
  return out;
}

// gpipe.plan: the search's settings, and the plan of a Sequential, a task or a Transformer's shape.
void add_plans(py::module_& m) {
  py::class_<SearchSettings>(m, "SearchSettings")
      .def(py::init<>())
      .def_readwrite("devices", &SearchSettings::devices)
      .def_readwrite("memory_per_device", &SearchSettings::memory_per_device)
      .def_readwrite("batch", &SearchSettings::batch)
      .def_readwrite("schedules", &SearchSettings::schedules)
      .def_readwrite("checkpoints", &SearchSettings::checkpoints)
      .def_readwrite("stages", &SearchSettings::stages)
      .def_readwrite("micro_batches", &SearchSettings::micro_batches)
      .def_readwrite("latency_s", &SearchSettings::latency_s)
      .def_readwrite("bytes_per_s", &SearchSettings::bytes_per_s);
  m.def("parse_bytes", &parse_bytes, py::arg("text"));

  // gpipe.plan of a Sequential: profiled here (the GIL released), then searched.
  m.def("plan_model",
        [](const py::object& scripted, const std::vector<torch::Tensor>& sample, bool tuple, const std::string& optimizer,
           double speed, int threads, const std::string& loss, const std::optional<torch::Tensor>& target,
           const SearchSettings& settings) {
          const torch::nn::Sequential layers = layers_of(scripted);
          const Tensors x = sample_of(sample, tuple);
          const PlanProfileOptions o = profile_options(optimizer, speed, threads, loss, target).name("model");
          PlannedModel model;
          {
            const GilReleased free;
            check_trains(layers, x);
            model = plan_model_of(layers, x, o);
          }
          return search(model, settings, optimizer);
        },
        py::arg("scripted"), py::arg("sample"), py::arg("tuple"), py::arg("optimizer"), py::arg("speed"),
        py::arg("threads"), py::arg("loss"), py::arg("target"), py::arg("settings"));
  m.def("plan_task",
        [](const std::string& name, uint64_t seed, const std::string& optimizer, double speed, int threads,
           const SearchSettings& settings) {
          PlannedModel model;
          {
            const GilReleased free;
            model = plan_model_of(find_task(name), TaskOptions().seed(seed),
                                  PlanProfileOptions().optimizer(optimizer).speed(speed).layers(ProfileLayersOptions().threads(threads)));
          }
          return search(model, settings, optimizer);
        },
        py::arg("name"), py::arg("seed"), py::arg("optimizer"), py::arg("speed"), py::arg("threads"),
        py::arg("settings"));
  m.def("plan_transformer",
        [](const std::vector<int64_t>& shape, double flops, const std::string& optimizer, const SearchSettings& settings) {
          TransformerShape t;
          t.layers = shape.at(0), t.width = shape.at(1), t.heads = shape.at(2), t.ffn = shape.at(3);
          t.vocab = shape.at(4), t.sequence = shape.at(5), t.bytes_per_value = shape.at(6);
          return search(plan_model_of(t, DeviceSpec{flops}, optimizer), settings, optimizer, t.bytes_per_value == 4);
        },
        py::arg("shape"), py::arg("flops"), py::arg("optimizer"), py::arg("settings"));
}

// gpipe.profile and gpipe.predict: a model's costs and a pipeline's predicted step.
void add_prediction(py::module_& m) {
  // gpipe.profile: profile_model's costs, per layer and per sample.
  m.def("profile",
        [](const py::object& scripted, const std::vector<torch::Tensor>& sample, bool tuple, const std::string& optimizer,
           double speed, int threads, int warmup, int repetitions, const std::string& loss,
           const std::optional<torch::Tensor>& target) {
          const torch::nn::Sequential layers = layers_of(scripted);
          const Tensors x = sample_of(sample, tuple);
          PlanProfileOptions o = profile_options(optimizer, speed, threads, loss, target);
          o.layers().warmup(warmup).repetitions(repetitions);
          CostModel costs;
          int64_t least = 1;
          {
            const GilReleased free;
            costs = profile_model(layers, x, o);
            least = least_micro_batch_rows(layers, x);
          }
          py::dict d = costs_dict(costs);
          d["least_micro_batch_rows"] = least;
          return d;
        },
        py::arg("scripted"), py::arg("sample"), py::arg("tuple"), py::arg("optimizer"), py::arg("speed"),
        py::arg("threads"), py::arg("warmup"), py::arg("repetitions"), py::arg("loss"), py::arg("target"));

  // gpipe.predict: the plan of the pipeline asked for (cut by the layers' time without a balance)
  // and cost_model.h's prediction of one step of `batch` rows.
  m.def("predict",
        [](const py::object& scripted, const std::vector<torch::Tensor>& sample, bool tuple, int devices,
           const std::vector<int>& balance, int micro_batches, const std::string& schedule,
           const std::string& checkpoint, int virtual_stages, int64_t batch, const std::string& optimizer,
           double speed, int threads, const std::string& loss, const std::optional<torch::Tensor>& target) {
          const torch::nn::Sequential layers = layers_of(scripted);
          const Tensors x = sample_of(sample, tuple);
          const PlanProfileOptions o = profile_options(optimizer, speed, threads, loss, target);
          PipelineOptions options = PipelineOptions()
                                        .devices(devices)
                                        .balance(balance)
                                        .micro_batches(micro_batches)
                                        .schedule(parse_schedule(schedule))
                                        .checkpoint(parse_checkpoint(checkpoint))
                                        .virtual_stages(virtual_stages);
          const std::vector<SkipConnection> skips = skip_connections(layers);
          PipelinePlan plan = make_plan(static_cast<int>(layers->size()), options, skips);  // checked before profiling
          GPIPE_CHECK(batch >= micro_batches, "`batch` ", batch, " rows cannot make ", micro_batches,
                      " micro-batches; every micro-batch needs a row");
          const std::vector<int64_t> rows = micro_batch_sizes(batch, micro_batches);
          Prediction p;
          {
            const GilReleased free;
            const CostModel costs = profile_model(layers, x, o);
            if (balance.empty()) {
              // Cut by time as GPipe(balance=None) cuts: the min-max of the devices' time, refined by the
              // simulated step (refined_plan).
              PipelineRequest by_time;
              by_time.balance_by = "time";
              options.cut(CutRequest::by_cost(with_layer_costs(by_time, layers, costs, rows.front()).layer_costs));
              plan = refined_plan(costs, options, rows);
            }
            p = predict(costs, plan, rows);
          }
          py::dict d = prediction_dict(p);
          d["devices"] = plan.devices;
          d["virtual_stages"] = plan.virtual_stages;
          d["balance"] = plan.balance;
          d["placement"] = plan.placement;
          d["micro_batch_rows"] = rows;
          return d;
        },
        py::arg("scripted"), py::arg("sample"), py::arg("tuple"), py::arg("devices"), py::arg("balance"),
        py::arg("micro_batches"), py::arg("schedule"), py::arg("checkpoint"), py::arg("virtual_stages"),
        py::arg("batch"), py::arg("optimizer"), py::arg("speed"), py::arg("threads"), py::arg("loss"),
        py::arg("target"));
}

// gpipe.tasks: the registry (tasks.h).
void add_tasks(py::module_& m) {
  m.def("task_names", &task_names, py::arg("workloads"));
  m.def("plan_optimizer_names", &plan_optimizer_names);
  m.def("task_info", [](const std::string& name) {
    const Task& t = find_task(name);
    py::dict d;
    d["name"] = t.name;
    d["title"] = t.title;
    d["summary"] = t.summary;
    d["workload"] = t.workload;
    d["layers"] = t.layers;
    d["metric"] = t.scoring.name;
    d["loss"] = t.loss_name;
    d["data_dir"] = t.data_dir;
    d["context"] = t.context;
    py::dict defaults;
    defaults["epochs"] = t.defaults.epochs;
    defaults["batch_size"] = t.defaults.batch_size;
    defaults["lr"] = t.defaults.lr;
    defaults["flip"] = t.defaults.flip;
    defaults["cut_by_time"] = t.defaults.cut_by_time;
    d["defaults"] = defaults;
    return d;
  }, py::arg("name"));
  m.def("task_data",
        [](const std::string& name, const std::string& data_dir, int64_t train_samples, int64_t test_samples,
           uint64_t seed) {
          const Task& t = find_task(name);
          const TaskOptions o =
              TaskOptions().data_dir(data_dir).train_samples(train_samples).test_samples(test_samples).seed(seed);
          TaskData d;
          {
            const GilReleased free;
            d = t.data(o);
          }
          return task_data_dict(d);
        },
        py::arg("name"), py::arg("data_dir"), py::arg("train_samples"), py::arg("test_samples"), py::arg("seed"));
  // The task's model, built in C++: its layers' kinds and its state (parameters and buffers by name).
  m.def("task_model",
        [](const std::string& name, uint64_t seed) {
          const Task& t = find_task(name);
          torch::nn::Sequential layers;
          {
            const GilReleased free;
            const RandomStateGuard guard;
            layers = t.model(TaskOptions().seed(seed)).build(LayerRange{});
          }
          py::list kinds;
          for (const auto& child : layers->named_children()) kinds.append(child.value()->name());
          py::list state;
          for (const auto& p : layers->named_parameters(/*recurse=*/true)) state.append(py::make_tuple(p.key(), p.value()));
          for (const auto& b : layers->named_buffers(/*recurse=*/true)) state.append(py::make_tuple(b.key(), b.value()));
          int64_t parameters = 0;
          for (const auto& p : layers->parameters()) parameters += p.numel();
          py::dict d;
          d["layers"] = kinds;
          d["state"] = state;
          d["parameters"] = parameters;
          return d;
        },
        py::arg("name"), py::arg("seed"));
}

}  // namespace

void add_fields(py::dict& dict, const Fields& fields) {
  for (const auto& [name, value] : fields)
    dict[py::str(name)] = std::visit([](const auto& v) { return py::cast(v); }, value);
}

void add_planning(py::module_& m) {
  add_plans(m);
  add_prediction(m);
  add_tasks(m);
}

}  // namespace gpipe::python
