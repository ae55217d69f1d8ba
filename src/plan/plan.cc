// plan.cc: make_plan, the one place where a pipeline's K, V, M, cut, placement and programs are
// decided and checked.
#include "gpipe/plan.h"

#include "gpipe/check.h"
#include "gpipe/partition.h"

#include <algorithm>

namespace gpipe {

PipelineOptions& PipelineOptions::config(const PipelineConfig& c) {
  return devices(c.devices)
      .virtual_stages(c.virtual_stages)
      .micro_batches(c.micro_batches)
      .schedule(c.schedule)
      .checkpoint(c.checkpoint)
      .balance(c.balance)
      .stage_times(c.stage_times)
      .precision(c.precision);
}

PipelineConfig PipelinePlan::config() const {
  return PipelineConfig{schedule, devices, virtual_stages, micro_batches, balance, checkpoint, stage_times, precision};
}

std::vector<int> PipelinePlan::stages_of(int device) const {
  std::vector<int> out;
  for (int s = 0; s < stages(); ++s)
    if (placement[static_cast<size_t>(s)] == device) out.push_back(s);
  return out;
}

LayerRange PipelinePlan::layers_of(int stage) const {
  GPIPE_CHECK(stage >= 0 && stage < stages(), "stage ", stage, " does not exist; the balance ",
              format_balance(balance), " has stages 0..", stages() - 1);
  const std::vector<int> offsets = stage_offsets(balance);
  return {offsets[static_cast<size_t>(stage)], offsets[static_cast<size_t>(stage) + 1]};
}

std::vector<LayerRange> PipelinePlan::device_layers(int device) const {
  std::vector<LayerRange> out;
  for (int s : stages_of(device)) out.push_back(layers_of(s));
  return out;
}

Schedule PipelinePlan::training_program(int m) const {
  if (m == micro_batches) return training;
  Schedule compute;
  try {
    compute = make_schedule(schedule, devices, m, virtual_stages, stage_times);
  } catch (const std::invalid_argument&) {  // interleaved with m not a multiple of K, say
    compute = fill_drain(devices, m, virtual_stages, placement);
  }
  Schedule program = lower(compute, checkpoint, skip_routes);
  validate(program);
  return program;
}

Schedule PipelinePlan::inference_program(int m) const {
  if (m == micro_batches) return inference;
  return lower(forward_only(devices, m, virtual_stages, placement), Checkpoint::kNever, skip_routes);
}

std::string to_string(CutKind kind) {
  switch (kind) {
    case CutKind::kEven: return "even";
    case CutKind::kGiven: return "given";
    case CutKind::kBlocks: return "blocks";
    case CutKind::kByCost: return "by cost";
  }
  return "?";
}

CutRequest CutRequest::given(std::vector<int> balance) {
  CutRequest r;
  r.kind = CutKind::kGiven;
  r.balance = std::move(balance);
  return r;
}

CutRequest CutRequest::blocks(std::vector<int> block_layers, int lead_layers, int tail_layers) {
  CutRequest r;
  r.kind = CutKind::kBlocks;
  r.block_layers = std::move(block_layers);
  r.lead_layers = lead_layers;
  r.tail_layers = tail_layers;
  return r;
}

CutRequest CutRequest::by_cost(std::vector<double> layer_costs) {
  CutRequest r;
  r.kind = CutKind::kByCost;
  r.layer_costs = std::move(layer_costs);
  return r;
}

std::string CutRequest::str() const {
  const auto count = [](int n, const char* what) { return std::to_string(n) + " " + what + (n == 1 ? "" : "s"); };
  switch (kind) {
    case CutKind::kGiven: return "given " + format_balance(balance);
    case CutKind::kBlocks:
      return "blocks (" + count(lead_layers, "lead layer") + ", " +
             count(static_cast<int>(block_layers.size()), "block") + ", " + count(tail_layers, "tail layer") + ")";
    default: return to_string(kind);
  }
}

std::vector<int> CutRequest::resolve(int layers, int stages, const std::vector<int>& placement) const {
  switch (kind) {
    case CutKind::kEven: return even_balance(layers, stages);
    case CutKind::kGiven: {
      check_balance(balance, layers);
      GPIPE_CHECK(static_cast<int>(balance.size()) == stages, "the balance ", format_balance(balance), " has ",
                  balance.size(), " stages, not the ", stages, " asked for; give ", stages, " entries");
      return balance;
    }
    case CutKind::kBlocks: {
      const int blocks = static_cast<int>(block_layers.size());
      GPIPE_CHECK(lead_layers >= 0 && tail_layers >= 0, "the cut by blocks has ", lead_layers, " lead and ",
                  tail_layers, " tail layers; give 0 or more of each");
      GPIPE_CHECK(blocks >= 1, "the cut by blocks has no blocks; give the layers of each block, or cut evenly");
      int sum = lead_layers + tail_layers;
      for (int n : block_layers) {
        GPIPE_CHECK(n >= 1, "a block of the cut by blocks has ", n, " layers; every block needs at least one");
        sum += n;
      }
      GPIPE_CHECK(sum == layers, "the cut ", str(), " covers ", sum, " layers, not the model's ", layers,
                  "; make the lead layers, the blocks' layers and the tail layers add up to ", layers);
      GPIPE_CHECK(stages >= 1 && stages <= blocks, "cannot cut ", blocks, blocks == 1 ? " block" : " blocks", " into ",
                  stages, " stages: every stage needs at least one block; use at most ", blocks, " stages");
      std::vector<int> out;
      size_t next = 0;
      for (int count : even_balance(blocks, stages)) {
        int sum_of_stage = 0;
        for (int b = 0; b < count; ++b) sum_of_stage += block_layers[next++];
        out.push_back(sum_of_stage);
      }
      out.front() += lead_layers;
      out.back() += tail_layers;
      return out;
    }
    case CutKind::kByCost:
      GPIPE_CHECK(static_cast<int>(layer_costs.size()) == layers, "the cut by cost has ", layer_costs.size(),
                  " per-layer costs for a model of ", layers, " layers; give one cost per layer");
      if (!placement.empty()) {
        GPIPE_CHECK(static_cast<int>(placement.size()) == stages, "the placement names the device of ",
                    placement.size(), " stages, not of the ", stages, " to cut; give one device per stage");
        return balance_devices_by_cost(layer_costs, placement);
      }
      return balance_by_cost(layer_costs, stages);
  }
  return even_balance(layers, stages);
}

void check_plan_of(const PipelinePlan& plan, int layers, const PipelineOptions& options) {
  auto differs = [](const char* what, const std::string& planned, const std::string& asked) {
    GPIPE_CHECK(false, "the plan given is not one of these options: it has ", what, " ", planned, ", the options ",
                asked, "; make the plan with make_plan from the same options");
  };
  if (layers >= 0 && plan.layers != layers)
    differs("layers", std::to_string(plan.layers), std::to_string(layers) + " (the model's)");
  if (plan.micro_batches != options.micro_batches())
    differs("micro-batches", std::to_string(plan.micro_batches), std::to_string(options.micro_batches()));
  if (plan.schedule != options.schedule()) differs("schedule", to_string(plan.schedule), to_string(options.schedule()));
  if (plan.checkpoint != options.checkpoint())
    differs("checkpoint", to_string(plan.checkpoint), to_string(options.checkpoint()));
  if (options.devices() > 0 && plan.devices != options.devices())
    differs("devices", std::to_string(plan.devices), std::to_string(options.devices()));
  if (options.virtual_stages() > 0 && plan.virtual_stages != options.virtual_stages())
    differs("stages per device", std::to_string(plan.virtual_stages), std::to_string(options.virtual_stages()));
  GPIPE_CHECK(plan.program == options.program(), "the plan given is not one of these options: ",
              plan.program.empty() ? "it has no program given, the options one" : options.program().empty()
                  ? "it has a program given, the options none" : "their programs given differ",
              " (PipelineOptions::program); make the plan with make_plan from the same options");
  if (!options.balance().empty() && plan.balance != options.balance())
    differs("the balance", format_balance(plan.balance), format_balance(options.balance()));
  for (const auto& group : options.tied_parameters())  // the options may add ties the plan was not made with
    GPIPE_CHECK(group.size() >= 2, "a group of tied parameters needs at least two names (got ", group.size(), ")");
}

namespace {

// The training program given as text (PipelineOptions::program), checked against the plan's K, V,
// M and placement, lowered with its checkpoint and skip routes (or, given lowered, checked to be that
// lowering).
Schedule given_training(const PipelinePlan& plan) {
  const Schedule given = parse_program(plan.program);
  const int K = plan.devices, V = plan.virtual_stages, M = plan.micro_batches;
  GPIPE_CHECK(given.devices == K, "the program given has rows for ", given.devices, " devices, the pipeline ", K,
              " (K); give a program of one row per device, or devices(", given.devices, ")");
  GPIPE_CHECK(given.stages == plan.stages(), "the program given runs ", given.stages, " stages on its ", K,
              " devices, the pipeline ", plan.stages(), " (", V, " per device, V); give a program of stages 0..",
              plan.stages() - 1, ", or the V it runs (virtual_stages, with a schedule that takes it)");
  GPIPE_CHECK(given.micro_batches == M, "the program given runs ", given.micro_batches,
              " micro-batches (its highest is ", given.micro_batches - 1, "), the pipeline ", M,
              " (M); give a program of micro-batches 0..", M - 1, ", or micro_batches(", given.micro_batches, ")");
  const ScheduleTraits& traits = schedule_traits(plan.schedule);
  const std::vector<int> placement = place_stages(traits.placement, K, V);
  for (int s = 0; s < plan.stages(); ++s) {
    const int d = given.placement[static_cast<size_t>(s)], expected = placement[static_cast<size_t>(s)];
    if (d == expected) continue;
    const StagePlacement other =
        traits.placement == StagePlacement::kLoop ? StagePlacement::kV : StagePlacement::kLoop;
    const bool fits_other = V == 2 && given.placement == place_stages(other, K, V);
    GPIPE_CHECK(false, "the program given runs stage ", s, " on device ", d, ", but the ", traits.name,
                " schedule places it on device ", expected, "; ",
                fits_other ? "the program places its stages as " + schedules_placed(other) + " do: name one of them"
                           : "place the stages as the " + traits.name + " schedule does (" +
                                 (traits.placement == StagePlacement::kV ? "a V: stages d and 2K-1-d on device d"
                                                                         : "stage s on device s mod K") + ")");
  }
  if (!given.lowered()) return lower(given, plan.checkpoint, plan.skip_routes);
  // Given lowered: its sends, receives and recompute flags must be those lower() puts, so that what
  // the executors follow is what the checkpoint mode and the skip connections need.
  Schedule compute = given;
  for (auto& row : compute.actions)
    row.erase(std::remove_if(row.begin(), row.end(), [](const Action& a) { return !a.is_compute(); }), row.end());
  Schedule program = lower(compute, plan.checkpoint, plan.skip_routes);
  for (int d = 0; d < K; ++d) {
    const auto& want = program.actions[static_cast<size_t>(d)];
    const auto& got = given.actions[static_cast<size_t>(d)];
    for (size_t n = 0; n < std::max(want.size(), got.size()); ++n) {
      if (n < want.size() && n < got.size() && want[n] == got[n]) continue;
      const std::string place = "in the row of device " + std::to_string(d) + " of the program given, action " +
                                std::to_string(n + 1) + " is ";
      GPIPE_CHECK(false, place, n < got.size() ? got[n].str() : "missing", " where lowering its compute actions with "
                  "checkpoint ", to_string(plan.checkpoint), plan.skip_routes.empty() ? "" : " and the model's skip connections",
                  " puts ", n < want.size() ? want[n].str() : "none", "; give the program without sends and receives ",
                  "(gpipe adds them), or as the gpipe schedule command prints it for `checkpoint` ",
                  to_string(plan.checkpoint));
    }
  }
  return program;
}

// The plan's training program from its given program, or from its schedule, K, M, V and stage times;
// with its checkpoint and skip routes.
void lower_training(PipelinePlan& plan) {
  plan.training = !plan.program.empty()
                      ? given_training(plan)
                      : lower(make_schedule(plan.schedule, plan.devices, plan.micro_batches, plan.virtual_stages,
                                            plan.stage_times),
                              plan.checkpoint, plan.skip_routes);
  validate(plan.training);
}

void check_stage_times(const std::vector<ActionTimes>& times, int stages) {
  GPIPE_CHECK(times.empty() || times.size() == static_cast<size_t>(stages), "`stage_times` holds ", times.size(),
              times.size() == 1 ? " entry" : " entries", " for a pipeline of ", stages,
              " stages; give one per stage (K·V), or none");
}

}  // namespace

void route_skips(PipelinePlan& plan, const std::vector<SkipConnection>& skips) {
  // The skip connections that cross stages; those inside a stage meet in its tray.
  const std::vector<int> offsets = stage_offsets(plan.balance);
  auto stage_of = [&](int layer) {
    return static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), layer) - offsets.begin()) - 1;
  };
  std::vector<SkipRoute> routes;
  std::vector<std::string> names;
  for (const SkipConnection& c : skips) {
    GPIPE_CHECK(c.stash_layer >= 0 && c.pop_layer < plan.layers, "skip connection \"", c.name, "\" joins layers ",
                c.stash_layer, " and ", c.pop_layer, ", outside the model's 0..", plan.layers - 1);
    const int from = stage_of(c.stash_layer), to = stage_of(c.pop_layer);
    if (from == to) continue;
    routes.push_back({from, to});
    names.push_back(c.name);
  }
  const bool lowered = !plan.training.actions.empty();
  if (lowered && routes.empty() && plan.skip_routes.empty()) return;  // the programs stand as they are
  plan.skip_routes = std::move(routes);
  plan.skip_names = std::move(names);
  lower_training(plan);
  const int K = plan.devices, V = plan.virtual_stages;
  plan.placement = plan.training.placement;  // where the schedule puts each stage: every reader takes it from here
  plan.inference = lower(forward_only(K, plan.micro_batches, V, plan.placement), Checkpoint::kNever, plan.skip_routes);
}

PipelinePlan with_stage_times(PipelinePlan plan, std::vector<ActionTimes> times) {
  check_stage_times(times, plan.stages());
  plan.stage_times = std::move(times);
  if (schedule_traits(plan.schedule).orders_by_times) lower_training(plan);
  return plan;
}

PipelinePlan make_plan(int layers, const PipelineOptions& options, const std::vector<SkipConnection>& skips) {
  GPIPE_CHECK(layers >= 1, "the model is empty (0 layers); give the pipeline a torch::nn::Sequential with at least "
              "one layer");
  PipelinePlan plan;
  plan.layers = layers;
  plan.schedule = options.schedule();
  plan.checkpoint = options.checkpoint();
  plan.precision = options.precision();
  plan.micro_batches = options.micro_batches();
  GPIPE_CHECK(options.virtual_stages() >= 0, "the number of stages per device V must be at least 1, or 0 for the "
              "schedule's own (got ", options.virtual_stages(), ")");
  const int V = options.virtual_stages() > 0 ? options.virtual_stages() : default_virtual_stages(options.schedule());
  check_virtual_stages(options.schedule(), V);
  plan.virtual_stages = V;
  GPIPE_CHECK(options.devices() >= 0, "the number of devices K must be at least 1, or 0 to take it from the balance "
              "(got ", options.devices(), ")");
  const std::string per_device = V > 1 ? " x " + std::to_string(V) + " stages per device" : "";
  const CutRequest& request = options.cut();
  plan.cut = request.kind;
  if (request.kind == CutKind::kGiven) {
    check_balance(request.balance, layers);
    plan.balance = request.balance;
    const int S = plan.stages();
    GPIPE_CHECK(S % V == 0, "the balance ", format_balance(plan.balance), " has ", S, S == 1 ? " stage" : " stages",
                ", not a multiple of V = ",
                V, " stages per device; give K·V entries, or give K alone and let gpipe cut evenly");
    GPIPE_CHECK(options.devices() == 0 || options.devices() * V == S, "K = ", options.devices(), " devices", per_device,
                " and the balance's ", S, " stages disagree; give one of them");
  } else {
    GPIPE_CHECK(options.devices() >= 1, "the number of devices K is not given; give K (1 <= K·V <= ", layers,
                ") or a balance");
    const auto count = [](int n, const char* what) { return std::to_string(n) + " " + what + (n == 1 ? "" : "s"); };
    const ScheduleTraits& traits = schedule_traits(options.schedule());
    // A V the schedule fixes (the V schedules' 2) needs that many layers; a chosen one (interleaved's)
    // is named by the check below.
    GPIPE_CHECK(traits.chooses_virtual_stages() || V <= layers, "cannot cut ", count(layers, "layer"), " into ",
                count(options.devices(), "device"), per_device, ": every stage needs at least one layer, so the ",
                traits.name, " schedule with ", V, " stages per device needs at least ", V,
                " layers; use a schedule of one stage per device (gpipe or 1f1b)");
    const int K = options.devices();
    if (K * V > layers) {
      // The ways out: fewer stages per device (where the schedule lets V be chosen), fewer devices.
      std::vector<std::string> ways;
      if (V > 1 && traits.chooses_virtual_stages() && layers / K >= traits.least_virtual_stages)
        ways.push_back("with " + std::to_string(K) + " devices use at most " + std::to_string(layers / K) +
                       " stages per device");
      if (layers / V >= 1)
        ways.push_back("use at most " + count(layers / V, "device") +
                       (V > 1 ? " of " + std::to_string(V) + " stages" : std::string()));
      if (ways.empty()) ways.push_back("use a model with more layers");
      GPIPE_CHECK(false, "cannot cut ", count(layers, "layer"), " into ", count(K, "device"), per_device,
                  V > 1 ? " (" + std::to_string(K * V) + " stages)" : std::string(),
                  ": every stage needs at least one layer, so there can be at most ", layers, " stages; ", ways[0],
                  ways.size() > 1 ? ", or " + ways[1] : std::string());
    }
    plan.balance = request.resolve(layers, K * V, place_stages(traits.placement, K, V));
  }
  plan.devices = plan.stages() / V;
  const int K = plan.devices;
  GPIPE_CHECK(plan.micro_batches >= 1, "the number of micro-batches M must be at least 1 (got ", plan.micro_batches,
              ")");
  // Checked before the programs are built, whose size grows with M.
  GPIPE_CHECK(plan.micro_batches <= kMostMicroBatches, "M = ", plan.micro_batches, " micro-batches (`micro_batches`) "
              "is more than gpipe plans (", kMostMicroBatches, "): every micro-batch needs at least one row, and a "
              "batch of fewer rows than M runs in one micro-batch per row, so an M above a batch's rows only costs "
              "time and memory; give M at most the rows of a batch");

  check_stage_times(options.stage_times(), plan.stages());
  plan.stage_times = options.stage_times();
  plan.program = options.program();
  // The programs, with the skip connections that cross stages: a schedule that cannot take K, M and V
  // is refused here, before anything is built.
  route_skips(plan, skips);

  plan.device_list = options.device_list();
  if (plan.device_list.empty()) {
    GPIPE_CHECK(options.threads_per_device() >= 1, "the intra-op threads per device must be at least 1 (got ",
                options.threads_per_device(), ")");
    check_threads_per_device(options.threads_per_device());
    plan.device_list.assign(static_cast<size_t>(K), Device::cpu(options.threads_per_device()));
  }
  GPIPE_CHECK(static_cast<int>(plan.device_list.size()) == K, "got ", plan.device_list.size(), " devices in the "
              "device list for ", K, " devices (", plan.stages(), " stages", per_device, "); give ", K);
  for (const Device& device : plan.device_list) check_device(device);
  for (const auto& group : options.tied_parameters())
    GPIPE_CHECK(group.size() >= 2, "a group of tied parameters needs at least two names (got ", group.size(), ")");
  return plan;
}

}  // namespace gpipe
