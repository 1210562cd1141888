#include "train/trainer.hpp"

#include <omp.h>
#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <numeric>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "dtrain/build_info.hpp"

namespace dtrain::train {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

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
  strategy_ = distribute::make_strategy(exp_.strategy, threads_, opt_.workers ? *opt_.workers : alone_);
  try {
    shards_ = data::plan_shards(exp_.data, strategy_->workers(), strategy_->worker_index());
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: {}", exp_.source_file, e.what()));
  }
  if (!strategy_->is_chief()) {
    // Workers other than the chief compute and take part in every collective, silently.
    null_out_ = std::fopen("/dev/null", "w");
    opt_.out = null_out_;
    opt_.out_is_tty = false;
    opt_.run_dir.clear();
  }
  omp_set_num_threads(strategy_->threads_per_replica());  // the calling thread is replica 0 when alone
  const int replicas = strategy_->num_local_replicas();

  // In the strategy's scope: the loss, then per replica the metrics, the model and the optimizer.
  // Every replica builds its model from the same seed, so mirrored copies start identical; under
  // central storage the replicas compute with the parameter device's replica's variables.
  loss_ = losses::make_loss(exp_.loss);
  replicas_.resize(static_cast<std::size_t>(replicas));
  for (int r = 0; r < replicas; ++r) {
    Replica& rep = replicas_[static_cast<std::size_t>(r)];
    for (auto kind : exp_.metrics) {
      rep.train_metrics.push_back(metrics::make_metric(kind, exp_.loss));
      rep.eval_metrics.push_back(metrics::make_metric(kind, exp_.loss));
    }
    rep.model = std::make_unique<nn::Sequential>(exp_.model, exp_.seed);
    rep.optimizer = optim::make_optimizer(exp_.optimizer);
    strategy_->bind_gradients(r, rep.model->gradient_arena(), rep.model->gradient_sizes());
    rep.gradients_ready = [this, rc = strategy_->replica_context(r)](std::size_t first, std::size_t count) {
      strategy_->gradients_ready(rc, first, count);
    };
  }
  std::vector<std::vector<Variable*>> variables;
  for (const Replica& rep : replicas_) variables.push_back(rep.model->variables());
  strategy_->place_variables(variables);
  replica_losses_.assign(static_cast<std::size_t>(replicas), 0.0);
  train_fn_ = [this](const distribute::ReplicaContext& rc) { replica_train_step(rc); };
  eval_fn_ = [this](const distribute::ReplicaContext& rc) { replica_eval_step(rc); };

  splits_ = data::load_splits(exp_.data, exp_.seed, shards_.files);
  if (splits_.train.size() == 0) throw InputError("the training set is empty");
  const Shape sample = splits_.train.x.shape().tail();
  if (sample != model().input_shape())
    throw ConfigError(fmt::format("{}: model.input_shape {} does not match the data's sample shape {}", exp_.source_file,
                                  model().input_shape().to_string(), sample.to_string()));
}

Trainer::~Trainer() {
  if (null_out_) std::fclose(null_out_);
}

std::int64_t Trainer::global_batch_size() const {
  if (exp_.data.global_batch_size > 0) return exp_.data.global_batch_size;
  return exp_.data.batch_size_per_replica * strategy_->num_replicas_in_sync();
}

std::string Trainer::header_line() const {
  const int replicas = strategy_->num_local_replicas();
  const std::string threads = replicas > 1 ? fmt::format("{} ({} per replica)", threads_, strategy_->threads_per_replica())
                                           : fmt::format("{}", threads_);
  return fmt::format("dtrain {} | experiment {} | {} | global batch {} | learning rate {:g} | threads {} | oneDNN {} isa {}",
                     build_info::version, exp_.name, strategy_->describe(), global_batch_size(),
                     replicas_[0].optimizer->learning_rate(), threads, kernels::cpu::dnnl_version(),
                     kernels::cpu::effective_isa());
}

void Trainer::write_run_files() {
  if (opt_.run_dir.empty()) return;
  std::error_code ec;
  fs::create_directories(opt_.run_dir, ec);
  if (ec) throw IoError(fmt::format("cannot create the run directory {}: {}; pass --run-dir to choose another",
                                    opt_.run_dir, ec.message()));
  std::ofstream cfg(fs::path(opt_.run_dir) / "config.yaml");
  cfg << "# resolved experiment, written by dtrain " << build_info::version << "\n" << config::to_yaml(exp_);
  // A resumed run appends its epochs to the log of the run it continues.
  std::ofstream metrics(fs::path(opt_.run_dir) / "metrics.jsonl", resume_ ? std::ios::app : std::ios::trunc);
  if (!cfg || !metrics) throw IoError(fmt::format("cannot write into the run directory {}", opt_.run_dir));
}

std::string Trainer::checkpoint_dir() const {
  if (!exp_.checkpoint.dir.empty()) return exp_.checkpoint.dir;
  return opt_.run_dir.empty() ? std::string() : (fs::path(opt_.run_dir) / "checkpoints").string();
}

std::string Trainer::save_checkpoint(std::int64_t epoch, std::int64_t step_in_epoch, double loss_sum,
                                     std::int64_t samples) {
  // Every worker takes part in combining the metrics; only the chief writes.
  std::vector<metrics::MetricState> states;
  for (std::size_t i = 0; step_in_epoch > 0 && i < exp_.metrics.size(); ++i)
    states.push_back(merged_metric_state(true, i));
  if (!strategy_->is_chief()) return {};
  if (!checkpoints_) {
    const std::string dir = checkpoint_dir();
    if (dir.empty()) return {};
    checkpoints_ = std::make_unique<checkpoint::CheckpointManager>(dir, exp_.checkpoint.max_to_keep);
  }
  checkpoint::Contents c;
  c.state.epoch = epoch;
  c.state.step_in_epoch = step_in_epoch;
  c.state.global_step = global_step_;
  c.state.seed = exp_.seed;
  c.state.epoch_loss_sum = loss_sum;
  c.state.epoch_samples = samples;
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

checkpoint::TrainingState Trainer::restore(const std::string& checkpoint_path) {
  const int primary = strategy_->primary_replica();
  Replica& first = replicas_[static_cast<std::size_t>(primary)];
  checkpoint::Contents c = checkpoint::restore(checkpoint_path, *first.model, *first.optimizer);
  // The other copies get the primary's values and slots; replicas holding no copy share its values.
  auto& vars0 = first.model->variables();
  for (std::size_t r = 0; r < replicas_.size(); ++r) {
    Replica& rep = replicas_[r];
    if (static_cast<int>(r) == primary) continue;
    if (strategy_->holds_variables(static_cast<int>(r))) {
      auto& vars = rep.model->variables();
      for (std::size_t v = 0; v < vars.size(); ++v)
        std::copy_n(vars0[v]->value.data<float>(), vars0[v]->value.numel(), vars[v]->value.data<float>());
      rep.optimizer->build(vars);
      for (std::size_t v = 0; v < vars.size(); ++v)
        for (std::size_t k = 0; k < rep.optimizer->slot_names().size(); ++k)
          std::copy_n(first.optimizer->slot(v, k).data<float>(), vars[v]->value.numel(),
                      rep.optimizer->slot(v, k).data<float>());
    }
    rep.optimizer->set_iterations(first.optimizer->iterations());
  }
  // The unfinished epoch's metrics go to replica 0; merging replicas later gives the same totals.
  for (Replica& rep : replicas_)
    for (auto& m : rep.train_metrics) m->reset();
  for (std::size_t i = 0; strategy_->is_chief() && i < exp_.metrics.size() && i < c.state.metric_counts.size(); ++i)
    replicas_[0].train_metrics[i]->merge(metrics::MetricState{c.state.metric_counts[i], c.state.metric_sums[i]});
  if (c.state.seed != exp_.seed)
    fmt::print(stderr, "dtrain: warning: the checkpoint was trained with seed {}, the experiment says {}: the data order "
                       "from here on follows seed {}\n", c.state.seed, exp_.seed, exp_.seed);
  global_step_ = c.state.global_step;
  resume_ = c.state;
  return c.state;
}

std::unique_ptr<data::DistributedIterator> Trainer::make_iterator(const data::Dataset& split, bool training) const {
  data::PipelineOptions po;
  po.seed = training ? shards_.train_seed(exp_.seed) : exp_.seed;
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

void Trainer::replica_train_step(const distribute::ReplicaContext& rc) {
  Replica& rep = replicas_[static_cast<std::size_t>(rc.replica_id)];
  const data::ReplicaBatch& batch = (*step_batches_)[static_cast<std::size_t>(rc.replica_id)];
  const float replicas = static_cast<float>(rc.num_replicas_in_sync);
  const bool overlap = strategy_->overlaps_backward();
  double data_loss = 0.0;
  if (batch.size > 0) {
    const Tensor& logits = rep.model->forward(rep.ctx, batch.x);
    rep.per_example.resize(static_cast<std::size_t>(batch.size));
    loss_->per_example(logits, batch.y, rep.per_example);
    // Divide by the samples of the whole step (all replicas), never by this replica's share.
    const bool divide = exp_.loss.reduction != config::Reduction::sum;
    data_loss = divide ? losses::compute_average_loss(rep.per_example, step_samples_)
                       : losses::reduce_loss(rep.per_example, config::Reduction::sum);
    loss_->gradient(logits, batch.y, {}, divide ? 1.0f / static_cast<float>(step_samples_) : 1.0f,
                    rep.model->output_gradient());
    // Each replica adds 1/R of the regularization gradient: summed over replicas, it is added once.
    // The per-layer hand-over only when the strategy sums across workers while backward runs.
    rep.model->backward(rep.ctx, nn::BackwardOptions{1.0f / replicas, overlap ? &rep.gradients_ready : nullptr});
    for (auto& m : rep.train_metrics) m->update(batch.y, logits);
  } else {
    // No samples for this replica on a short last batch: it still adds its share of the
    // regularization gradient and takes part in the collectives.
    for (Variable* v : rep.model->variables()) v->grad.zero();
    rep.model->add_regularization_gradient(1.0f / replicas);
    if (overlap) rep.gradients_ready(0, rep.model->variables().size());
  }
  const double reg = losses::scale_regularization_loss(rep.model->regularization_loss(), rc.num_replicas_in_sync);
  strategy_->sum_gradients(rc);
  strategy_->update(rc, [&rep] { rep.optimizer->apply_gradients(rep.model->variables()); });
  replica_losses_[static_cast<std::size_t>(rc.replica_id)] = data_loss + reg;
}

void Trainer::replica_eval_step(const distribute::ReplicaContext& rc) {
  Replica& rep = replicas_[static_cast<std::size_t>(rc.replica_id)];
  const data::ReplicaBatch& batch = (*step_batches_)[static_cast<std::size_t>(rc.replica_id)];
  if (batch.size == 0) return;
  const Tensor& logits = rep.model->forward(rep.ctx, batch.x);
  rep.per_example.resize(static_cast<std::size_t>(batch.size));
  loss_->per_example(logits, batch.y, rep.per_example);
  rep.eval_loss_sum += std::accumulate(rep.per_example.begin(), rep.per_example.end(), 0.0);
  for (auto& m : rep.eval_metrics) m->update(batch.y, logits);
}

metrics::MetricState Trainer::merged_metric_state(bool train, std::size_t index) const {
  // Exact: the states (integer counts) of every replica, and then of every worker, are added.
  metrics::MetricState total;
  for (const Replica& rep : replicas_) {
    const metrics::MetricState st = (train ? rep.train_metrics : rep.eval_metrics)[index]->state();
    total.counts.resize(st.counts.size());
    total.sums.resize(st.sums.size());
    for (std::size_t i = 0; i < st.counts.size(); ++i) total.counts[i] += st.counts[i];
    for (std::size_t i = 0; i < st.sums.size(); ++i) total.sums[i] += st.sums[i];
  }
  strategy_->all_reduce_sum(std::span<std::int64_t>(total.counts), "metric counts");
  strategy_->all_reduce_sum(std::span<double>(total.sums), "metric sums");
  return total;
}

double Trainer::combined_metric(bool train, std::size_t index) const {
  auto merged = metrics::make_metric(exp_.metrics[index], exp_.loss);
  merged->merge(merged_metric_state(train, index));
  return merged->result();
}

bool Trainer::stop_agreed() {
  const int local = opt_.stop_requested ? opt_.stop_requested->load() : 0;
  return strategy_->all_reduce_max(local, "stop request") != 0;
}

std::vector<double> Trainer::train_steps(std::int64_t epoch, std::int64_t steps) {
  auto it = make_iterator(splits_.train, true);
  it->start_epoch(epoch);
  std::vector<double> losses;
  for (std::int64_t s = 0; s < steps; ++s) {
    step_batches_ = it->next();
    if (!step_batches_) break;
    step_samples_ = it->global_samples();
    strategy_->run(train_fn_);
    losses.push_back(strategy_->reduce_sum(replica_losses_));
    ++global_step_;
  }
  step_batches_ = nullptr;
  return losses;
}

EvalResult Trainer::evaluate(const data::Dataset& split) {
  const auto t0 = Clock::now();
  auto it = make_iterator(split, false);
  it->start_epoch(0);
  for (Replica& rep : replicas_) {
    rep.eval_loss_sum = 0.0;
    for (auto& m : rep.eval_metrics) m->reset();
  }
  EvalResult r;
  while ((step_batches_ = it->next())) {
    r.samples += it->global_samples();
    strategy_->run(eval_fn_);
  }
  double loss_sum = 0.0;
  for (const Replica& rep : replicas_) loss_sum += rep.eval_loss_sum;
  strategy_->all_reduce_sum(std::span<double>(&loss_sum, 1), "test loss");
  r.loss = r.samples ? loss_sum / static_cast<double>(r.samples) : 0.0;
  if (!exp_.metrics.empty()) r.accuracy = combined_metric(false, 0);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

EvalResult Trainer::evaluate_split(const std::string& name) {
  if (name == "test") return evaluate(splits_.test);
  if (name == "train") return evaluate(splits_.train);
  if (name == "validation" && splits_.validation) return evaluate(*splits_.validation);
  throw ConfigError(fmt::format("unknown split '{}' (test, validation when validation_split is set, train)", name));
}

std::vector<EpochLog> Trainer::fit() {
  write_run_files();
  fmt::print(opt_.out, "{}\n", header_line());
  if (!strategy_->choice_note().empty()) fmt::print(opt_.out, "{}\n", strategy_->choice_note());
  if (!shards_.note.empty()) fmt::print(opt_.out, "{}\n", shards_.note);
  if (!shards_.warning.empty() && strategy_->is_chief()) fmt::print(stderr, "{}\n", shards_.warning);
  std::fflush(opt_.out);

  auto it = make_iterator(splits_.train, true);
  std::int64_t steps = it->steps_per_epoch();
  if (exp_.train.steps_per_epoch > 0) steps = std::min(steps, exp_.train.steps_per_epoch);
  if (steps == 0)
    throw ConfigError(fmt::format("{}: an epoch has no steps: {} training samples, global batch {} with drop_remainder",
                                  exp_.source_file, splits_.train.size(), it->global_batch_size()));

  const bool bar = exp_.train.progress == config::ProgressMode::bar ||
                   (exp_.train.progress == config::ProgressMode::auto_detect && opt_.out_is_tty);
  const bool lines = exp_.train.progress == config::ProgressMode::lines;
  const auto& ck = exp_.checkpoint;
  std::vector<EpochLog> history;
  const int first_epoch = resume_ ? static_cast<int>(resume_->epoch) : 0;
  for (int epoch = first_epoch; epoch < exp_.train.epochs; ++epoch) {
    // A resumed epoch goes on from where the checkpoint stood, with its running figures.
    const bool resuming = resume_ && epoch == resume_->epoch;
    const std::int64_t first_step = resuming ? std::min(resume_->step_in_epoch, steps) : 0;
    if (!resuming)
      for (Replica& rep : replicas_)
        for (auto& m : rep.train_metrics) m->reset();
    EpochLog log;
    log.epoch = epoch + 1;
    log.samples = resuming ? resume_->epoch_samples : 0;
    double loss_sum = resuming ? resume_->epoch_loss_sum : 0.0;
    ProgressBar progress(opt_.out, steps, bar);
    const auto t0 = Clock::now();
    strategy_->take_cross_worker_seconds();
    strategy_->take_cross_worker_wait_seconds();
    it->start_epoch(epoch, first_step);
    for (std::int64_t step = first_step; step < steps; ++step) {
      step_batches_ = it->next();
      DTRAIN_CHECK(step_batches_ != nullptr, "the input ended before steps_per_epoch");
      step_samples_ = it->global_samples();
      strategy_->set_step(global_step_);
      strategy_->run(train_fn_);
      loss_sum += strategy_->reduce_sum(replica_losses_);
      ++global_step_;
      log.samples += step_samples_;
      progress.update(step + 1, loss_sum / static_cast<double>(step + 1));
      if (lines && ((step + 1) % std::max<std::int64_t>(1, steps / 10) == 0 || step + 1 == steps))
        fmt::print(opt_.out, "  step {}/{}, loss {:.4f}\n", step + 1, steps, loss_sum / static_cast<double>(step + 1));
      const bool epoch_save_follows = step + 1 == steps && ck.every_epochs > 0 && (epoch + 1) % ck.every_epochs == 0;
      const bool stop = stop_agreed();
      if (stop || (ck.every_steps > 0 && global_step_ % ck.every_steps == 0 && !epoch_save_follows)) {
        step_batches_ = nullptr;
        const std::string path = save_checkpoint(epoch, step + 1, loss_sum, log.samples);
        if (stop) {
          progress.finish();
          throw Interrupted{path, epoch, step + 1};
        }
      }
    }
    step_batches_ = nullptr;
    log.train_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const double allreduce = strategy_->take_cross_worker_seconds();
    const double allreduce_wait = strategy_->take_cross_worker_wait_seconds();
    if (strategy_->workers() > 1) log.allreduce_seconds = allreduce;
    if (strategy_->overlaps_backward()) log.allreduce_wait_seconds = allreduce_wait;
    progress.finish();
    log.steps = steps;
    log.loss = loss_sum / static_cast<double>(steps);
    if (!exp_.metrics.empty()) log.accuracy = combined_metric(true, 0);
    if (splits_.validation) log.validation = evaluate(*splits_.validation);
    log.test = evaluate(splits_.test);
    log.global_step = global_step_;
    fmt::print(opt_.out, "{}\n{}\n", epoch_line(log), throughput_line(log));
    std::fflush(opt_.out);
    if (!opt_.run_dir.empty()) {
      std::ofstream jsonl(fs::path(opt_.run_dir) / "metrics.jsonl", std::ios::app);
      jsonl << epoch_json(log) << "\n";
      if (!jsonl) throw IoError(fmt::format("cannot append to {}/metrics.jsonl", opt_.run_dir));
    }
    if (ck.every_epochs > 0 && (epoch + 1) % ck.every_epochs == 0) save_checkpoint(epoch + 1, 0, 0.0, 0);
    history.push_back(std::move(log));
    if (stop_agreed()) {
      // Asked to stop during the evaluation: the epoch is complete; save where the next begins.
      const bool saved = ck.every_epochs > 0 && (epoch + 1) % ck.every_epochs == 0;
      const std::string path = saved ? (checkpoints_ ? *checkpoints_->latest() : std::string())
                                     : save_checkpoint(epoch + 1, 0, 0.0, 0);
      throw Interrupted{path, epoch + 1, 0};
    }
  }
  resume_.reset();
  return history;
}

}  // namespace dtrain::train
