// The training loop, laid out as the tf.distribute custom-training-loop template:
//   create the strategy; in its scope the loss, the metrics, the model and the optimizer (one
//   copy per replica where the strategy mirrors); the distributed datasets;
//   for each epoch: the train steps, then validation, then test; print the epoch line.
//
// The loop never asks which strategy it has: it calls strategy.run(step), strategy.reduce_sum(),
// strategy.sum_gradients() and strategy.update().
//
// Loss semantics (DESIGN.md): with reduction `none` each replica's loss is
// sum(its per-example losses) / G + regularization / R, where G is the number of samples the
// whole step really has (the global batch, or fewer on a short last batch) and R the replicas in
// sync; gradients are SUMMED across replicas, so N replicas compute the update one replica
// computes on the global batch. `sum` does not divide by G. `sum_over_batch_size`/`auto` (only
// with the default strategy: the config refuses them otherwise) divide by G as well.
// The step loss is the SUM over replicas; the epoch's Loss is the mean of the step losses.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/manager.hpp"
#include "config/experiment.hpp"
#include "core/exact_sum.hpp"
#include "data/dataset.hpp"
#include "data/distributed.hpp"
#include "data/sharding.hpp"
#include "distribute/single_communicator.hpp"
#include "distribute/strategy.hpp"
#include "device/context.hpp"
#include "losses/loss.hpp"
#include "metrics/metric.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"
#include "train/callbacks.hpp"
#include "train/lanes.hpp"
#include "train/epoch_log.hpp"
#include "train/predictions.hpp"
#include "train/step_timer.hpp"
#include "train/strategy_loop.hpp"

namespace dtrain::train {

struct TrainerOptions {
  std::string run_dir;          // where config.yaml, metrics.jsonl and checkpoints/ go; empty = none
  std::FILE* out = stdout;      // epoch lines
  bool out_is_tty = false;      // progress: auto draws a bar only on a terminal
  // Set (by the signal watcher thread, apps/dtrain/signals.hpp) to stop at the next step
  // boundary: fit() saves a checkpoint and throws Interrupted.
  const std::atomic<int>* stop_requested = nullptr;
  // The worker processes (MPI ranks); null = this process alone. Only the chief (rank 0) prints,
  // writes the run directory and saves checkpoints.
  distribute::Communicator* workers = nullptr;
  // A test's hold at a chosen step (callbacks.hpp); off unless apps/ sets it.
  StepHold hold;
  // What the trainer is for: training (run, resume, bench); evaluating alone (dtrain eval: the
  // training batch's checks against the workers do not apply); or the job's evaluator rank
  // (train/evaluator.hpp), a chief on its side of the job which leaves the warnings about the
  // experiment to the training chief, so that a job prints them once.
  enum class Purpose { train, evaluate, job_evaluator };
  Purpose purpose = Purpose::train;
  // What observes the run (progress, metrics.jsonl, TensorBoard, curves: observe::add_observers,
  // installed by apps/), added after the loop's own callbacks (callbacks.hpp); none = the epoch
  // lines alone.
  Observers observers;
};

// Compute threads for an experiment's `train.threads`: 0 = every core this process may use,
// shared with the other ranks an MPI launcher started on the same node.
int resolve_threads(int configured);

// reproducibility.isa: caps the instruction set the CPU's kernels may use, before any kernel
// exists (a ConfigError at the key when the CPU lacks it); nothing for `native`.
void cap_instruction_set(const config::Experiment& experiment);

// A strategy that schedules its own steps runs its loop (train/strategy_loop.hpp) in fit(), on the
// trainer as a LoopHost.
class Trainer : private LoopHost {
 public:
  Trainer(config::Experiment experiment, TrainerOptions options);
  ~Trainer() override;
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Continues from a checkpoint (written under any strategy and replica count): weights,
  // optimizer slots and iterations, the epoch and step to go on at, and the unfinished epoch's
  // running loss and metrics. Call before fit(). Returns the checkpoint's training state.
  checkpoint::TrainingState restore(const std::string& checkpoint_path);
  // Starts from these weights instead of the seed's initialization: `values` holds one host array
  // per model().variables(), in that order and of their sizes (model.initial_weights, read by
  // interop/keras_weights.hpp), copied into every replica that holds the variables. Call before
  // fit(), on every worker; the optimizer's slots stay as they start.
  void set_variables(const std::vector<std::vector<float>>& values);
  // Refuses (InputError naming `path`: the checkpoint is corrupt) a /state whose running metric
  // figures do not fit the metrics of `stored`, the experiment written with it. restore() checks
  // this against its own metrics; `dtrain eval`, which does not use the figures, checks it so as
  // to refuse every checkpoint resume refuses.
  void check_stored_state(const std::string& path, const checkpoint::TrainingState& state,
                          const config::Experiment& stored) const;
  // Trains the remaining epochs and returns their logs.
  std::vector<EpochLog> fit();
  // Runs `steps` training steps of epoch `epoch` from its start (tests, benchmarks); returns the
  // step losses.
  std::vector<double> train_steps(std::int64_t epoch, std::int64_t steps);
  // Mean loss and metrics over a whole split, every sample exactly once, split across replicas.
  EvalResult evaluate(const data::Dataset& split);
  // The same on a split by name: "test", "validation" or "train".
  EvalResult evaluate_split(const std::string& name);
  // Every sample of split `name` in the split's order: its input as the model takes it, the
  // outputs of replica 0's model in inference mode (computed in batches of `batch` on this thread)
  // and its labels (dtrain eval --predictions).
  Predictions predict_split(const std::string& name, std::int64_t batch);

  // Attaches a timer that the training steps report their times to from now on (dtrain bench:
  // observe::StepProfile), or detaches it (null). Steps without one read no clock. With
  // `layers`, replica 0's model times its layers too, waiting for the device after each.
  void set_profile(StepTimer* profile, bool layers = true);

  distribute::Strategy& strategy() override { return *strategy_; }
  // Replica r's model; with mirrored variables every replica holds the same values.
  nn::Sequential& model(int replica = 0) { return *replicas_[static_cast<std::size_t>(replica)].model; }
  const config::Experiment& experiment() const override { return exp_; }
  std::string header_line() const;
  // data.global_batch_size, or batch_size_per_replica times the replicas in sync.
  std::int64_t global_batch_size() const;
  // checkpoint.dir, or <run dir>/checkpoints; empty when there is neither.
  std::string checkpoint_dir() const;
  // Saves the state "continue at (epoch, step_in_epoch)" with the running figures of that epoch
  // (the checkpoint callback). Every worker calls it (the metrics are merged across them); only the
  // chief writes. Returns the file written, or "" where nothing was (no checkpoint directory, not
  // the chief).
  std::string save_checkpoint(std::int64_t epoch, std::int64_t step_in_epoch, double loss_sum, std::int64_t samples);
  // The chief opens the checkpoint directory before training (creating it, removing stale
  // temporaries, IoError when it is not writable); a no-op elsewhere.
  void open_checkpoints();

 private:
  // ---- LoopHost: what a strategy's own loop may use (strategy_loop.hpp)
  std::FILE* out() const override { return opt_.out; }
  nn::Sequential& replica_model() override { return *replicas_[0].model; }
  optim::Optimizer& replica_optimizer() override { return *replicas_[0].optimizer; }
  device::Numerics& replica_numerics() override { return replicas_[0].ctx->numerics(); }
  metrics::MetricState train_metric_state(std::size_t index) const override { return local_metric_state(true, index); }
  void merge_train_metric(std::size_t index, const metrics::MetricState& state) override;
  void read_input_share(int workers, int index) override;
  std::unique_ptr<data::DistributedIterator> training_input() override { return make_iterator(splits_.train, true); }
  std::int64_t steps_per_epoch(const data::DistributedIterator& input) const override;
  double run_step(const std::vector<data::ReplicaBatch>& batches, std::int64_t samples, std::int64_t global_step) override;
  std::int64_t global_step() const override { return global_step_; }
  void set_global_step(std::int64_t step) override { global_step_ = step; }
  int first_epoch() const override { return resume_ ? static_cast<int>(resume_->epoch) : 0; }
  const std::atomic<int>* stop_requested() const override { return opt_.stop_requested; }
  // Whether this process prints the warnings about the experiment: the chief, once for the job.
  bool warns_of_experiment() const {
    return strategy_->is_chief() && opt_.purpose != TrainerOptions::Purpose::job_evaluator;
  }

  // What computes one slice of a replica's batch: the replica itself when it has one lane
  // (train/lanes.hpp), else each of its lanes, whose models share the replica's variables.
  struct Lane {
    std::unique_ptr<device::Context> ctx;  // the replica's device, made by its backend
    std::unique_ptr<losses::Loss> loss;
    std::unique_ptr<nn::Sequential> model;
    std::vector<std::unique_ptr<metrics::Metric>> train_metrics, eval_metrics;
    std::vector<float> per_example;
    // The step's batch in the lane's context memory where it is not the host's (see stage()).
    Tensor staged_x, staged_y;
    double eval_loss_sum = 0.0;
    double data_loss = 0.0;  // this step's, from this lane's samples
    // The other lanes (batch statistics) and, for synchronized layers, every lane of every replica.
    std::unique_ptr<nn::CrossReplica> lane_statistics, lanes_then_replicas;
    // reproducibility: replica_invariant: synchronized statistics by micro-batch slots, and the
    // per-example losses of this step (training) and of this evaluation, binned exactly.
    std::unique_ptr<MicroBatchStatistics> micro_statistics;
    ExactSum loss_bins, eval_loss_bins;
    std::vector<int> exponents;  // this step's largest exponent of each variable's gradient
    // This step's micro-batches' gradients: the model's arena for one, copies in micro_gradients
    // for several.
    std::vector<std::span<const float>> micro_batches;
    std::vector<float> micro_gradients;
  };
  // A replica is its lane 0, with the optimizer of its variables and what reaches the strategy.
  struct Replica : Lane {
    std::unique_ptr<optim::Optimizer> optimizer;
    // Hands each layer's finished gradients to the strategy during backward (built once).
    std::function<void(std::size_t, std::size_t)> gradients_ready;
    // The other replicas, as this replica's layers reach them.
    std::unique_ptr<nn::CrossReplica> cross_replica;
    // With train.parallelism: batch and more than one thread per replica: lanes 1, 2, ... and
    // the threads of all of them.
    std::vector<Lane> more_lanes;
    std::unique_ptr<Lanes> lanes;
    // reproducibility: replica_invariant: the gradients' fixed-point sums and each variable's scale,
    // and what is exchanged first (every replica's largest exponents, then the loss's bins).
    std::vector<double> fixed_sums;
    std::vector<int> scales;
    std::vector<std::int64_t> exchange;
    int lane_count() const { return 1 + static_cast<int>(more_lanes.size()); }
    Lane& lane(int i) { return i == 0 ? *this : more_lanes[static_cast<std::size_t>(i - 1)]; }
    const Lane& lane(int i) const { return i == 0 ? *this : more_lanes[static_cast<std::size_t>(i - 1)]; }
  };
  // Builds what a lane needs on replica `replica`'s device.
  // The first lane made (replica 0's own) first checks the whole run's memory from its model's
  // declared shapes (train/memory_estimate.hpp), before any variable is allocated.
  Lane make_lane(int replica, bool check_run_memory = false) const;
  // The batch x, y where `lane`'s kernels read it: the host tensors themselves where its context
  // reads host memory in place, else copies staged into the lane's buffers.
  std::pair<Tensor, Tensor> stage(Lane& lane, const data::ReplicaBatch& batch);
  void replica_train_step(const distribute::ReplicaContext& rc);
  // The training step of a replica whose batch is split over its lanes.
  void lanes_train_step(const distribute::ReplicaContext& rc, Replica& rep, const data::ReplicaBatch& batch);
  // Forward, loss and backward of `lane` on its rows x, y of the step; its metrics updated.
  // Returns the lane's share of the step's data loss.
  // `deferred`: the losses and the metrics' device results are read by settle_step() instead
  // (then it returns 0).
  double compute_gradients(Lane& lane, const Tensor& x, const Tensor& y, const nn::StepContext& step,
                           const nn::BackwardOptions& backward, PhaseClock& phases, bool deferred = false);
  // The step's data loss from a lane's per-example losses.
  double data_loss_of(std::span<const float> per_example) const;
  // After a deferred compute_gradients(): waits for the lane's results, settles its metrics and
  // returns its data loss.
  double settle_step(Lane& lane);
  // After the replica's gradients are complete: its regularization loss, the strategy's sum and
  // update, and its step loss (`data_loss`, or, `deferred`, settle_step()'s once all is queued).
  void finish_replica_step(const distribute::ReplicaContext& rc, Replica& rep, double data_loss, PhaseClock& phases,
                           bool deferred = false);
  // The optimizer's update of the replica's variables, split over its lanes where it has them, and
  // the layers' own updates.
  static void apply_update(Replica& rep);
  void replica_eval_step(const distribute::ReplicaContext& rc);
  // reproducibility: replica_invariant (docs/reproducibility.md): the replica's batch is whole
  // micro-batches, one per lane; their gradients, losses and synchronized statistics are combined
  // exactly, so that no sum depends on which replica, lane or rank computed what.
  void invariant_train_step(const distribute::ReplicaContext& rc, Replica& rep, const data::ReplicaBatch& batch);
  void invariant_eval_step(const distribute::ReplicaContext& rc, Replica& rep, const data::ReplicaBatch& batch);
  // The first micro-batch of replica `rc` in a step of `samples`, and how many it has.
  std::pair<std::int64_t, std::int64_t> micro_batches_of(const distribute::ReplicaContext& rc,
                                                         std::int64_t samples) const;
  // What the mode cannot cover under this experiment, refused at reproducibility.mode; the
  // lanes each replica needs (one per micro-batch of a full step, at least 2).
  // `synchronizes`: whether the model has synchronized layers (then one lane per micro-batch).
  int invariant_lanes(bool synchronizes) const;
  // As fit() continues a restored run, on the chief: what resuming with another seed or on another
  // layout (replicas, processes, global batch) than the checkpoint's changes.
  void note_resume_changes(const checkpoint::TrainingState& state) const;
  // What replica `rc`'s layers know about the current step; with lanes, what lane `lane` of it
  // knows, computing the batch's rows `rows`.
  nn::StepContext step_context(const distribute::ReplicaContext& rc, nn::Mode mode, const data::ReplicaBatch& batch) const;
  nn::StepContext lane_step_context(const distribute::ReplicaContext& rc, nn::Mode mode, const data::ReplicaBatch& batch,
                                    int lane, Lanes::Rows rows) const;
  // reproducibility: replica_invariant: lane `lane`'s micro-batch `rows`, its batch statistics its
  // own and its synchronized sums through the micro-batch slots.
  nn::StepContext micro_batch_context(const distribute::ReplicaContext& rc, nn::Mode mode,
                                      const data::ReplicaBatch& batch, int lane, Lanes::Rows rows) const;
  // The state of metric `index` (train or eval) merged over this process's replicas and lanes.
  metrics::MetricState local_metric_state(bool train, std::size_t index) const;
  // That state summed across workers: exact, and every worker must call it at the same point.
  metrics::MetricState merged_metric_state(bool train, std::size_t index) const;
  // Every replica's and lane's training metrics start afresh.
  void reset_train_metrics();
  // Its result.
  double combined_metric(bool train, std::size_t index) const;
  // The callbacks of fit(), in the order they run; `stop_requested` is the request they see.
  CallbackList make_callbacks(const std::atomic<int>* stop_requested) override;
  // One step of the template: the next batch, run on every replica; returns the step's loss.
  double train_step(data::DistributedIterator& input);
  // Where the epoch `state.epoch` starts (a resumed one where the checkpoint stood).
  void begin_epoch(LoopState& state, data::DistributedIterator& input) override;
  // The epoch's figures: its loss and accuracy, then validation and test.
  EpochLog end_epoch(const LoopState& state, double train_seconds) override;
  std::unique_ptr<data::DistributedIterator> make_iterator(const data::Dataset& split, bool training) const;
  void write_run_files();

  config::Experiment exp_;
  TrainerOptions opt_;
  int threads_ = 1;
  distribute::SingleCommunicator alone_;  // the workers when options.workers is null
  // The job's processes: options.workers, or this one alone.
  distribute::Communicator& job() { return opt_.workers ? *opt_.workers : alone_; }
  std::unique_ptr<distribute::Strategy> strategy_;
  data::ShardPlan shards_;   // this worker's part of the data
  data::DataSplits splits_;  // as this worker loaded them (its files under auto_shard file)
  // "test", "train" or "validation" (when validation_split is set); ConfigError for another name.
  const data::Dataset& split_named(const std::string& name) const;
  std::vector<Replica> replicas_;
  std::int64_t global_step_ = 0;
  std::FILE* null_out_ = nullptr;  // where a non-chief worker's epoch lines go
  std::unique_ptr<checkpoint::CheckpointManager> checkpoints_;
  std::optional<checkpoint::TrainingState> resume_;  // set by restore(), used by fit()

  // The current step, read by the replica functions.
  const std::vector<data::ReplicaBatch>* step_batches_ = nullptr;
  std::int64_t step_samples_ = 0;
  std::vector<double> replica_losses_;
  // Built once: std::function from a capturing lambda may allocate.
  std::function<void(const distribute::ReplicaContext&)> train_fn_, eval_fn_;
  StepTimer* profile_ = nullptr;  // set_profile()
};

}  // namespace dtrain::train
