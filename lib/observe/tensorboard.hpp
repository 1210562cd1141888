// TensorBoard scalars of a run, written as TensorFlow's summary writer writes them: event files
// <run dir>/tensorboard/events.out.tfevents.<seconds>.<host>.<pid> holding TFRecords
// (observe/tfrecord.hpp) of tensorflow.Event protocol buffers (lib/observe/proto, TensorFlow's
// schema). `tensorboard --logdir runs` reads them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "observe/tfrecord.hpp"
#include "train/callbacks.hpp"

namespace dtrain::observe {

// One event file: its first record is the file_version event, as TensorBoard expects.
class EventFileWriter {
 public:
  // Creates `directory` if needed and a new event file in it (never an existing one).
  explicit EventFileWriter(const std::string& directory);
  // One event at global step `step` with a simple_value per (tag, value).
  void scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // A session start at `step`: TensorBoard drops what earlier files logged at this step and after,
  // which a resumed run computes again.
  void session_start(std::int64_t step);
  const std::string& path() const { return records_->path(); }

 private:
  void write(const std::string& serialized_event);
  std::unique_ptr<TFRecordWriter> records_;
};

// The Keras-style callback: the step loss every `log_every_steps` global steps (0: none), and after
// each epoch its figures (train/, validation/ and test/ loss and accuracy as fractions, as in
// metrics.jsonl), the learning rate and the training samples/s, all at the epoch's global step.
// add_observers (observers.hpp) adds it where there is a run directory: on the chief only.
class TensorBoardLogger final : public train::Callback {
 public:
  // `resumed_at`: the global step of the checkpoint a resumed run continues from.
  TensorBoardLogger(std::string run_dir, std::int64_t log_every_steps, std::function<double()> learning_rate,
                    std::optional<std::int64_t> resumed_at);
  void on_train_begin(train::LoopState&) override;
  void on_epoch_begin(train::LoopState& s) override { previous_loss_sum_ = s.loss_sum; }
  void on_train_batch_end(train::LoopState& s) override;
  void on_epoch_end(train::LoopState&, const train::EpochLog& log) override;

 private:
  std::string run_dir_;
  std::int64_t log_every_steps_;
  std::function<double()> learning_rate_;
  std::optional<std::int64_t> resumed_at_;
  std::optional<EventFileWriter> events_;
  double previous_loss_sum_ = 0.0;  // the epoch's loss sum before the latest step
};

}  // namespace dtrain::observe
