// Datasets held in memory and the train/validation/test splits an experiment trains on.
//
// Shapes:
//   x: (N, ...feature dims)  u8 for images (kept as bytes: 60000x784 floats are never held) or
//                            f32 for real-valued features; a batch converts to f32 times x_scale.
//   y: (N,)   i32 class labels in [0, num_classes), or
//      (N, k) f32 targets (regression, one-hot), num_classes = k.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "config/experiment.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"

namespace dtrain::data {

inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct Dataset {
  Tensor x;
  Tensor y;
  int num_classes = 0;
  // num_classes was counted from the labels (largest + 1), not declared by the source: a label
  // past the model's outputs is then the data's fault more likely than the model's.
  bool classes_from_labels = false;
  float x_scale = 1.0f;     // what a batch multiplies x by when it converts to f32
  std::string description;  // for logs: "fashion_mnist train (60000 examples) from /usr/share/..."
  // Where the labels were read ("<file>" or "<file> /train/y"; empty for generated data) and the
  // file row of this dataset's first sample, so an error can name the file and the sample.
  std::string labels_source;
  std::int64_t first_row = 0;

  std::int64_t size() const { return x.defined() ? x.shape()[0] : 0; }
  bool has_labels() const { return y.dtype() == DType::i32; }
};

// Sample `i` of `ds` as the model takes it: its row of x converted to f32 times x_scale, written
// to dst (x.shape().tail().numel() floats).
void sample_as_f32(const Dataset& ds, std::int64_t i, float* dst);
// Asks the CPU to start loading sample i's row of x into the caches (no effect on any value).
void prefetch_sample(const Dataset& ds, std::int64_t i);

// A tensor of `shape` and `dtype` in host memory for `what` (a dataset, say "/train/x") of the data
// `path`; where the machine or the process cannot hold it (dtrain holds every split in memory),
// data_out_of_memory's error.
Tensor data_tensor(const std::string& path, const std::string& what, const Shape& shape, DType dtype);
// The InputError for `what` of the data `path` that the process cannot hold (`why`): the file, the
// reason and what to do.
[[noreturn]] void data_out_of_memory(const std::string& path, const std::string& what, const std::string& why);

// The error text for class id `label` of sample `index` of `where` (a file, or a file and its
// dataset) that is negative, or not below the `classes` the source declares (0: none declared).
std::string label_out_of_range(const std::string& where, std::int64_t label, std::int64_t index, std::int64_t classes);

// Rows [begin, end) of a dataset; shares storage with `whole` (no copy).
Dataset take_rows(const Dataset& whole, std::int64_t begin, std::int64_t end, std::string description);

// Random u8 images of `shape` (without the batch dimension) and i32 labels in [0, classes).
// Each class brightens its own band of pixels, so a model can learn the labels (accuracy rises
// above chance). Sample i of split `split_index` draws from Rng(seed, synthetic,
// split_index * 2^40 + i): train (split 0) and test (split 1) never share a sample, and the data do
// not depend on `size` (the first k samples are the same whatever size is asked).
Dataset make_synthetic(const std::vector<std::int64_t>& shape, int classes, std::int64_t size, std::uint64_t seed,
                       std::uint64_t split_index);

// One example repeated `size` times, as tf.data.Dataset.from_tensors((x, y)).repeat(size):
// x (size, len(x)) f32, y (size, len(y)) f32.
Dataset make_repeated(const std::vector<double>& x, const std::vector<double>& y, std::int64_t size);

struct DataSplits {
  Dataset train;
  std::optional<Dataset> validation;  // present when validation_split > 0
  Dataset test;
};

// The samples of `parts` one after another (x and y copied once). The parts must agree on the
// sample shape and types; num_classes is the largest part's.
Dataset concatenate(const std::vector<Dataset>& parts, std::string description);

// InputError naming the file and the first sample whose integer label lies outside [0, classes)
// (checked once at start rather than when its batch trains); nothing for float targets.
void check_label_range(const DataSplits& splits, std::int64_t classes);

// InputError naming the file and the first sample with a float target outside [0, 1], for a
// crossentropy loss, which reads float targets as probabilities (a negative or larger target
// trains to a loss that falls without bound); nothing for integer labels.
void check_probability_targets(const DataSplits& splits, std::string_view loss);

// InputError naming `file`, `dataset` and the first sample (row of `x`, counted from 0) holding a
// NaN or an infinity: non-finite inputs would train to non-finite weights without a word.
void check_finite(const Tensor& x, const std::string& file, const std::string& dataset);

// data.validation_split leaves no sample on one side (load_splits): the caller locates it at the key.
struct ValidationSplitError : ConfigError {
  using ConfigError::ConfigError;
};

// Loads the experiment's data (an empty training split is an InputError). validation_split follows
// Keras: the LAST fraction of the training set, before any shuffling, is held out;
// floor(N * (1 - split)) samples stay in train.
// With source hdf5 and data.shards, `shard_files` are the files to load (a worker's share, see
// data/sharding.hpp), concatenated in order; every shard when left empty.
DataSplits load_splits(const config::DataConfig& config, std::uint64_t seed,
                       const std::vector<std::string>& shard_files = {});

}  // namespace dtrain::data
