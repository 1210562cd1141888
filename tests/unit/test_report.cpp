// What a run prints after each epoch: the template's epoch line, the throughput line (with the
// cross-worker all-reduce figures of a multi-worker run) and the metrics.jsonl record.
#include <doctest/doctest.h>

#include <string>

#include "observe/report.hpp"
#include "train/epoch_log.hpp"

using namespace dtrain::train;
using dtrain::observe::epoch_json;

namespace {
EpochLog sample_log() {
  EpochLog log;
  log.epoch = 2;
  log.loss = 0.50904;
  log.accuracy = 0.81577;
  log.test = EvalResult{0.39141, 0.85671, 10000, 0.81};
  log.samples = 60000;
  log.steps = 938;
  log.train_seconds = 15.0;
  log.global_step = 1876;
  return log;
}
}  // namespace

TEST_CASE("report: the epoch line follows the custom-training-loop template") {
  CHECK(epoch_line(sample_log()) == "Epoch 2, Loss: 0.5090, Accuracy: 81.58, Test Loss: 0.3914, Test Accuracy: 85.67");
}

TEST_CASE("report: the throughput line gives the all-reduce time only for several workers, and what was waited for "
          "when it overlaps backward") {
  EpochLog log = sample_log();
  CHECK(throughput_line(log) == "  train 4000.0 samples/s (938 steps, 15.00 s), eval 0.81 s");
  CHECK(epoch_json(log).find("allreduce") == std::string::npos);
  log.allreduce_seconds = 0.938;
  CHECK(throughput_line(log) == "  train 4000.0 samples/s (938 steps, 15.00 s), eval 0.81 s, all-reduce across workers 1.00 ms/step");
  CHECK(epoch_json(log).find(R"("allreduce_seconds": 0.9380, "train_samples": 60000)") != std::string::npos);
  log.allreduce_seconds = 6.3;
  log.allreduce_wait_seconds = 0.2814;
  CHECK(throughput_line(log) ==
        "  train 4000.0 samples/s (938 steps, 15.00 s), eval 0.81 s, all-reduce across workers 6.72 ms/step in flight "
        "overlapping backward, 0.30 ms/step waited for");
  CHECK(epoch_json(log).find(R"("allreduce_seconds": 6.3000, "allreduce_wait_seconds": 0.2814)") != std::string::npos);
}
