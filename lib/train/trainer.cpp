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
  omp_set_num_threads(threads_);
  // Create the loss, the metrics, the model and the optimizer, then the datasets.
  loss_ = losses::make_loss(exp_.loss);
  for (auto kind : exp_.metrics) train_metrics_.push_back(metrics::make_metric(kind, exp_.loss));
  model_ = std::make_unique<nn::Sequential>(exp_.model, exp_.seed);
  optimizer_ = optim::make_optimizer(exp_.optimizer);
  splits_ = data::load_splits(exp_.data, exp_.seed);
  if (splits_.train.size() == 0) throw InputError("the training set is empty");
  const Shape sample = splits_.train.x.shape().tail();
  if (sample != model_->input_shape())
    throw ConfigError(fmt::format("{}: model.input_shape {} does not match the data's sample shape {}", exp_.source_file,
                                  model_->input_shape().to_string(), sample.to_string()));
}

Trainer::~Trainer() = default;

std::string Trainer::header_line() const {
  const std::int64_t global_batch = exp_.data.batch_size_per_replica;  // one replica in sync
  return fmt::format(
      "dtrain {} | experiment {} | strategy {} | replicas 1 (cpu:0) | global batch {} | learning rate {:g} | "
      "threads {} | oneDNN {} isa {}",
      build_info::version, exp_.name, config::name_of(exp_.strategy.kind), global_batch, optimizer_->learning_rate(),
      threads_, kernels::cpu::dnnl_version(), kernels::cpu::effective_isa());
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

double Trainer::train_step(const data::Batch& batch) {
  const std::int64_t n = batch.size;
  const Tensor& logits = model_->forward(ctx_, batch.x);
  per_example_.resize(static_cast<std::size_t>(n));
  loss_->per_example(logits, batch.y, per_example_);

  // Default strategy: one replica, so the global samples of this step are the batch's samples.
  const std::int64_t global_samples = n;
  const int replicas = 1;
  double data_loss = 0.0;
  float scale = 1.0f;
  switch (exp_.loss.reduction) {
    case config::Reduction::none:
      data_loss = losses::compute_average_loss(per_example_, global_samples);
      scale = 1.0f / static_cast<float>(global_samples);
      break;
    case config::Reduction::sum:
      data_loss = losses::reduce_loss(per_example_, config::Reduction::sum);
      break;
    case config::Reduction::sum_over_batch_size:
    case config::Reduction::auto_reduction:
      data_loss = losses::reduce_loss(per_example_, config::Reduction::sum_over_batch_size);
      scale = 1.0f / static_cast<float>(n);
      break;
  }
  loss_->gradient(logits, batch.y, {}, scale, model_->output_gradient());
  model_->backward(ctx_);
  const double reg = losses::scale_regularization_loss(model_->regularization_loss(), replicas);
  model_->add_regularization_gradient(1.0f / static_cast<float>(replicas));
  optimizer_->apply_gradients(model_->variables());
  for (auto& m : train_metrics_) m->update(batch.y, logits);
  ++global_step_;
  return data_loss + reg;
}

EvalResult Trainer::evaluate(const data::Dataset& split) {
  const auto t0 = Clock::now();
  data::PipelineOptions po;
  po.batch_size = exp_.data.eval_batch_size > 0 ? exp_.data.eval_batch_size : exp_.data.batch_size_per_replica;
  po.shuffle_buffer = 0;
  po.seed = exp_.seed;
  po.prefetch = exp_.data.prefetch;
  data::Pipeline pipeline(split, po);
  pipeline.start_epoch(0);
  std::vector<std::unique_ptr<metrics::Metric>> eval_metrics;
  for (auto kind : exp_.metrics) eval_metrics.push_back(metrics::make_metric(kind, exp_.loss));
  double loss_sum = 0.0;
  std::vector<float> per_example;
  EvalResult r;
  while (const data::Batch* b = pipeline.next()) {
    const Tensor& logits = model_->forward(ctx_, b->x);
    per_example.resize(static_cast<std::size_t>(b->size));
    loss_->per_example(logits, b->y, per_example);
    loss_sum += std::accumulate(per_example.begin(), per_example.end(), 0.0);
    for (auto& m : eval_metrics) m->update(b->y, logits);
    r.samples += b->size;
  }
  r.loss = r.samples ? loss_sum / static_cast<double>(r.samples) : 0.0;
  if (!eval_metrics.empty()) r.accuracy = eval_metrics.front()->result();
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

std::vector<EpochLog> Trainer::fit() {
  write_run_files();
  fmt::print(opt_.out, "{}\n", header_line());
  std::fflush(opt_.out);

  data::PipelineOptions po;
  po.batch_size = exp_.data.batch_size_per_replica;
  po.shuffle_buffer = exp_.data.shuffle_buffer;
  po.drop_remainder = exp_.data.drop_remainder;
  po.seed = exp_.seed;
  po.prefetch = exp_.data.prefetch;
  data::Pipeline pipeline(splits_.train, po);
  std::int64_t steps = pipeline.steps_per_epoch();
  if (exp_.train.steps_per_epoch > 0) steps = std::min(steps, exp_.train.steps_per_epoch);
  if (steps == 0)
    throw ConfigError(fmt::format("{}: an epoch has no steps: {} training samples, batch {} with drop_remainder",
                                  exp_.source_file, splits_.train.size(), po.batch_size));

  const bool bar = exp_.train.progress == config::ProgressMode::bar ||
                   (exp_.train.progress == config::ProgressMode::auto_detect && opt_.out_is_tty);
  const bool lines = exp_.train.progress == config::ProgressMode::lines;
  std::vector<EpochLog> history;
  for (int epoch = 0; epoch < exp_.train.epochs; ++epoch) {
    for (auto& m : train_metrics_) m->reset();
    EpochLog log;
    log.epoch = epoch + 1;
    ProgressBar progress(opt_.out, steps, bar);
    const auto t0 = Clock::now();
    double loss_sum = 0.0;
    pipeline.start_epoch(epoch);
    for (std::int64_t step = 0; step < steps; ++step) {
      const data::Batch* batch = pipeline.next();
      DTRAIN_CHECK(batch != nullptr, "the pipeline ended before steps_per_epoch");
      loss_sum += train_step(*batch);
      log.samples += batch->size;
      progress.update(step + 1, loss_sum / static_cast<double>(step + 1));
      if (lines && ((step + 1) % std::max<std::int64_t>(1, steps / 10) == 0 || step + 1 == steps))
        fmt::print(opt_.out, "  step {}/{}, loss {:.4f}\n", step + 1, steps, loss_sum / static_cast<double>(step + 1));
    }
    log.train_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    progress.finish();
    log.steps = steps;
    log.loss = loss_sum / static_cast<double>(steps);
    if (!train_metrics_.empty()) log.accuracy = train_metrics_.front()->result();
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
