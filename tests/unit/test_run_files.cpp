// What a run writes besides checkpoints, when training goes wrong: metrics.jsonl stays JSON with
// non-finite figures, a non-finite loss stops training before a checkpoint is written, and a
// resumed run cuts its metrics log back to the epoch it resumes; a relative checkpoint.dir lies
// inside the run directory; what observes a run (observe/) is added to the loop from outside.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <string>

#include "core/error.hpp"
#include "observe/observers.hpp"
#include "observe/report.hpp"
#include "train/callbacks.hpp"
#include "checkpoint/run_dir.hpp"
#include "config/parse.hpp"
#include "test_support.hpp"
#include "train/trainer.hpp"
#include "trainer_support.hpp"

using namespace dtrain;
using namespace dtrain::train;
using namespace dtrain::observe;
using namespace dtrain::checkpoint;

TEST_CASE("metrics.jsonl: a non-finite figure is written as null, with what it held") {
  EpochLog log;
  log.epoch = 1;
  log.loss = std::numeric_limits<double>::quiet_NaN();
  log.test = EvalResult{std::numeric_limits<double>::infinity(), 0.5, 10, 0.1};
  const std::string json = epoch_json(log);
  CHECK(json.find(": nan") == std::string::npos);
  CHECK(json.find(": inf") == std::string::npos);
  CHECK(json.find(R"("loss": null)") != std::string::npos);
  CHECK(json.find(R"("test_loss": null)") != std::string::npos);
  CHECK(json.find(R"("non_finite": {"loss": "nan", "test_loss": "inf"})") != std::string::npos);
  CHECK(json.back() == '}');
  log.loss = 0.25;
  log.test->loss = 0.5;
  CHECK(epoch_json(log).find("non_finite") == std::string::npos);
}

TEST_CASE("TerminateOnNaN stops on the first non-finite step loss, before the checkpoint saver") {
  TerminateOnNaN terminate;
  LoopState state;
  state.epoch = 1;
  state.step = 4;
  state.loss_sum = 3.5;
  terminate.on_train_batch_end(state);  // finite: nothing happens
  for (double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    state.loss_sum = bad;
    state.checkpoint = "run/checkpoints/ckpt-8.h5";
    try {
      terminate.on_train_batch_end(state);
      FAIL("no error");
    } catch (const TrainingDiverged& e) {
      CHECK(e.kind() == ErrorKind::config);  // exit 2
      CHECK(std::string(e.what()).find("epoch 2, step 4") != std::string::npos);
      CHECK(std::string(e.what()).find("ckpt-8.h5") != std::string::npos);
    }
  }
}

TEST_CASE("a resumed run's metrics.jsonl keeps the epochs before the one it resumes") {
  const std::string log = "{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 2, \"loss\": 2}\n{\"epoch\": 3, \"loss\": 3}\n"
                          "{\"epoch\": 2, \"loss\": 2.5}\n{\"epoch\": 4, \"lo";
  // Resumed at 0-based epoch 2 (epochs 1 and 2 complete): every line of an epoch <= 2 stays, in
  // order; epoch 3 (trained again) and the cut-short last line go.
  CHECK(metrics_lines_through(log, 2) ==
        "{\"epoch\": 1, \"loss\": 1}\n{\"epoch\": 2, \"loss\": 2}\n{\"epoch\": 2, \"loss\": 2.5}\n");
  CHECK(metrics_lines_through(log, 0).empty());
  CHECK(metrics_lines_through("garbage\n{\"epoch\": 1}\n", 5) == "{\"epoch\": 1}\n");
}

TEST_CASE("a relative checkpoint.dir lies inside the run directory, whatever the current directory") {
  config::CheckpointConfig c;
  CHECK(checkpoint_dir_of("A/r", c) == "A/r/checkpoints");
  c.dir = "myck";
  CHECK(checkpoint_dir_of("A/r", c) == "A/r/myck");
  CHECK(checkpoint_dir_of("", c).empty());
  c.dir = "/scratch/ck";
  CHECK(checkpoint_dir_of("A/r", c) == "/scratch/ck");
  // And back, for `dtrain resume --checkpoint FILE` alone.
  c.dir = "deep/ck";
  CHECK(run_dir_of_checkpoint("../A/r/deep/ck/ckpt-30.h5", c) == "../A/r");
  c.dir = "";
  CHECK(run_dir_of_checkpoint("runs/x/checkpoints/ckpt-30.h5", c) == "runs/x");
  c.dir = "/scratch/ck";
  CHECK(run_dir_of_checkpoint("/scratch/ck/ckpt-30.h5", c) == "/scratch");
  c.dir = "../shared";
  CHECK(run_dir_of_checkpoint("A/shared/ckpt-30.h5", c) == "A");
}

TEST_CASE("the loop knows no observer: without observe::add_observers a run prints its epoch lines alone") {
  const std::string yaml = testing::small_data_experiment("observed", 3, "{kind: default}", 16) +
                           "model: {input_shape: [28, 28, 1], layers: [{flatten: {}}, {dense: {units: 10}}]}\n"
                           "loss: {kind: sparse_categorical_crossentropy, from_logits: true}\n"
                           "optimizer: {kind: sgd}\nmetrics: [sparse_categorical_accuracy]\n"
                           "train: {epochs: 1, steps_per_epoch: 2, threads: 1, progress: lines, tensorboard: true}\n";
  for (const bool observed : {false, true}) {
    CAPTURE(observed);
    testing::ScratchDir dir("observers");
    std::FILE* out = std::tmpfile();
    REQUIRE(out != nullptr);
    TrainerOptions options;
    options.out = out;
    options.run_dir = dir.path().string();
    if (observed) options.observers = add_observers;
    Trainer(config::parse_experiment(yaml, "test.yaml", {}), options).fit();
    std::rewind(out);
    std::string printed(4096, '\0');
    printed.resize(std::fread(printed.data(), 1, printed.size(), out));
    std::fclose(out);
    CHECK(printed.find("\nEpoch 1, Loss: ") != std::string::npos);
    CHECK((printed.find("  step 2/2, loss ") != std::string::npos) == observed);
    CHECK(std::filesystem::exists(dir.path() / "metrics.jsonl") == observed);
    CHECK(std::filesystem::exists(dir.path() / "tensorboard") == observed);
    CHECK(std::filesystem::exists(dir.path() / "config.yaml"));  // the loop's own run files
  }
}
