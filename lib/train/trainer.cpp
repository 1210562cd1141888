#include "train/trainer.hpp"

#include <omp.h>
#include <sched.h>

#include <chrono>
#include <filesystem>
#include <fstream>
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
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1, omp_get_num_procs());
}

Trainer::Trainer(config::Experiment experiment, TrainerOptions options)
    : exp_(std::move(experiment)), opt_(std::move(options)) {
  threads_ = resolve_threads(exp_.train.threads);
  strategy_ = std::make_unique<distribute::Strategy>(exp_.strategy, threads_);
  omp_set_num_threads(strategy_->threads_per_replica());  // the calling thread is replica 0 when alone
  const int replicas = strategy_->num_replicas_in_sync();

  // In the strategy's scope: the loss, then per replica the metrics, the model and the optimizer.
  // Every replica builds its model from the same seed, so mirrored copies start identical; under
  // central storage the replicas compute with replica 0's (the parameter device's) variables.
  loss_ = losses::make_loss(exp_.loss);
  replicas_.resize(static_cast<std::size_t>(replicas));
  for (int r = 0; r < replicas; ++r) {
    Replica& rep = replicas_[static_cast<std::size_t>(r)];
    for (auto kind : exp_.metrics) {
      rep.train_metrics.push_back(metrics::make_metric(kind, exp_.loss));
      rep.eval_metrics.push_back(metrics::make_metric(kind, exp_.loss));
    }
    rep.model = std::make_unique<nn::Sequential>(exp_.model, exp_.seed);
    if (!strategy_->mirrors_variables() && r > 0) rep.model->share_variable_values(*replicas_[0].model);
    rep.optimizer = optim::make_optimizer(exp_.optimizer);
    distribute::BufferList grads;
    for (Variable* v : rep.model->variables()) {
      grads.data.push_back(v->grad.data<float>());
      grads.sizes.push_back(static_cast<std::size_t>(v->grad.numel()));
    }
    strategy_->bind_gradients(r, grads);
  }
  replica_losses_.assign(static_cast<std::size_t>(replicas), 0.0);
  train_fn_ = [this](const distribute::ReplicaContext& rc) { replica_train_step(rc); };
  eval_fn_ = [this](const distribute::ReplicaContext& rc) { replica_eval_step(rc); };

  splits_ = data::load_splits(exp_.data, exp_.seed);
  if (splits_.train.size() == 0) throw InputError("the training set is empty");
  const Shape sample = splits_.train.x.shape().tail();
  if (sample != model().input_shape())
    throw ConfigError(fmt::format("{}: model.input_shape {} does not match the data's sample shape {}", exp_.source_file,
                                  model().input_shape().to_string(), sample.to_string()));
}

Trainer::~Trainer() = default;

std::int64_t Trainer::global_batch_size() const {
  if (exp_.data.global_batch_size > 0) return exp_.data.global_batch_size;
  return exp_.data.batch_size_per_replica * strategy_->num_replicas_in_sync();
}

std::string Trainer::header_line() const {
  const int replicas = strategy_->num_replicas_in_sync();
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
  std::ofstream metrics(fs::path(opt_.run_dir) / "metrics.jsonl", std::ios::trunc);
  if (!cfg || !metrics) throw IoError(fmt::format("cannot write into the run directory {}", opt_.run_dir));
}

std::unique_ptr<data::DistributedIterator> Trainer::make_iterator(const data::Dataset& split, bool training) const {
  data::PipelineOptions po;
  po.seed = exp_.seed;
  po.prefetch = exp_.data.prefetch;
  data::InputContext ctx;
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
  return std::make_unique<data::DistributedIterator>(split, mode, ctx, global, po);
}

void Trainer::replica_train_step(const distribute::ReplicaContext& rc) {
  Replica& rep = replicas_[static_cast<std::size_t>(rc.replica_id)];
  const data::ReplicaBatch& batch = (*step_batches_)[static_cast<std::size_t>(rc.replica_id)];
  const float replicas = static_cast<float>(rc.num_replicas_in_sync);
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
    rep.model->backward(rep.ctx);
    for (auto& m : rep.train_metrics) m->update(batch.y, logits);
  } else {
    // No samples for this replica on a short last batch: it still adds its share of the
    // regularization gradient and takes part in the collectives.
    for (Variable* v : rep.model->variables()) v->grad.zero();
  }
  const double reg = losses::scale_regularization_loss(rep.model->regularization_loss(), rc.num_replicas_in_sync);
  rep.model->add_regularization_gradient(1.0f / replicas);
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

double Trainer::combined_metric(bool train, std::size_t index) const {
  // Exact: the states (integer counts) of every replica are merged into a fresh metric.
  auto merged = metrics::make_metric(exp_.metrics[index], exp_.loss);
  for (const Replica& rep : replicas_) merged->merge((train ? rep.train_metrics : rep.eval_metrics)[index]->state());
  return merged->result();
}

std::vector<double> Trainer::train_steps(std::int64_t epoch, std::int64_t steps) {
  auto it = make_iterator(splits_.train, true);
  it->start_epoch(epoch);
  std::vector<double> losses;
  for (std::int64_t s = 0; s < steps; ++s) {
    step_batches_ = it->next();
    if (!step_batches_) break;
    step_samples_ = 0;
    for (const auto& b : *step_batches_) step_samples_ += b.size;
    strategy_->run(train_fn_);
    losses.push_back(strategy_->reduce(distribute::ReduceOp::sum, replica_losses_));
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
    for (const auto& b : *step_batches_) r.samples += b.size;
    strategy_->run(eval_fn_);
  }
  double loss_sum = 0.0;
  for (const Replica& rep : replicas_) loss_sum += rep.eval_loss_sum;
  r.loss = r.samples ? loss_sum / static_cast<double>(r.samples) : 0.0;
  if (!exp_.metrics.empty()) r.accuracy = combined_metric(false, 0);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

std::vector<EpochLog> Trainer::fit() {
  write_run_files();
  fmt::print(opt_.out, "{}\n", header_line());
  if (!strategy_->choice_note().empty()) fmt::print(opt_.out, "{}\n", strategy_->choice_note());
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
  std::vector<EpochLog> history;
  for (int epoch = 0; epoch < exp_.train.epochs; ++epoch) {
    for (Replica& rep : replicas_)
      for (auto& m : rep.train_metrics) m->reset();
    EpochLog log;
    log.epoch = epoch + 1;
    ProgressBar progress(opt_.out, steps, bar);
    const auto t0 = Clock::now();
    double loss_sum = 0.0;
    it->start_epoch(epoch);
    for (std::int64_t step = 0; step < steps; ++step) {
      step_batches_ = it->next();
      DTRAIN_CHECK(step_batches_ != nullptr, "the input ended before steps_per_epoch");
      step_samples_ = 0;
      for (const auto& b : *step_batches_) step_samples_ += b.size;
      strategy_->run(train_fn_);
      loss_sum += strategy_->reduce(distribute::ReduceOp::sum, replica_losses_);
      ++global_step_;
      log.samples += step_samples_;
      progress.update(step + 1, loss_sum / static_cast<double>(step + 1));
      if (lines && ((step + 1) % std::max<std::int64_t>(1, steps / 10) == 0 || step + 1 == steps))
        fmt::print(opt_.out, "  step {}/{}, loss {:.4f}\n", step + 1, steps, loss_sum / static_cast<double>(step + 1));
    }
    step_batches_ = nullptr;
    log.train_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
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
    history.push_back(std::move(log));
  }
  return history;
}

}  // namespace dtrain::train
