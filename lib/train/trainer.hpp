// The training loop, laid out as the tf.distribute custom-training-loop template:
//   create the loss, the metrics, the model and the optimizer, the datasets;
//   for each epoch: the train steps, then validation, then test; print the epoch line.
//
// Loss semantics (DESIGN.md): with reduction `none` a step's loss is
// compute_average_loss(per_example, global batch) — divided by the samples the step really has,
// so a short last batch is weighted by its real size — plus the regularization loss divided by
// the replicas in sync; `sum` does not divide; `sum_over_batch_size`/`auto` divide by the batch.
// The epoch's Loss is the mean over its steps of that step loss.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "config/experiment.hpp"
#include "data/dataset.hpp"
#include "data/pipeline.hpp"
#include "kernels/cpu/dnnl_context.hpp"
#include "losses/loss.hpp"
#include "metrics/metric.hpp"
#include "nn/model.hpp"
#include "optim/optimizer.hpp"
#include "train/report.hpp"

namespace dtrain::train {

struct TrainerOptions {
  std::string run_dir;          // where config.yaml and metrics.jsonl go; empty = write nothing
  std::FILE* out = stdout;      // epoch lines
  bool out_is_tty = false;      // progress: auto draws a bar only on a terminal
};

// Compute threads for an experiment's `train.threads` (0 = every core this process may use).
int resolve_threads(int configured);

class Trainer {
 public:
  Trainer(config::Experiment experiment, TrainerOptions options);
  ~Trainer();

  // Trains every epoch and returns their logs.
  std::vector<EpochLog> fit();
  // Mean loss and metrics over a whole split, no shuffling, every sample exactly once.
  EvalResult evaluate(const data::Dataset& split);

  nn::Sequential& model() { return *model_; }
  const config::Experiment& experiment() const { return exp_; }
  std::string header_line() const;

 private:
  // One optimizer step on one batch; returns the step loss.
  double train_step(const data::Batch& batch);
  void write_run_files();

  config::Experiment exp_;
  TrainerOptions opt_;
  int threads_ = 1;
  kernels::cpu::Context ctx_;
  data::DataSplits splits_;
  std::unique_ptr<losses::Loss> loss_;
  std::vector<std::unique_ptr<metrics::Metric>> train_metrics_;
  std::unique_ptr<nn::Sequential> model_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::vector<float> per_example_;  // reused every step
  std::int64_t global_step_ = 0;
};

}  // namespace dtrain::train
