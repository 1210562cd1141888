// One checkpoint = one HDF5 file, readable with h5dump/h5py under meaningful names:
//
//   /                                 attributes format_version (int), dtrain_version, created_by = "dtrain"
//   /model/<layer>/<weight>           float32 in the variable's Keras layout: conv kernels (kh, kw, in, out),
//                                     dense kernels (in, out), biases (n,)
//   /optimizer                        attributes name ("adam") and iterations (int64)
//   /optimizer/<slot>/<layer>/<weight> float32, shaped like its variable (slot names from slot_names())
//   /state/<counter>                  scalar datasets: epoch, step_in_epoch, global_step (int64), seed
//                                     (uint64), epoch_loss_sum (float64), epoch_samples (int64)
//   /state/metrics/<i>/counts, sums   int64 (n,) and float64 (n,): training metric i's running state
//   /experiment                       the resolved experiment YAML as a fixed-length string
//
// Every dataset carries an attribute crc32 (zlib crc32 of its stored bytes), verified on read, so a
// corrupt file is refused instead of silently training from garbage. The whole file is checksummed
// too: its first 512 bytes are an HDF5 user block (HDF5 itself skips it; h5py, h5dump and h5diff
// read the file as usual) holding "DTRAINCK", a version, the length and the crc32 of everything
// after the block. It is verified before HDF5 opens the file, because HDF5 1.10 can crash on a
// corrupt object header rather than report it. Files without the block (older dtrain: HDF5's
// signature at byte 0) are read with the per-dataset checks alone; a file that starts with
// anything else is refused. /state values are range-checked too (kMaxEpochs, kMaxGlobalStep). Datasets are contiguous and
// uncompressed: a checkpoint is written at a step boundary while training waits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "nn/model.hpp"
#include "optim/optimizer.hpp"

namespace dtrain::checkpoint {

inline constexpr int kFormatVersion = 1;
// The HDF5 user block at the start of every checkpoint, holding the whole-file checksum.
inline constexpr std::size_t kSealBytes = 512;
// The largest /state values a checkpoint may hold (larger ones are refused as corrupt): epochs
// count in an int, and global_step (and the samples of an epoch) leave room to count on.
inline constexpr std::int64_t kMaxEpochs = std::int64_t{1} << 31;
inline constexpr std::int64_t kMaxGlobalStep = std::int64_t{1} << 62;

// Checks a checkpoint's whole-file checksum: true when it matches, false when it does not (or the
// seal's version is unknown, or the file starts with neither the seal nor HDF5's signature: one
// damaged byte of the seal must not turn the check off), nullopt when the file has no seal (an
// older dtrain's: HDF5's signature at byte 0) or cannot be read.
std::optional<bool> verify_seal(const std::string& path);

struct TrainingState {
  std::int64_t epoch = 0;          // 0-based epoch to continue in
  std::int64_t step_in_epoch = 0;  // steps of `epoch` already done (0 = at its start)
  std::int64_t global_step = 0;
  // The shuffle RNG is Rng(seed, shuffle, epoch): (seed, epoch, step_in_epoch) is the iterator state.
  std::uint64_t seed = 0;
  // The unfinished epoch's running figures, so the epoch line printed after a resume equals an
  // uninterrupted run's.
  double epoch_loss_sum = 0.0;  // sum of step losses so far this epoch
  std::int64_t epoch_samples = 0;
  std::vector<std::vector<std::int64_t>> metric_counts;  // one entry per training metric: MetricState.counts
  std::vector<std::vector<double>> metric_sums;          // and MetricState.sums
  // The layout that wrote it: replicas in sync over how many worker processes, and the global
  // batch (so that a resume on another layout can say what that changes). 0 in checkpoints written
  // before dtrain stored them.
  std::int64_t replicas_in_sync = 0;
  std::int64_t workers = 0;
  std::int64_t global_batch = 0;
  bool operator==(const TrainingState&) const = default;
};

// Where in training a state stands, epochs counted from 1 as the epoch lines count them: "after
// epoch 2" at an epoch's end, "epoch 3, step 10 of it" within one.
std::string position_in_training(const TrainingState& state);

// What a checkpoint holds besides the model and the optimizer.
struct Contents {
  TrainingState state;
  std::string experiment_yaml;  // the resolved experiment (config::to_yaml)
  std::string dtrain_version;
  bool operator==(const Contents&) const = default;
};

// Writes atomically: <path>.tmp-<pid>, flush and close, fsync of the file, rename to `path`, fsync
// of the directory. On failure the temporary is removed and IoError names the path; an existing
// file at `path` is never left half-written.
void save(const std::string& path, const nn::Sequential& model, const optim::Optimizer& optimizer,
          const Contents& contents);

// Reads and verifies everything (format version, every checksum, every shape, the optimizer's kind
// and slots) before writing the weights into `model` and the slots and iterations into `optimizer`
// (which is build() for the model's variables first). Any problem is an InputError naming the file
// and what failed, and then `model` and `optimizer` are unchanged.
Contents restore(const std::string& path, nn::Sequential& model, optim::Optimizer& optimizer);

// Reads and verifies only the contents (no model needed): `dtrain eval` and `resume` get the
// stored experiment this way before they can build the model.
Contents peek(const std::string& path);

// Like restore, for the model weights only (`dtrain eval`): the optimizer group is not read.
Contents restore_model(const std::string& path, nn::Sequential& model);

}  // namespace dtrain::checkpoint
