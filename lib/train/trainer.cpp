#include "train/trainer.hpp"

#include <omp.h>
#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <exception>
#include <numeric>

#include <fmt/format.h>

#include "config/model_checks.hpp"
#include "config/parse.hpp"
#include "core/atomic_file.hpp"
#include "core/checked.hpp"
#include "core/compute_thread.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"
#include "data/pipeline.hpp"
#include "distribute/agreement.hpp"
#include "dtrain/build_info.hpp"
#include "train/memory_estimate.hpp"
#include "checkpoint/run_dir.hpp"

namespace dtrain::train {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// The model's outputs per example (the last dimension of its output): what `accuracy` resolves by.
std::int64_t model_outputs(const nn::Sequential& model) {
  const Shape& shape = model.output_shape();
  return shape.rank() > 0 ? shape.dims().back() : 1;
}

// What a replica's layers reach of the other replicas: the strategy's sums inside run().
class StrategyCrossReplica final : public nn::CrossReplica {
 public:
  StrategyCrossReplica(distribute::Strategy& strategy, distribute::ReplicaContext replica)
      : strategy_(strategy), replica_(replica) {}
  void all_reduce_sum(std::span<double> values, const char* what) override {
    strategy_.all_reduce_sum_in_replica(replica_, values, what);
  }

 private:
  distribute::Strategy& strategy_;
  distribute::ReplicaContext replica_;
};

// What checkpoint::restore cannot know: whether the stored metric state fits this experiment's
// metrics. One of another layout is a corrupt or foreign file, refused as such before anything is
// merged from it.
void check_metric_state(const std::string& path, const checkpoint::TrainingState& state,
                        const std::vector<std::unique_ptr<metrics::Metric>>& metrics) {
  if (state.step_in_epoch == 0 && state.metric_counts.empty()) return;  // an epoch boundary carries no metrics
  if (state.metric_counts.size() != metrics.size())
    throw InputError(fmt::format("{}: /state/metrics holds {} metrics, the experiment has {}; the checkpoint is corrupt",
                                 path, state.metric_counts.size(), metrics.size()));
  for (std::size_t i = 0; i < metrics.size(); ++i) {
    const metrics::MetricState layout = metrics[i]->state();
    const auto& counts = state.metric_counts[i];
    const bool counts_ok = std::all_of(counts.begin(), counts.end(), [](std::int64_t n) { return n >= 0; });
    if (counts.size() != layout.counts.size() || state.metric_sums[i].size() != layout.sums.size() || !counts_ok)
      throw InputError(fmt::format("{}: /state/metrics/{} holds {} counts and {} sums{}, metric {} keeps {} and {}; "
                                   "the checkpoint is corrupt",
                                   path, i, counts.size(), state.metric_sums[i].size(), counts_ok ? "" : " (negative)",
                                   metrics[i]->name(), layout.counts.size(), layout.sums.size()));
  }
}

// What checkpoint::restore cannot know either: that the optimizer's update count fits the steps
// taken. A step applies one update, so a run's optimizer has made global_step of them; only under
// a strategy that schedules its own steps (parameter servers) can a step's update land twice (its
// worker, declared lost after it pushed, has the step run again elsewhere), which still makes at
// most twice as many. Anything else (a count of 2^62 after 6 steps) would restart the
// learning-rate schedule and Adam's bias correction from a corrupt value.
void check_update_count(const std::string& path, const checkpoint::TrainingState& state, std::int64_t iterations) {
  const std::int64_t steps = state.global_step;
  if (iterations >= steps && iterations - steps <= steps) return;  // both at most 2^62: no overflow
  const std::vector<std::string_view> rescheduling = distribute::kinds_with_own_loop();
  throw InputError(fmt::format("{}: /optimizer iterations is {} but /state/global_step is {}; training applies one "
                               "update per step{}, so the checkpoint is corrupt",
                               path, iterations, steps,
                               rescheduling.empty() ? std::string()
                                                    : fmt::format(" ({} at most two)", fmt::join(rescheduling, ", "))));
}

// The loss as it describes the model's outputs, what the metrics are made with: probabilities
// where the model ends in a softmax or sigmoid (Sequential::output_activation), whatever
// from_logits says (binary_accuracy then thresholds them at 0.5, as Keras' does).
config::LossConfig loss_of_outputs(config::LossConfig loss, const nn::Sequential& model) {
  if (model.output_activation() != config::Activation::linear) loss.from_logits = false;
  return loss;
}

}  // namespace

void cap_instruction_set(const config::Experiment& experiment) {
  if (experiment.reproducibility.isa == config::IsaCap::native) return;
  try {
    device::cap_instruction_set(Device::Kind::cpu, config::name_of(experiment.reproducibility.isa));
  } catch (const ConfigError& e) {
    throw ConfigError(config::given_prefix(experiment.reproducibility.isa_where, {experiment.source_file, 0, 0}) +
                      e.what());
  }
}

int resolve_threads(int configured) {
  if (configured > 0) return configured;
  int cores = std::max(1, omp_get_num_procs());
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = std::max(1, CPU_COUNT(&set));
  // Ranks on one node share its cores (OpenMPI tells each rank how many it has on the node).
  if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) cores = std::max(1, cores / std::max(1, std::atoi(local)));
  return cores;
}

Trainer::Trainer(config::Experiment experiment, TrainerOptions options)
    : exp_(std::move(experiment)), opt_(std::move(options)) {
  threads_ = resolve_threads(exp_.train.threads);
  cap_instruction_set(exp_);
  strategy_ = distribute::make_strategy(exp_.strategy, threads_, job());
  // The experiment against the job's worker count: every worker finds the same at the same point,
  // so the chief alone reports it (JobConfigError), at the key that decides it.
  const auto for_every_worker = [](const std::string& where, const std::function<void()>& check) {
    try {
      check();
    } catch (const ConfigError& e) {
      throw JobConfigError(where + e.what());
    }
  };
  for_every_worker(config::given_prefix(exp_.data_where, {exp_.source_file, 0, 0}), [&] {
    shards_ = data::plan_shards(exp_.data, strategy_->workers(), strategy_->worker_index());
  });
  const config::BatchKey batch = config::batch_key(exp_, false), eval_batch = config::batch_key(exp_, true);
  // Evaluation alone batches by the evaluation batch only (dtrain eval sets it).
  const auto check_training_batch = [&] {
    data::check_batch_reaches_workers(shards_.workers, strategy_->num_local_replicas(), shards_.train_shard_count() > 1,
                                      global_batch_size(), batch.name);
    data::check_global_batch(shards_, global_batch_size());
    // Per-replica pipelines batch alone and cannot split a remainder (evaluation always splits).
    if (exp_.data.distribute == config::DistributeMode::per_replica)
      data::InputContext{.num_replicas_in_sync = static_cast<int>(strategy_->num_replicas_in_sync())}
          .get_per_replica_batch_size(global_batch_size());
  };
  if (opt_.purpose != TrainerOptions::Purpose::evaluate) for_every_worker(batch.where, check_training_batch);
  if (exp_.data.eval_batch_size > 0)
    for_every_worker(eval_batch.where, [&] {
      data::check_batch_reaches_workers(shards_.workers, strategy_->num_local_replicas(), shards_.eval_shard_count() > 1,
                                        exp_.data.eval_batch_size, eval_batch.name);
    });
  if (!strategy_->is_chief()) {
    // Workers other than the chief compute and take part in every collective, silently.
    null_out_ = std::fopen("/dev/null", "w");
    opt_.out = null_out_;
    opt_.out_is_tty = false;
    opt_.run_dir.clear();
  }
  prepare_compute_thread(strategy_->threads_per_replica());  // the calling thread is replica 0 when alone
  const int replicas = strategy_->num_local_replicas();
  if (opt_.hold.active() && opt_.hold.step == 0)
    hold_here(opt_.hold, opt_.workers ? opt_.workers->rank() : 0, "before the model is built");
  // The data first: its splits' sizes bound the batches the memory estimate counts (a batch
  // larger than a split is one batch of the whole split).
  // A data file's errors name the file; they are also located at the key that chose it (data.path,
  // data.shards, or the data section for a source's default).
  const std::string at_data = config::given_prefix(exp_.data_where, {exp_.source_file, 0, 0});
  // Every process of the job loads its data and they agree on the outcome (a file none of them
  // can read is the chief's one error, without an abort).
  const auto load = [&] {
    try {
      splits_ = data::load_splits(exp_.data, exp_.seed, shards_.files);
    } catch (const data::ValidationSplitError& e) {
      throw ConfigError(config::given_prefix(exp_.validation_split_where, {exp_.source_file, 0, 0}) + e.what());
    } catch (const InputError& e) {
      throw InputError(at_data + e.what());
    }
  };
  distribute::agree_on_every_worker(job(), "loading the data", load);

  // Built on every worker, which then check the data against the model; the workers agree on
  // the outcome, as on the loading: a rank that alone fails (its own files, its own memory or
  // cores) reports it with its rank, and no other waits for it in a collective.
  const auto build_replicas = [&] {
    // In the strategy's scope, per replica: the model, its loss and metrics, and the optimizer.
    // Every replica builds its model from the same seed, so mirrored copies start identical; under
    // central storage the replicas compute with the parameter device's replica's variables. With
    // train.parallelism: batch each of a replica's threads is a lane (train/lanes.hpp) with its own
    // model computing with the replica's variables.
    replicas_.resize(static_cast<std::size_t>(replicas));
    const bool invariant = exp_.reproducibility.invariant();
    if (invariant) invariant_lanes(false);  // what the mode refuses, before anything is built
    int lanes = exp_.train.parallelism == config::Parallelism::batch ? strategy_->threads_per_replica() : 1;
    for (int r = 0; r < replicas; ++r) {
      Replica& rep = replicas_[static_cast<std::size_t>(r)];
      static_cast<Lane&>(rep) = make_lane(r, r == 0);
      if (r == 0) config::check_loss_fits_model(exp_, rep.model->output_shape().dims());
      if (r == 0 && exp_.loss.from_logits && rep.model->output_activation() != config::Activation::linear &&
          warns_of_experiment())
        fmt::print(stderr,
                   "dtrain: warning: {}loss.from_logits is true, but the model's outputs come from the {} of layer '{}', "
                   "so they are probabilities; as Keras does, the loss is computed from the {}'s input: say from_logits: "
                   "false, or end the model with activation: linear\n",
                   config::given_prefix(exp_.loss.where, {exp_.source_file, 0, 0}),
                   config::name_of(rep.model->output_activation()), rep.model->layer(rep.model->output_activation_from()).name(),
                   config::name_of(rep.model->output_activation()));
      if (r == 0 && invariant) lanes = invariant_lanes(rep.model->synchronizes_replicas());
      device::Numerics& numerics = rep.ctx->numerics();
      rep.optimizer = optim::make_optimizer(exp_.optimizer, numerics);
      rep.optimizer->place_slots(*rep.ctx);
      if (r == 0) strategy_->set_collectives_in_backward(rep.model->synchronizes_replicas());
      strategy_->bind_gradients(r, *rep.ctx, rep.model->gradient_arena(), rep.model->gradient_sizes());
      rep.gradients_ready = [this, rc = strategy_->replica_context(r)](std::size_t first, std::size_t count) {
        strategy_->gradients_ready(rc, first, count);
      };
      rep.cross_replica = std::make_unique<StrategyCrossReplica>(*strategy_, strategy_->replica_context(r));
      // Lanes share their replica's variables and sum into its gradients in place: CPU threads over
      // memory the host reads. A replica on other memory (a GPU, the checked mode) is one lane.
      if (invariant && !rep.ctx->host_accessible())
        throw ConfigError(fmt::format("{}reproducibility.mode replica_invariant computes each micro-batch on a CPU "
                                      "thread over memory the host reads, and {} is not such a device{}; use CPU "
                                      "devices or mode fast",
                                      config::given_prefix(exp_.reproducibility.where, {exp_.source_file, 0, 0}),
                                      strategy_->replica_device(r).to_string(),
                                      std::getenv("DTRAIN_CHECKED_MEMORY") ? " (DTRAIN_CHECKED_MEMORY is set)" : ""));
      if (lanes > 1 && rep.ctx->host_accessible()) {
        for (int l = 1; l < lanes; ++l) rep.more_lanes.push_back(make_lane(r));
        rep.lanes = std::make_unique<Lanes>(lanes);
        for (int l = 0; l < lanes; ++l) {
          rep.lane(l).lane_statistics = std::make_unique<LaneStatistics>(*rep.lanes, l);
          rep.lane(l).lanes_then_replicas = std::make_unique<LanesThenReplicas>(*rep.lanes, l, *rep.cross_replica);
          if (invariant)
            rep.lane(l).micro_statistics = std::make_unique<MicroBatchStatistics>(*rep.lane(l).lanes_then_replicas);
        }
      } else if (invariant) {
        // One lane: the replica's own thread, whose OpenMP team is one thread (invariant_lanes).
        rep.micro_statistics = std::make_unique<MicroBatchStatistics>(*rep.cross_replica);
      }
    }
    std::vector<std::vector<Variable*>> variables;
    for (const Replica& rep : replicas_) variables.push_back(rep.model->variables());
    strategy_->place_variables(variables);
    // A replica's lanes compute with its variables (after placement: under central storage those
    // may be the holder's).
    for (Replica& rep : replicas_)
      for (Lane& lane : rep.more_lanes) {
        const std::vector<Variable*>& mine = lane.model->variables();
        for (std::size_t v = 0; v < mine.size(); ++v) mine[v]->value = rep.model->variables()[v]->value;
      }
  };
  replica_losses_.assign(static_cast<std::size_t>(replicas), 0.0);
  train_fn_ = [this](const distribute::ReplicaContext& rc) { replica_train_step(rc); };
  eval_fn_ = [this](const distribute::ReplicaContext& rc) { replica_eval_step(rc); };

  // Integer labels a crossentropy loss cannot take are found now, naming the file and the sample,
  // not when their batch trains. Where the source declares no class count (idx, hdf5 without
  // num_classes: the largest label plus one), a label past the model's outputs is reported as the
  // data's, with its file and sample, before the model is compared with the classes; a source
  // that declares its classes (num_classes, fashion_mnist) has the model compared with them first.
  const auto check_labels = [this] {
    const Shape& outputs = model().output_shape();
    if (outputs.rank() != 1) return;  // check_loss_fits_model explains what the loss needs
    if (exp_.loss.kind == config::LossKind::binary_crossentropy) data::check_label_range(splits_, 2);
    else if (exp_.loss.kind != config::LossKind::mean_squared_error) data::check_label_range(splits_, outputs[0]);
    if (exp_.loss.kind == config::LossKind::binary_crossentropy ||
        exp_.loss.kind == config::LossKind::categorical_crossentropy)
      data::check_probability_targets(splits_, config::name_of(exp_.loss.kind));
  };
  // Each worker checks the data it loaded (under auto_shard: file, files of its own) against the
  // model it built.
  const auto check_data = [&] {
    if (splits_.train.classes_from_labels) check_labels();
    // The loaded labels, which validate cannot see for every source (hdf5), against the loss.
    const bool class_ids = splits_.train.y.dtype() == DType::i32;
    config::check_loss_fits_model(exp_, model().output_shape().dims(),
                                  config::LabelKind{class_ids, splits_.train.num_classes,
                                                    class_ids ? 0 : splits_.train.y.shape().tail().numel()});
    // The largest batch a replica holds in training and in evaluation (never more than the split),
    // against the memory, naming the batch key and the layer that decide it.
    const std::int64_t in_sync = strategy_->num_replicas_in_sync();
    const std::int64_t eval_global = exp_.data.eval_batch_size > 0 ? exp_.data.eval_batch_size : global_batch_size();
    const std::int64_t eval_samples =
        std::max(splits_.test.size(), splits_.validation ? splits_.validation->size() : std::int64_t{0});
    if (opt_.purpose != TrainerOptions::Purpose::evaluate)
      model().check_batch_memory(std::min(ceil_div(global_batch_size(), in_sync), splits_.train.size()), batch);
    model().check_batch_memory(std::min(ceil_div(eval_global, in_sync), eval_samples), eval_batch);
    const Shape sample = splits_.train.x.shape().tail();
    if (sample != model().input_shape())
      throw ConfigError(fmt::format("{}model.input_shape {} does not match the data's sample shape {}",
                                    config::given_prefix(exp_.input_shape_where, {exp_.source_file, 0, 0}),
                                    model().input_shape().to_string(), sample.to_string()));
    check_labels();
  };
  const auto build_and_check = [&] {
    build_replicas();
    check_data();
  };
  distribute::agree_on_every_worker(job(), "building the model or checking the data", build_and_check);
  // The job's test split: under auto_shard: file each worker holds its own files' part of it, and
  // a worker whose part is empty still evaluates (its replicas take empty batches).
  if (job().all_reduce_max(splits_.test.size() > 0 ? 1 : 0, "test split sizes") == 0) {
    const bool several = job().size() > 1;
    const std::string message = fmt::format("{}the test split of {} is empty{}, so evaluation would report nothing; "
                                            "give the data a test split",
                                            at_data, splits_.test.description, several ? " on every worker" : "");
    if (several) throw JobConfigError(message);  // every worker finds it: the chief reports it
    throw InputError(message);
  }
  // Micro-batches of one sample leave a batch normalization of flat features (after dense or
  // flatten) that is not synchronized nothing to normalize over: each feature's variance is 0, its
  // output its beta whatever the input, so nothing below it learns. Over an image's positions one
  // sample still has statistics.
  if (exp_.reproducibility.invariant() && exp_.reproducibility.micro_batch_size == 1 && warns_of_experiment())
    for (std::size_t i = 0; i < model().num_layers(); ++i) {
      const nn::Layer& layer = model().layer(i);
      if (layer.kind() == "batch_normalization" && !layer.synchronizes_replicas() && layer.input_shape().rank() == 1)
        fmt::print(stderr, "dtrain: warning: {}reproducibility.micro_batch_size 1 normalizes layer '{}' over one sample "
                   "at a time: each feature's variance is 0 and its output its beta, so the layers below it learn "
                   "nothing; use micro-batches of several samples, or synchronized: true\n",
                   config::given_prefix(exp_.reproducibility.where, {exp_.source_file, 0, 0}), layer.name());
    }
}

void Trainer::check_stored_state(const std::string& path, const checkpoint::TrainingState& state,
                                 const config::Experiment& stored) const {
  std::vector<std::unique_ptr<metrics::Metric>> kept;
  for (auto kind : stored.metrics)
    kept.push_back(metrics::make_metric(kind, loss_of_outputs(stored.loss, *replicas_[0].model),
                                        model_outputs(*replicas_[0].model), replicas_[0].ctx->numerics()));
  check_metric_state(path, state, kept);
}

void Trainer::note_resume_changes(const checkpoint::TrainingState& state) const {
  if (state.seed != exp_.seed)
    fmt::print(stderr, "dtrain: warning: the checkpoint was trained with seed {}, the experiment says {}: the data order "
                       "from here on follows seed {}\n", state.seed, exp_.seed, exp_.seed);
  const std::int64_t replicas = strategy_->num_replicas_in_sync(), workers = strategy_->workers();
  if (state.global_batch > 0 && state.global_batch != global_batch_size()) {
    fmt::print(stderr, "dtrain: warning: the checkpoint was trained with a global batch of {}, this run's is {}{}: the "
                       "rest of this run will differ from a run that was never stopped; set data.global_batch_size: {} "
                       "to keep it\n",
               state.global_batch, global_batch_size(),
               exp_.data.global_batch_size > 0 ? "" : " (data.batch_size_per_replica times the replicas in sync)",
               state.global_batch);
    return;
  }
  if (state.replicas_in_sync <= 0 || (state.replicas_in_sync == replicas && state.workers == workers)) return;
  const auto count = [](std::int64_t replicas_in_sync, std::int64_t processes) {
    return fmt::format("{} replica{} in {} process{}", replicas_in_sync, replicas_in_sync == 1 ? "" : "s", processes,
                       processes == 1 ? "" : "es");
  };
  const std::string layout = fmt::format("the checkpoint was written by {}, this run has {}",
                                         count(state.replicas_in_sync, state.workers), count(replicas, workers));
  // Under auto_shard: file each worker reads files of its own (under off, all of them in an order
  // of its own): with another worker count the workers' batches are made of other samples, not
  // only summed in another order. (Under data every worker keeps its share of one order.)
  const auto policy_of = [&](std::int64_t job_workers) {
    try {
      return job_workers > 1 ? data::plan_shards(exp_.data, static_cast<int>(job_workers), 0).policy
                             : config::AutoShardPolicy::data;
    } catch (const ConfigError&) {
      return config::AutoShardPolicy::data;
    }
  };
  const config::AutoShardPolicy before = policy_of(state.workers), now = policy_of(workers);
  if (state.workers != workers && (before != config::AutoShardPolicy::data || now != config::AutoShardPolicy::data)) {
    const bool file = before == config::AutoShardPolicy::file || now == config::AutoShardPolicy::file;
    fmt::print(stderr, "dtrain: warning: {}; under data.auto_shard: {} each worker reads {}, so from here on the "
                       "batches are made of other samples than in a run that was never stopped{}; resume on {} "
                       "process{} to continue as the run would have\n",
               layout, file ? "file" : "off", file ? "files of its own" : "all the data in an order of its own",
               state.step_in_epoch > 0
                   ? fmt::format(", and epoch {} goes on from step {} of each worker's new {}: some of its samples "
                                 "are left out and others seen twice",
                                 state.epoch + 1, state.step_in_epoch, file ? "files" : "order")
                   : "",
               state.workers, state.workers == 1 ? "" : "es");
    return;
  }
  // A batch normalization that is not synchronized normalizes by each replica's share of the
  // batch: with another replica count it computes another function (replica_invariant
  // normalizes by micro-batches instead, which the replica count does not change).
  if (state.replicas_in_sync != replicas && !exp_.reproducibility.invariant())
    for (std::size_t i = 0; i < replicas_[0].model->num_layers(); ++i) {
      const nn::Layer& layer = replicas_[0].model->layer(i);
      if (layer.kind() != "batch_normalization" || layer.synchronizes_replicas()) continue;
      fmt::print(stderr, "dtrain: warning: {}; layer '{}' normalizes by each replica's share of the batch (it is not "
                         "synchronized), so with {} replicas instead of {} it computes another function: the rest of "
                         "the run differs from one that was never stopped (synchronized: true, or reproducibility.mode: "
                         "replica_invariant, makes it independent of the replica count)\n",
                 layout, layer.name(), replicas, state.replicas_in_sync);
      return;
    }
  if (exp_.reproducibility.invariant())
    fmt::print(stderr, "dtrain: {}; reproducibility: replica_invariant keeps the bits: the run goes on exactly as it "
                       "would have on the layout that wrote the checkpoint\n", layout);
  else
    fmt::print(stderr, "dtrain: note: {}; sums are now taken in another order, so the rest of the run will differ in the "
                       "last bits from one that was never stopped (reproducibility.mode: replica_invariant keeps them)\n",
               layout);
}

Trainer::~Trainer() {
  // Torn down by an error (another worker lost, a collective that timed out): a device sum this
  // process queued may still wait for a peer, and the replicas' contexts, destroyed next, wait for
  // their streams.
  if (std::uncaught_exceptions() > 0 && strategy_) strategy_->abandon_device_sums();
  if (null_out_) std::fclose(null_out_);
}

Trainer::Lane Trainer::make_lane(int replica, bool check_run_memory) const {
  Lane lane;
  try {
    lane.ctx = device::make_context(strategy_->replica_device(replica));
  } catch (const ConfigError& e) {
    throw ConfigError(config::location_prefix(exp_.strategy.devices_where, exp_.strategy.where) + e.what());
  }
  nn::check_precision(exp_.precision, exp_.precision_where, *lane.ctx);
  device::Numerics& numerics = lane.ctx->numerics();
  nn::ModelOptions model_options;
  model_options.compute = nn::compute_dtype(exp_.precision);
  model_options.crossentropy_from_pre_activation = losses::reads_activation_input(exp_.loss.kind);
  if (check_run_memory)
    model_options.before_allocating = [this, &numerics](const nn::Sequential& declared) {
      const std::int64_t in_sync = strategy_->num_replicas_in_sync();
      const std::int64_t eval_global = exp_.data.eval_batch_size > 0 ? exp_.data.eval_batch_size : global_batch_size();
      RunCopies copies;
      copies.replicas = strategy_->num_local_replicas();
      copies.lanes = exp_.reproducibility.invariant() ? invariant_lanes(declared.synchronizes_replicas())
                     : exp_.train.parallelism == config::Parallelism::batch ? strategy_->threads_per_replica()
                                                                             : 1;
      copies.optimizer_slots = static_cast<int>(optim::make_optimizer(exp_.optimizer, numerics)->slot_names().size());
      const std::int64_t eval_samples =
          std::max(splits_.test.size(), splits_.validation ? splits_.validation->size() : std::int64_t{0});
      // Evaluation alone (dtrain eval) holds no training batch.
      copies.train_batch = opt_.purpose == TrainerOptions::Purpose::evaluate
                               ? 0
                               : std::min(ceil_div(global_batch_size(), in_sync),
                                          std::max<std::int64_t>(1, splits_.train.size()));
      copies.eval_batch = std::min(ceil_div(eval_global, in_sync), std::max<std::int64_t>(1, eval_samples));
      copies.train_key = config::batch_key(exp_, false);
      copies.eval_key = config::batch_key(exp_, true);
      train::check_run_memory(declared, copies, usable_memory());
    };
  // A signal while a large model's variables are made ends the run there (nothing to save yet).
  if (opt_.stop_requested)
    model_options.should_stop = [requested = opt_.stop_requested] { return requested->load() != 0; };
  lane.model = std::make_unique<nn::Sequential>(exp_.model, exp_.seed, *lane.ctx, model_options);
  // As Keras 3 computes a crossentropy inside a tf.function (every step of a custom training loop,
  // fit and evaluate): from the input of the softmax or sigmoid that made the predictions, as
  // from logits, whatever from_logits says (docs/strategies.md). The metrics read the predictions.
  config::LossConfig loss = exp_.loss;
  if (lane.model->output_activation() != config::Activation::linear) loss.from_logits = true;
  lane.loss = losses::make_loss(loss, numerics);
  const config::LossConfig outputs = loss_of_outputs(exp_.loss, *lane.model);
  for (auto kind : exp_.metrics) {
    lane.train_metrics.push_back(metrics::make_metric(kind, outputs, model_outputs(*lane.model), numerics));
    lane.eval_metrics.push_back(metrics::make_metric(kind, outputs, model_outputs(*lane.model), numerics));
  }
  return lane;
}

std::int64_t Trainer::global_batch_size() const {
  if (exp_.data.global_batch_size > 0) return exp_.data.global_batch_size;
  const auto global = checked_mul(exp_.data.batch_size_per_replica, strategy_->num_replicas_in_sync());
  if (!global)
    // First computed inside the constructor's check, which names where the batch was given.
    throw ConfigError(fmt::format("data.batch_size_per_replica {} times {} replicas in sync does not fit in 64 bits; "
                                  "choose a batch that the machine can hold",
                                  exp_.data.batch_size_per_replica, strategy_->num_replicas_in_sync()));
  return *global;
}

std::string Trainer::header_line() const {
  const int replicas = strategy_->num_local_replicas();
  std::string threads = replicas > 1 ? fmt::format("{} ({} per replica", threads_, strategy_->threads_per_replica())
                                     : fmt::format("{}", threads_);
  const int lanes = replicas_[0].lane_count();
  const bool invariant = exp_.reproducibility.invariant();
  if (lanes > 1)
    threads += fmt::format("{}{} over {} lanes", replicas > 1 ? ", " : " (",
                           invariant ? "micro-batches" : "batch split", lanes);
  if (replicas > 1 || lanes > 1) threads += ")";
  const std::string reproducibility =
      invariant ? fmt::format(" | reproducibility replica_invariant, micro-batch {}", exp_.reproducibility.micro_batch_size)
                : std::string();
  return fmt::format("dtrain {} | experiment {} | {} | global batch {} | learning rate {:g} | threads {} | {} | "
                     "precision {}{}",
                     build_info::version, exp_.name, strategy_->describe(), global_batch_size(),
                     replicas_[0].optimizer->learning_rate(), threads, replicas_[0].ctx->describe(),
                     config::name_of(exp_.precision), reproducibility);
}

void Trainer::write_run_files() {
  if (opt_.run_dir.empty()) return;
  std::error_code ec;
  fs::create_directories(opt_.run_dir, ec);
  if (ec) throw IoError(fmt::format("cannot create the run directory {}: {}; pass --run-dir to choose another",
                                    opt_.run_dir, ec.message()));
  // Written like a checkpoint's manifest: a failure says why (read-only, full, permissions), and a
  // crash leaves the previous config.yaml of a resumed run whole.
  write_file_atomically((fs::path(opt_.run_dir) / "config.yaml").string(),
                                    fmt::format("# resolved experiment, written by dtrain {}\n{}", build_info::version,
                                                config::to_yaml(exp_)));
}

std::string Trainer::checkpoint_dir() const { return checkpoint::checkpoint_dir_of(opt_.run_dir, exp_.checkpoint); }

std::string Trainer::save_checkpoint(std::int64_t epoch, std::int64_t step_in_epoch, double loss_sum,
                                     std::int64_t samples) {
  // Every worker takes part in combining the metrics; only the chief writes.
  std::vector<metrics::MetricState> states;
  for (std::size_t i = 0; step_in_epoch > 0 && i < exp_.metrics.size(); ++i)
    states.push_back(merged_metric_state(true, i));
  if (!strategy_->is_chief()) return {};
  open_checkpoints();
  if (!checkpoints_) return {};
  checkpoint::Contents c;
  c.state.epoch = epoch;
  c.state.step_in_epoch = step_in_epoch;
  c.state.global_step = global_step_;
  c.state.seed = exp_.seed;
  c.state.epoch_loss_sum = loss_sum;
  c.state.epoch_samples = samples;
  c.state.replicas_in_sync = strategy_->num_replicas_in_sync();
  c.state.workers = strategy_->workers();
  c.state.global_batch = global_batch_size();
  // At an epoch boundary the next epoch starts its metrics afresh: nothing to carry over.
  for (const metrics::MetricState& st : states) {
    c.state.metric_counts.push_back(st.counts);
    c.state.metric_sums.push_back(st.sums);
  }
  c.experiment_yaml = config::to_yaml(exp_);
  c.dtrain_version = build_info::version;
  // One copy, whatever the strategy: the primary replica's, whose values every replica computes with.
  const Replica& primary = replicas_[static_cast<std::size_t>(strategy_->primary_replica())];
  return checkpoints_->save(global_step_, *primary.model, *primary.optimizer, c);
}

void Trainer::open_checkpoints() {
  if (checkpoints_ || !strategy_->is_chief()) return;
  const std::string dir = checkpoint_dir();
  if (!dir.empty()) checkpoints_ = std::make_unique<checkpoint::CheckpointManager>(dir, exp_.checkpoint.max_to_keep);
}

checkpoint::TrainingState Trainer::restore(const std::string& checkpoint_path) {
  const int primary = strategy_->primary_replica();
  Replica& first = replicas_[static_cast<std::size_t>(primary)];
  checkpoint::Contents c = checkpoint::restore(checkpoint_path, *first.model, *first.optimizer);
  // The other copies get the primary's values and slots; replicas holding no copy share its values.
  auto& vars0 = first.model->variables();
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    Replica& rep = replicas_[r];
    if (static_cast<int>(r) == primary) continue;
    // Between two replicas' contexts through the host: a restore happens once.
    const auto copy_over = [&](const Tensor& from, Tensor& to) {
      rep.ctx->copy_from_host(first.ctx->download(from).raw(), to);
    };
    auto& vars = rep.model->variables();
    // A replica holding no copy of its own may still keep one it computes with (central storage
    // on memory the host cannot share): it gets the values too.
    for (std::size_t v = 0; v < vars.size(); ++v)
      if (vars[v]->value.raw() != vars0[v]->value.raw()) copy_over(vars0[v]->value, vars[v]->value);
    if (strategy_->holds_variables(static_cast<int>(r))) {
      const auto& trained = rep.model->trainable_variables();
      rep.optimizer->build(trained);
      for (std::size_t v = 0; v < trained.size(); ++v)
        for (std::size_t k = 0; k < rep.optimizer->slot_names().size(); ++k)
          copy_over(first.optimizer->slot(v, k), rep.optimizer->slot(v, k));
    }
    rep.optimizer->set_iterations(first.optimizer->iterations());
  }
  check_metric_state(checkpoint_path, c.state, replicas_[0].train_metrics);
  check_update_count(checkpoint_path, c.state, first.optimizer->iterations());
  // The unfinished epoch's metrics go to replica 0; merging replicas later gives the same totals.
  reset_train_metrics();
  for (std::size_t i = 0; strategy_->is_chief() && i < exp_.metrics.size() && i < c.state.metric_counts.size(); ++i)
    replicas_[0].train_metrics[i]->merge(metrics::MetricState{c.state.metric_counts[i], c.state.metric_sums[i]});
  global_step_ = c.state.global_step;
  resume_ = c.state;
  return c.state;
}

std::unique_ptr<data::DistributedIterator> Trainer::make_iterator(const data::Dataset& split, bool training) const {
  data::PipelineOptions po;
  po.seed = training ? shards_.train_seed(exp_.seed) : exp_.seed;
  // Replicas (and workers) then take whole micro-batches.
  if (exp_.reproducibility.invariant()) po.part_granule = exp_.reproducibility.micro_batch_size;
  po.prefetch = exp_.data.prefetch;
  po.shard_count = training ? shards_.train_shard_count() : shards_.eval_shard_count();
  po.shard_index = po.shard_count > 1 ? shards_.shard_index() : 0;
  data::InputContext ctx;
  ctx.num_input_pipelines = strategy_->workers();
  ctx.input_pipeline_id = strategy_->worker_index();
  ctx.num_replicas_in_sync = strategy_->num_replicas_in_sync();
  std::int64_t global = global_batch_size();
  config::DistributeMode mode = exp_.data.distribute;
  if (training) {
    po.shuffle_buffer = exp_.data.shuffle_buffer;
    po.drop_remainder = exp_.data.drop_remainder;
  } else {
    // Evaluation: every sample exactly once, no shuffle, global batches split over the replicas.
    po.shuffle_buffer = 0;
    mode = config::DistributeMode::split_global_batch;
    if (exp_.data.eval_batch_size > 0) global = exp_.data.eval_batch_size;
  }
  data::DistributedIterator::ShareSizes share_sizes;
  if (strategy_->workers() > 1)
    share_sizes = [strategy = strategy_.get()](std::int64_t mine) {
      return strategy->all_gather(mine, "input share sizes");
    };
  return std::make_unique<data::DistributedIterator>(split, mode, ctx, global, po, share_sizes);
}

nn::StepContext Trainer::step_context(const distribute::ReplicaContext& rc, nn::Mode mode,
                                      const data::ReplicaBatch& batch) const {
  nn::StepContext step;
  step.mode = mode;
  step.seed = exp_.seed;
  step.global_step = global_step_;
  step.replica = rc.global_replica_id;
  step.replicas_in_sync = rc.num_replicas_in_sync;
  step.step_samples = step_samples_;
  step.sample_ids = batch.ids;
  step.cross_replica = replicas_[static_cast<std::size_t>(rc.replica_id)].cross_replica.get();
  return step;
}

nn::StepContext Trainer::lane_step_context(const distribute::ReplicaContext& rc, nn::Mode mode,
                                           const data::ReplicaBatch& batch, int lane, Lanes::Rows rows) const {
  nn::StepContext step = step_context(rc, mode, batch);
  if (!step.sample_ids.empty()) step.sample_ids = step.sample_ids.subspan(static_cast<std::size_t>(rows.begin),
                                                                          static_cast<std::size_t>(rows.size()));
  const Lane& mine = replicas_[static_cast<std::size_t>(rc.replica_id)].lane(lane);
  step.lane = lane;
  step.lanes = mine.lane_statistics.get();
  if (Lanes* lanes = replicas_[static_cast<std::size_t>(rc.replica_id)].lanes.get()) step.shared_work = &lanes->shared_work();
  step.cross_replica = mine.lanes_then_replicas.get();
  return step;
}

nn::StepContext Trainer::micro_batch_context(const distribute::ReplicaContext& rc, nn::Mode mode,
                                             const data::ReplicaBatch& batch, int lane, Lanes::Rows rows) const {
  nn::StepContext step = lane_step_context(rc, mode, batch, lane, rows);
  step.lanes = nullptr;  // batch statistics per micro-batch (ghost batch normalization)
  step.cross_replica = replicas_[static_cast<std::size_t>(rc.replica_id)].lane(lane).micro_statistics.get();
  return step;
}

double Trainer::compute_gradients(Lane& lane, const Tensor& x, const Tensor& y, const nn::StepContext& step,
                                  const nn::BackwardOptions& backward, PhaseClock& phases, bool deferred) {
  const Tensor& predictions = lane.model->forward(x, step);
  phases.mark(Phase::forward);
  lane.per_example.resize(static_cast<std::size_t>(x.shape()[0]));
  // Divide by the samples of the whole step (all replicas and lanes), never by this one's share.
  const bool divide = exp_.loss.reduction != config::Reduction::sum;
  // The per-example losses and the gradient in one pass; deferred, the losses reach the host by
  // settle_step(), when the rest of the step is queued, and the host never waits for the forward
  // pass in the middle of the step.
  const float scale = divide ? 1.0f / static_cast<float>(step_samples_) : 1.0f;
  lane.loss->per_example_and_gradient(lane.model->loss_input(), y, lane.per_example, scale, lane.model->output_gradient(),
                                      deferred);
  // The metrics compare the predictions before backward, which leaves them as they are: deferred,
  // the device's comparisons are queued before backward, so what settle_step() waits for is done early.
  for (auto& m : lane.train_metrics) {
    if (deferred) m->update_deferred(y, predictions);
    else m->update(y, predictions);
  }
  phases.mark(Phase::loss);
  lane.model->backward(step, backward);
  phases.mark(Phase::backward);
  return deferred ? 0.0 : data_loss_of(lane.per_example);
}

double Trainer::data_loss_of(std::span<const float> per_example) const {
  const bool divide = exp_.loss.reduction != config::Reduction::sum;
  return divide ? losses::compute_average_loss(per_example, step_samples_)
                : losses::reduce_loss(per_example, config::Reduction::sum);
}

double Trainer::settle_step(Lane& lane) {
  lane.ctx->numerics().complete_reads();
  for (auto& m : lane.train_metrics) m->settle();
  return data_loss_of(lane.per_example);
}

void Trainer::finish_replica_step(const distribute::ReplicaContext& rc, Replica& rep, double data_loss,
                                  PhaseClock& phases, bool deferred) {
  const double reg = losses::scale_regularization_loss(rep.model->regularization_loss(), rc.num_replicas_in_sync);
  phases.mark(Phase::loss);  // the metrics' updates and the regularization loss
  strategy_->sum_gradients(rc);
  phases.mark(Phase::reduction);
  strategy_->update(rc, [&rep] { apply_update(rep); });
  phases.mark(Phase::optimizer);
  // The whole step is queued: only now does the host wait for its losses and metric rows (on a
  // GPU, for the forward pass and the loss; backward and the update go on meanwhile).
  if (deferred) {
    data_loss = settle_step(rep);
    phases.mark(Phase::loss);
  }
  replica_losses_[static_cast<std::size_t>(rc.replica_id)] = data_loss + reg;
}

void Trainer::apply_update(Replica& rep) {
  const std::span<Variable* const> vars = rep.model->trainable_variables();
  if (!rep.lanes) {
    rep.optimizer->apply_gradients(vars);
  } else {
    // One thread streaming w, g and the slots used to take 1-3 % of a step after the lanes had
    // shared everything else; each lane now updates its own range (the same bits).
    rep.optimizer->begin_update(vars);
    auto update_part = [&rep, vars](int l) { rep.optimizer->update_part(vars, l, rep.lanes->size()); };
    rep.lanes->run(update_part);
    rep.optimizer->end_update();
  }
  rep.model->apply_updates();
}

void Trainer::lanes_train_step(const distribute::ReplicaContext& rc, Replica& rep, const data::ReplicaBatch& batch) {
  StepTimer* profile = rc.replica_id == 0 ? profile_ : nullptr;
  auto lane_step = [&](int l) {
    Lane& lane = rep.lane(l);
    const Lanes::Rows rows = rep.lanes->rows(batch.size, l);
    const nn::StepContext step = lane_step_context(rc, nn::Mode::training, batch, l, rows);
    PhaseClock phases(l == 0 ? profile : nullptr);  // lane 0's timeline is the replica's
    lane.data_loss = 0.0;
    if (rows.size() > 0)
      lane.data_loss = compute_gradients(lane, batch.x.slice_rows(rows.begin, rows.end),
                                         batch.y.slice_rows(rows.begin, rows.end), step, nn::BackwardOptions{}, phases);
    else
      lane.model->step_without_samples(step);  // still takes part in the lanes' sums
    // The replica's gradients: every lane's, summed into lane 0's in lane order.
    rep.lanes->endpoint(l).reduce_sum_to(lane.model->gradient_arena().span<float>(), 0, "lane gradients");
    phases.mark(Phase::backward);
  };
  rep.lanes->run(lane_step);
  PhaseClock phases(profile);
  // The replica adds 1/R of the regularization gradient once, to its lanes' sum.
  rep.model->add_regularization_gradient(1.0f / static_cast<float>(rc.num_replicas_in_sync));
  if (strategy_->overlaps_backward()) rep.gradients_ready(0, rep.model->variables().size());
  double data_loss = 0.0;
  for (int l = 0; l < rep.lane_count(); ++l) data_loss += rep.lane(l).data_loss;
  finish_replica_step(rc, rep, data_loss, phases);
}

void Trainer::replica_train_step(const distribute::ReplicaContext& rc) {
  Replica& rep = replicas_[static_cast<std::size_t>(rc.replica_id)];
  const data::ReplicaBatch& batch = (*step_batches_)[static_cast<std::size_t>(rc.replica_id)];
  if (exp_.reproducibility.invariant()) return invariant_train_step(rc, rep, batch);
  if (rep.lanes) return lanes_train_step(rc, rep, batch);
  const float replicas = static_cast<float>(rc.num_replicas_in_sync);
  const bool overlap = strategy_->overlaps_backward();
  const nn::StepContext step = step_context(rc, nn::Mode::training, batch);
  PhaseClock phases(rc.replica_id == 0 ? profile_ : nullptr);
  double data_loss = 0.0;
  if (batch.size > 0) {
    // Each replica adds 1/R of the regularization gradient: summed over replicas, it is added once.
    // The per-layer hand-over only when the strategy sums across workers while backward runs.
    const auto [x, y] = stage(rep, batch);
    compute_gradients(rep, x, y, step, nn::BackwardOptions{1.0f / replicas, overlap ? &rep.gradients_ready : nullptr},
                      phases, true);
  } else {
    // No samples for this replica on a short last batch: it still adds its share of the
    // regularization gradient and takes part in the collectives.
    rep.model->step_without_samples(step);
    rep.model->add_regularization_gradient(1.0f / replicas);
    if (overlap) rep.gradients_ready(0, rep.model->variables().size());
    phases.mark(Phase::backward);
  }
  finish_replica_step(rc, rep, data_loss, phases, batch.size > 0);
}

namespace {

// `host` copied into `buffer` (memory of `ctx`, grown to the largest batch and then reused): a
// view of it shaped like `host`.
Tensor stage_into(device::Context& ctx, Tensor& buffer, const Tensor& host) {
  if (!host.defined()) return {};
  if (!buffer.defined() || buffer.dtype() != host.dtype() || buffer.numel() < host.numel())
    buffer = ctx.tensor(Shape{std::max<std::int64_t>(1, host.numel())}, host.dtype());
  Tensor view = buffer.view(0, host.shape());
  DTRAIN_CHECK(host.host_accessible(), "a batch to stage that is not in host memory");
  ctx.copy_from_host(host.raw(), view);
  return view;
}

}  // namespace

std::pair<Tensor, Tensor> Trainer::stage(Lane& lane, const data::ReplicaBatch& batch) {
  if (lane.ctx->host_accessible()) return {batch.x, batch.y};  // the kernels read the host's batch
  return {stage_into(*lane.ctx, lane.staged_x, batch.x), stage_into(*lane.ctx, lane.staged_y, batch.y)};
}

namespace {

// fn(lane) on every lane of `rep`: on its lanes' threads, or on this thread when it has one.
template <class Replica, class Fn>
void run_lanes(Replica& rep, Fn& fn) {
  if (rep.lanes) rep.lanes->run(fn);
  else fn(0);
}

}  // namespace

int Trainer::invariant_lanes(bool synchronizes) const {
  const config::ReproducibilityConfig& mode = exp_.reproducibility;
  const std::string at = config::given_prefix(mode.where, {exp_.source_file, 0, 0});
  if (strategy_->schedules_steps())
    throw ConfigError(fmt::format("{}reproducibility.mode replica_invariant does not cover strategy {}: its workers "
                                  "apply their updates as they arrive, in an order no seed fixes; use mode fast, or "
                                  "multi_worker_mirrored for synchronous training across processes",
                                  at, exp_.strategy.kind));
  if (exp_.data.distribute == config::DistributeMode::per_replica)
    throw ConfigError(fmt::format("{}reproducibility.mode replica_invariant cuts each global batch into micro-batches, "
                                  "and data.distribute per_replica batches every replica's input on its own; set "
                                  "data.distribute: split_global_batch",
                                  at));
  if (strategy_->workers() > 1 && shards_.policy != config::AutoShardPolicy::data)
    throw ConfigError(fmt::format("{}reproducibility.mode replica_invariant needs every worker to see the same "
                                  "order of samples, so that a step's global batch does not depend on the workers; "
                                  "data.auto_shard resolves to {} here: set data.auto_shard: data",
                                  at, config::name_of(shards_.policy)));
  // A model with synchronized layers needs one lane (a thread) per micro-batch a replica holds in a
  // full step: such a layer meets every micro-batch of the step at once: two lanes at least, since
  // one would run on the replica's own thread, whose OpenMP team may be more than one thread.
  // Otherwise each of the replica's threads is a lane computing its micro-batches in turn.
  constexpr std::int64_t kMostLanes = 256;
  const std::int64_t micro_batches =
      ceil_div(ceil_div(global_batch_size(), mode.micro_batch_size), strategy_->num_replicas_in_sync());
  // A replica with one thread computes them all on its own thread, whose OpenMP team is then one
  // thread too.
  if (!synchronizes)
    return static_cast<int>(std::max<std::int64_t>(1, std::min<std::int64_t>(micro_batches, strategy_->threads_per_replica())));
  const std::int64_t lanes = micro_batches;
  if (lanes > kMostLanes)
    throw ConfigError(fmt::format("{}reproducibility.micro_batch_size {} cuts the global batch of {} into {} "
                                  "micro-batches per replica, each computed by its own thread (the model has "
                                  "synchronized layers); at most {} are allowed: raise micro_batch_size to at least {}",
                                  at, mode.micro_batch_size, global_batch_size(), lanes, kMostLanes,
                                  ceil_div(ceil_div(global_batch_size(), strategy_->num_replicas_in_sync()), kMostLanes)));
  return static_cast<int>(std::max<std::int64_t>(2, lanes));
}

std::pair<std::int64_t, std::int64_t> Trainer::micro_batches_of(const distribute::ReplicaContext& rc,
                                                                std::int64_t samples) const {
  // The step's micro-batches are divided over the replicas in sync as data/pipeline.hpp's
  // replica_offset divides them (which is how the input gave each replica its rows).
  const std::int64_t micro_batches = ceil_div(samples, exp_.reproducibility.micro_batch_size);
  const std::int64_t first = data::replica_offset(micro_batches, rc.num_replicas_in_sync, rc.global_replica_id);
  return {first, data::replica_offset(micro_batches, rc.num_replicas_in_sync, rc.global_replica_id + 1) - first};
}

void Trainer::invariant_train_step(const distribute::ReplicaContext& rc, Replica& rep, const data::ReplicaBatch& batch) {
  const std::int64_t m = exp_.reproducibility.micro_batch_size;
  const std::int64_t micro_batches = ceil_div(step_samples_, m);
  const auto [first, count] = micro_batches_of(rc, step_samples_);
  DTRAIN_CHECK(batch.size == (count == 0 ? 0 : std::min(step_samples_, (first + count) * m) - first * m),
               fmt::format("replica {} holds {} samples, not its micro-batches [{}, {}) of {} samples",
                           rc.global_replica_id, batch.size, first, first + count, m));
  StepTimer* profile = rc.replica_id == 0 ? profile_ : nullptr;
  const std::span<const std::size_t> sizes = rep.model->gradient_sizes();
  const std::size_t vars = sizes.size(), replicas = static_cast<std::size_t>(rc.num_replicas_in_sync);
  // Lane l computes micro-batches l, l + lanes, ... of the replica's; with several, it keeps each
  // one's gradients (its model's arena holds only the last).
  const int lanes = rep.lane_count();
  const std::size_t floats = static_cast<std::size_t>(rep.model->gradient_arena().numel());
  auto lane_step = [&](int l) {
    Lane& lane = rep.lane(l);
    lane.micro_batches.clear();
    lane.loss_bins.reset();
    PhaseClock phases(l == 0 ? profile : nullptr);  // lane 0's timeline is the replica's
    if (l >= count) {
      lane.micro_statistics->set_step(-1, micro_batches);
      // Still takes part in synchronized layers' sums.
      lane.model->step_without_samples(micro_batch_context(rc, nn::Mode::training, batch, l, Lanes::Rows{}));
      return;
    }
    const std::size_t mine = static_cast<std::size_t>(ceil_div(count - l, lanes));
    if (mine > 1 && lane.micro_gradients.size() < mine * floats) lane.micro_gradients.resize(mine * floats);
    for (std::int64_t k = l; k < count; k += lanes) {
      const Lanes::Rows rows{k * m, std::min(batch.size, (k + 1) * m)};
      lane.micro_statistics->set_step(first + k, micro_batches);
      const nn::StepContext step = micro_batch_context(rc, nn::Mode::training, batch, l, rows);
      // The lane's own copy of its rows: the kernels read a micro-batch at the same alignment
      // whichever replica's batch it came in.
      const Tensor x = stage_into(*lane.ctx, lane.staged_x, batch.x.slice_rows(rows.begin, rows.end));
      const Tensor y = stage_into(*lane.ctx, lane.staged_y, batch.y.slice_rows(rows.begin, rows.end));
      compute_gradients(lane, x, y, step, nn::BackwardOptions{}, phases);
      lane.loss_bins.add(lane.per_example);
      const std::span<const float> gradients = lane.model->gradient_arena().span<float>();
      std::span<const float> kept = gradients;
      if (mine > 1) {
        float* slot = lane.micro_gradients.data() + lane.micro_batches.size() * floats;
        std::copy(gradients.begin(), gradients.end(), slot);
        kept = std::span<const float>(slot, floats);
      }
      lane.micro_batches.push_back(kept);
      // Each lane finds its own micro-batches' largest exponents, on its own thread.
      std::size_t at = 0;
      for (std::size_t v = 0; v < vars; at += sizes[v++])
        lane.exponents[v] = std::max(lane.exponents[v], fixed_point::max_exponent(kept.subspan(at, sizes[v])));
    }
  };
  for (int l = 0; l < rep.lane_count(); ++l) rep.lane(l).exponents.assign(vars, fixed_point::kAllZero);
  run_lanes(rep, lane_step);
  PhaseClock phases(profile);
  // The step's regularization loss, of the weights its gradients were taken at: read before the
  // exchanges below, which the replica holding the variables (central_storage) must also pass
  // before it updates them in place.
  const double regularization = rc.global_replica_id == 0 ? rep.model->regularization_loss() : 0.0;

  // First exchange: each variable's largest exponent over this replica's micro-batches (in the
  // replica's own slot) and the per-example losses' bins, summed exactly over every replica.
  constexpr std::int64_t kBias = 2 * fixed_point::kNonFinite;  // every exponent encoded above 0
  rep.exchange.assign(replicas * vars + ExactSum::kBins, 0);
  ExactSum losses;
  for (int l = 0; l < lanes; ++l) losses.merge(rep.lane(l).loss_bins);
  std::copy(losses.bins().begin(), losses.bins().end(), rep.exchange.begin() + static_cast<std::ptrdiff_t>(replicas * vars));
  for (std::size_t v = 0; v < vars; ++v) {
    int e = fixed_point::kAllZero;
    for (int l = 0; l < lanes; ++l) e = std::max(e, rep.lane(l).exponents[v]);
    rep.exchange[static_cast<std::size_t>(rc.global_replica_id) * vars + v] = e + kBias;
  }
  strategy_->all_reduce_sum_in_replica(rc, std::span<std::int64_t>(rep.exchange), "micro-batch exponents and losses");
  std::copy(rep.exchange.end() - static_cast<std::ptrdiff_t>(ExactSum::kBins), rep.exchange.end(), losses.bins().begin());

  // Second: the gradients in fixed point, each variable at the scale of its largest term anywhere.
  rep.scales.assign(vars, fixed_point::kAllZero);
  for (std::size_t v = 0; v < vars; ++v) {
    for (std::size_t r = 0; r < replicas; ++r)
      rep.scales[v] = std::max(rep.scales[v], static_cast<int>(rep.exchange[r * vars + v] - kBias));
    if (fixed_point::has_scale(rep.scales[v])) rep.scales[v] = fixed_point::scale_for(rep.scales[v], micro_batches);
  }
  // The lanes share the work by element: each sums every micro-batch's terms of its own range,
  // so an element's sum is still one exact integer sum.
  rep.fixed_sums.resize(static_cast<std::size_t>(rep.model->gradient_arena().numel()));
  auto accumulate_range = [&](int l) {
    const auto total = static_cast<std::int64_t>(rep.fixed_sums.size());
    const auto begin = static_cast<std::size_t>(data::part_offset(total, rep.lane_count(), l));
    const auto end = static_cast<std::size_t>(data::part_offset(total, rep.lane_count(), l + 1));
    std::fill(rep.fixed_sums.begin() + static_cast<std::ptrdiff_t>(begin),
              rep.fixed_sums.begin() + static_cast<std::ptrdiff_t>(end), 0.0);
    std::size_t at = 0;
    for (std::size_t v = 0; v < vars; at += sizes[v++]) {
      const std::size_t first = std::max(at, begin), last = std::min(at + sizes[v], end);
      if (first >= last || !fixed_point::has_scale(rep.scales[v])) continue;
      for (int k = 0; k < lanes; ++k)
        for (const std::span<const float> micro_batch : rep.lane(k).micro_batches)
          fixed_point::accumulate(micro_batch.subspan(first, last - first), rep.scales[v],
                                  std::span<double>(rep.fixed_sums).subspan(first, last - first));
    }
  };
  run_lanes(rep, accumulate_range);
  strategy_->all_reduce_sum_in_replica(rc, std::span<double>(rep.fixed_sums), "gradients (fixed point)");
  const std::span<float> gradients = rep.model->gradient_arena().span<float>();
  std::size_t offset = 0;
  for (std::size_t v = 0; v < vars; offset += sizes[v++]) {
    const std::span<float> mine = gradients.subspan(offset, sizes[v]);
    if (rep.scales[v] == fixed_point::kAllZero) std::fill(mine.begin(), mine.end(), 0.0f);
    else if (rep.scales[v] == fixed_point::kNonFinite) std::fill(mine.begin(), mine.end(), std::nanf(""));
    else fixed_point::to_float(std::span<const double>(rep.fixed_sums).subspan(offset, sizes[v]), rep.scales[v], mine);
  }
  // The whole regularization gradient, once, on the sum every replica now holds.
  rep.model->add_regularization_gradient(1.0f);
  phases.mark(Phase::reduction);
  strategy_->update(rc, [&rep] { apply_update(rep); });
  phases.mark(Phase::optimizer);
  // The step's loss is replica 0's figure (the others add zeros to it in reduce_sum).
  const bool divide = exp_.loss.reduction != config::Reduction::sum;
  const double data_loss = losses.value() / (divide ? static_cast<double>(step_samples_) : 1.0);
  replica_losses_[static_cast<std::size_t>(rc.replica_id)] = rc.global_replica_id == 0 ? data_loss + regularization : 0.0;
}

void Trainer::invariant_eval_step(const distribute::ReplicaContext& rc, Replica& rep, const data::ReplicaBatch& batch) {
  // Inference has no sums between micro-batches: each lane takes every lane_count()-th one.
  const std::int64_t m = exp_.reproducibility.micro_batch_size;
  const std::int64_t micro_batches = ceil_div(batch.size, m);
  auto lane_step = [&](int l) {
    Lane& lane = rep.lane(l);
    for (std::int64_t k = l; k < micro_batches; k += rep.lane_count()) {
      const Lanes::Rows rows{k * m, std::min(batch.size, (k + 1) * m)};
      const Tensor x = stage_into(*lane.ctx, lane.staged_x, batch.x.slice_rows(rows.begin, rows.end));
      const Tensor y = stage_into(*lane.ctx, lane.staged_y, batch.y.slice_rows(rows.begin, rows.end));
      const Tensor& predictions = lane.model->forward(x, micro_batch_context(rc, nn::Mode::inference, batch, l, rows));
      lane.per_example.resize(static_cast<std::size_t>(rows.size()));
      lane.loss->per_example(lane.model->loss_input(), y, lane.per_example);
      lane.eval_loss_bins.add(lane.per_example);
      for (auto& metric : lane.eval_metrics) metric->update(y, predictions);
    }
  };
  run_lanes(rep, lane_step);
}

void Trainer::replica_eval_step(const distribute::ReplicaContext& rc) {
  Replica& rep = replicas_[static_cast<std::size_t>(rc.replica_id)];
  const data::ReplicaBatch& batch = (*step_batches_)[static_cast<std::size_t>(rc.replica_id)];
  if (batch.size == 0) return;
  if (exp_.reproducibility.invariant()) return invariant_eval_step(rc, rep, batch);
  if (rep.lanes) {
    auto lane_step = [&](int l) {
      Lane& lane = rep.lane(l);
      const Lanes::Rows rows = rep.lanes->rows(batch.size, l);
      if (rows.size() == 0) return;
      const Tensor x = batch.x.slice_rows(rows.begin, rows.end), y = batch.y.slice_rows(rows.begin, rows.end);
      const Tensor& predictions = lane.model->forward(x, lane_step_context(rc, nn::Mode::inference, batch, l, rows));
      lane.per_example.resize(static_cast<std::size_t>(rows.size()));
      lane.loss->per_example(lane.model->loss_input(), y, lane.per_example);
      lane.eval_loss_sum += std::accumulate(lane.per_example.begin(), lane.per_example.end(), 0.0);
      for (auto& m : lane.eval_metrics) m->update(y, predictions);
    };
    run_lanes(rep, lane_step);
    return;
  }
  const auto [x, y] = stage(rep, batch);
  const Tensor& predictions = rep.model->forward(x, step_context(rc, nn::Mode::inference, batch));
  rep.per_example.resize(static_cast<std::size_t>(batch.size));
  rep.loss->per_example(rep.model->loss_input(), y, rep.per_example);
  rep.eval_loss_sum += std::accumulate(rep.per_example.begin(), rep.per_example.end(), 0.0);
  for (auto& m : rep.eval_metrics) m->update(y, predictions);
}

metrics::MetricState Trainer::local_metric_state(bool train, std::size_t index) const {
  // Exact: the states (integer counts) of every replica and lane are added.
  metrics::MetricState total;
  for (const Replica& rep : replicas_)
    for (int l = 0; l < rep.lane_count(); ++l) {
      const Lane& lane = rep.lane(l);
      const metrics::MetricState st = (train ? lane.train_metrics : lane.eval_metrics)[index]->state();
      total.counts.resize(st.counts.size());
      total.sums.resize(st.sums.size());
      for (std::size_t i = 0; i < st.counts.size(); ++i) total.counts[i] += st.counts[i];
      for (std::size_t i = 0; i < st.sums.size(); ++i) total.sums[i] += st.sums[i];
    }
  return total;
}

void Trainer::reset_train_metrics() {
  for (Replica& rep : replicas_)
    for (int l = 0; l < rep.lane_count(); ++l)
      for (auto& m : rep.lane(l).train_metrics) m->reset();
}

metrics::MetricState Trainer::merged_metric_state(bool train, std::size_t index) const {
  // Exact: this process's states, then every worker's, are added.
  metrics::MetricState total = local_metric_state(train, index);
  strategy_->all_reduce_sum(std::span<std::int64_t>(total.counts), "metric counts");
  strategy_->all_reduce_sum(std::span<double>(total.sums), "metric sums");
  return total;
}

double Trainer::combined_metric(bool train, std::size_t index) const {
  auto merged = metrics::make_metric(exp_.metrics[index], loss_of_outputs(exp_.loss, *replicas_[0].model),
                                     model_outputs(*replicas_[0].model), replicas_[0].ctx->numerics());
  merged->merge(merged_metric_state(train, index));
  return merged->result();
}

EvalResult Trainer::evaluate(const data::Dataset& split) {
  const auto t0 = Clock::now();
  auto it = make_iterator(split, false);
  it->start_epoch(0);
  for (Replica& rep : replicas_)
    for (int l = 0; l < rep.lane_count(); ++l) {
      rep.lane(l).eval_loss_sum = 0.0;
      rep.lane(l).eval_loss_bins.reset();
      for (auto& m : rep.lane(l).eval_metrics) m->reset();
    }
  EvalResult r;
  while ((step_batches_ = it->next())) {
    r.samples += it->global_samples();
    strategy_->run(eval_fn_);
  }
  double loss_sum = 0.0;
  if (exp_.reproducibility.invariant()) {
    // The per-example losses' bins: exact sums over lanes, replicas and workers.
    ExactSum total;
    for (const Replica& rep : replicas_)
      for (int l = 0; l < rep.lane_count(); ++l) total.merge(rep.lane(l).eval_loss_bins);
    strategy_->all_reduce_sum(total.bins(), "test loss bins");
    loss_sum = total.value();
  } else {
    for (const Replica& rep : replicas_)
      for (int l = 0; l < rep.lane_count(); ++l) loss_sum += rep.lane(l).eval_loss_sum;
    strategy_->all_reduce_sum(std::span<double>(&loss_sum, 1), "test loss");
  }
  r.loss = r.samples ? loss_sum / static_cast<double>(r.samples) : 0.0;
  if (!exp_.metrics.empty()) r.accuracy = combined_metric(false, 0);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

const data::Dataset& Trainer::split_named(const std::string& name) const {
  if (name == "test") return splits_.test;
  if (name == "train") return splits_.train;
  if (name == "validation" && splits_.validation) return *splits_.validation;
  throw ConfigError(fmt::format("unknown split '{}' (test, validation when validation_split is set, train)", name));
}

EvalResult Trainer::evaluate_split(const std::string& name) { return evaluate(split_named(name)); }

Predictions Trainer::predict_split(const std::string& name, std::int64_t batch) {
  const data::Dataset& split = split_named(name);
  flush_denormals();  // as every compute thread does
  const std::int64_t n = split.size();
  Predictions p;
  p.inputs = Tensor(split.x.shape(), DType::f32);
  const std::int64_t row = split.x.shape().tail().numel();
  for (std::int64_t i = 0; i < n; ++i) data::sample_as_f32(split, i, p.inputs.data<float>() + i * row);
  p.labels = split.y.clone();
  p.logits = Tensor(model().output_shape().with_batch(n), DType::f32);
  const std::int64_t outputs = model().output_shape().numel();
  Lane& lane = replicas_[0];
  nn::StepContext step;
  step.mode = nn::Mode::inference;
  step.seed = exp_.seed;
  for (std::int64_t begin = 0; begin < n; begin += batch) {
    const std::int64_t end = std::min(n, begin + batch);
    step.step_samples = end - begin;
    data::ReplicaBatch rows;
    rows.x = p.inputs.slice_rows(begin, end);
    const Tensor& y = model().forward(stage(lane, rows).first, step);
    lane.ctx->copy_to_host(y, p.logits.data<float>() + begin * outputs);
  }
  return p;
}

CallbackList Trainer::make_callbacks(const std::atomic<int>* stop_requested) {
  CallbackList callbacks;
  // A test's hold comes before everything: a signal that releases it is then seen by the stop
  // agreement of the same step.
  if (opt_.hold.active()) callbacks.add(std::make_unique<HoldAtStep>(opt_.hold, opt_.workers ? opt_.workers->rank() : 0));
  // Stop first: the checkpoint saver saves where the loop stops; a non-finite loss ends training
  // before the saver could write the weights it has spoilt.
  callbacks.add(std::make_unique<StopOnRequest>(stop_requested, *strategy_));
  callbacks.add(std::make_unique<TerminateOnNaN>());
  callbacks.add(std::make_unique<CheckpointSaver>(*this, exp_.checkpoint));
  // Then what observes the run, as apps/ installs it (TrainerOptions::observers).
  if (opt_.observers) {
    const RunView run{exp_,
                      opt_.run_dir,
                      opt_.out,
                      opt_.out_is_tty,
                      resume_ ? std::optional<std::int64_t>(resume_->epoch) : std::nullopt,
                      resume_ ? std::optional<std::int64_t>(resume_->global_step) : std::nullopt,
                      // The primary replica's optimizer holds the copy every replica computes with
                      // (central storage).
                      [this] {
                        return replicas_[static_cast<std::size_t>(strategy_->primary_replica())]
                            .optimizer->learning_rate();
                      }};
    opt_.observers(callbacks, run);
  }
  return callbacks;
}

std::int64_t Trainer::steps_per_epoch(const data::DistributedIterator& input) const {
  std::int64_t steps = input.steps_per_epoch();
  // Each epoch is at most one pass over the training data (reshuffled every epoch): more steps
  // than a pass makes are cut to it, said once (Keras instead stops the training where its input
  // runs out).
  if (exp_.train.steps_per_epoch > steps && steps > 0 && warns_of_experiment())
    fmt::print(stderr, "dtrain: warning: {}train.steps_per_epoch {} is more than the {} steps of one pass over the {} "
               "training samples at global batch {}; each epoch trains {}\n",
               config::given_prefix(exp_.steps_per_epoch_where, {exp_.source_file, 0, 0}), exp_.train.steps_per_epoch, steps, splits_.train.size(), input.global_batch_size(), steps);
  if (exp_.train.steps_per_epoch > 0) steps = std::min(steps, exp_.train.steps_per_epoch);
  if (steps == 0)
    throw ConfigError(fmt::format("{}an epoch has no steps: {} training samples, global batch {} with drop_remainder; "
                                  "choose a smaller batch, or data.drop_remainder: false",
                                  config::batch_key(exp_, false).where, splits_.train.size(), input.global_batch_size()));
  return steps;
}

double Trainer::run_step(const std::vector<data::ReplicaBatch>& batches, std::int64_t samples, std::int64_t global_step) {
  step_batches_ = &batches;
  step_samples_ = samples;
  global_step_ = global_step;
  reset_train_metrics();
  strategy_->set_step(global_step);
  strategy_->run(train_fn_);
  step_batches_ = nullptr;
  return replica_losses_[0];
}

void Trainer::merge_train_metric(std::size_t index, const metrics::MetricState& state) {
  replicas_[0].train_metrics[index]->merge(state);
}

void Trainer::read_input_share(int workers, int index) {
  try {
    shards_ = data::plan_shards(exp_.data, workers, index);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: {}", exp_.source_file, e.what()));
  }
  if (shards_.policy == config::AutoShardPolicy::file) splits_ = data::load_splits(exp_.data, exp_.seed, shards_.files);
}

double Trainer::train_step(data::DistributedIterator& input) {
  const auto started = profile_ ? Clock::now() : Clock::time_point{};
  if (profile_) profile_->begin_step();
  PhaseClock phases(profile_);
  step_batches_ = input.next();
  phases.mark(Phase::data);
  DTRAIN_CHECK(step_batches_ != nullptr, "the input ended before steps_per_epoch");
  step_samples_ = input.global_samples();
  strategy_->set_step(global_step_);
  strategy_->run(train_fn_);
  phases.skip();  // replica 0 timed the phases inside run()
  const double loss = strategy_->reduce_sum(replica_losses_);
  phases.mark(Phase::reduction);
  ++global_step_;
  step_batches_ = nullptr;
  if (profile_)
    profile_->end_step(std::chrono::duration<double>(Clock::now() - started).count(), step_samples_,
                       step_samples_ == global_batch_size());
  return loss;
}

void Trainer::set_profile(StepTimer* profile, bool layers) {
  profile_ = profile;
  replicas_[0].model->time_layers(profile && layers ? &profile->step_layers() : nullptr);
}

std::vector<double> Trainer::train_steps(std::int64_t epoch, std::int64_t steps) {
  auto it = make_iterator(splits_.train, true);
  it->start_epoch(epoch);
  std::vector<double> losses;
  for (std::int64_t s = 0; s < std::min(steps, it->steps_per_epoch()); ++s) losses.push_back(train_step(*it));
  return losses;
}

void Trainer::begin_epoch(LoopState& state, data::DistributedIterator& input) {
  // A resumed epoch goes on from where the checkpoint stood, with its running figures.
  const bool resuming = resume_ && state.epoch == resume_->epoch;
  state.step = resuming ? std::min(resume_->step_in_epoch, state.steps) : 0;
  state.loss_sum = resuming ? resume_->epoch_loss_sum : 0.0;
  state.samples = resuming ? resume_->epoch_samples : 0;
  state.first_step = state.step;
  state.first_samples = state.samples;
  if (!resuming) reset_train_metrics();
  strategy_->take_cross_worker_seconds();
  strategy_->take_cross_worker_wait_seconds();
  input.start_epoch(state.epoch, state.step);
}

EpochLog Trainer::end_epoch(const LoopState& state, double train_seconds) {
  EpochLog log;
  log.epoch = state.epoch + 1;
  // What this process trained and timed: a resumed epoch's steps before the checkpoint are not.
  log.steps = state.steps - state.first_step;
  log.samples = state.samples - state.first_samples;
  log.train_seconds = train_seconds;
  const double allreduce = strategy_->take_cross_worker_seconds();
  const double allreduce_wait = strategy_->take_cross_worker_wait_seconds();
  if (strategy_->workers() > 1) log.allreduce_seconds = allreduce;
  if (strategy_->overlaps_backward()) log.allreduce_wait_seconds = allreduce_wait;
  log.loss = state.loss_sum / static_cast<double>(state.steps);
  if (!exp_.metrics.empty()) log.accuracy = combined_metric(true, 0);
  if (splits_.validation) log.validation = evaluate(*splits_.validation);
  log.test = evaluate(splits_.test);
  log.global_step = global_step_;
  return log;
}

// The custom-training-loop template: for each epoch, for each batch run the train step on every
// replica, then test, then print. What happens around it (progress, checkpoints, metrics.jsonl,
// stopping on a signal) is the callbacks'.
std::vector<EpochLog> Trainer::fit() {
  write_run_files();
  fmt::print(opt_.out, "{}\n", header_line());
  if (!strategy_->choice_note().empty()) fmt::print(opt_.out, "{}\n", strategy_->choice_note());
  if (!shards_.note.empty()) fmt::print(opt_.out, "{}\n", shards_.note);
  if (!shards_.warning.empty() && strategy_->is_chief()) fmt::print(stderr, "{}\n", shards_.warning);
  // Here, not in restore(): the evaluator restores every checkpoint it evaluates and continues no run.
  if (resume_ && strategy_->is_chief()) note_resume_changes(*resume_);
  std::fflush(opt_.out);
  if (strategy_->schedules_steps()) {
    // The loop of the strategy's kind (a coordinator scheduling steps on workers) runs instead.
    std::vector<EpochLog> history = make_strategy_loop(exp_.strategy.kind, *strategy_)->fit(*this);
    resume_.reset();
    return history;
  }

  auto input = make_iterator(splits_.train, true);
  LoopState state;
  state.steps = steps_per_epoch(*input);
  CallbackList callbacks = make_callbacks(opt_.stop_requested);
  callbacks.on_train_begin(state);
  std::vector<EpochLog> history;
  for (state.epoch = resume_ ? static_cast<int>(resume_->epoch) : 0; state.epoch < exp_.train.epochs; ++state.epoch) {
    begin_epoch(state, *input);
    callbacks.on_epoch_begin(state);
    const auto t0 = Clock::now();
    while (state.step < state.steps) {
      state.loss_sum += train_step(*input);
      state.samples += step_samples_;
      ++state.step;
      state.global_step = global_step_;
      callbacks.on_train_batch_end(state);
      if (state.stop_training) {
        callbacks.on_train_end(state);
        throw Interrupted{state.checkpoint, state.epoch, state.step};
      }
    }
    const EpochLog log = end_epoch(state, std::chrono::duration<double>(Clock::now() - t0).count());
    fmt::print(opt_.out, "{}\n{}\n", epoch_line(log), throughput_line(log));
    std::fflush(opt_.out);
    callbacks.on_epoch_end(state, log);
    history.push_back(log);
    if (state.stop_training) {
      callbacks.on_train_end(state);
      throw Interrupted{state.checkpoint, state.epoch + 1, 0};
    }
  }
  callbacks.on_train_end(state);
  resume_.reset();
  return history;
}

}  // namespace dtrain::train
