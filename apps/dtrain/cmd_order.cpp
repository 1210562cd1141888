// dtrain order: the order in which a run of an experiment takes its training samples, epoch by
// epoch, so that another framework can be fed the batches dtrain takes
// (tools/tf_reference/tf_ctl.py --order). The order is a function of the experiment alone (the
// data, its validation_split, data.shuffle_buffer and the seed, drawn per epoch as the pipeline
// draws it), so it is computed here without training.
//
// The file is NumPy's .npy (version 1.0): int64, shape (epochs, train samples), row e the indices
// into the training split (the file's order, after validation_split) of epoch e + 1. Global batch
// k of an epoch is the row's samples [k * G, (k + 1) * G), split over replicas and workers as
// docs/strategies.md describes; drop_remainder drops the short tail.
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "commands.hpp"
#include "config/parse.hpp"
#include "core/atomic_file.hpp"
#include "core/error.hpp"
#include "data/dataset.hpp"
#include "data/pipeline.hpp"
#include "data/sharding.hpp"

namespace dtrain::app {

namespace {

// A .npy image of a C-order int64 matrix: the magic, version 1.0, the header's length, a Python
// dict literal padded with spaces to a multiple of 64 bytes and ending in a newline, the data.
std::string npy_int64(const std::vector<std::int64_t>& values, std::int64_t rows, std::int64_t cols) {
  std::string header = fmt::format("{{'descr': '<i8', 'fortran_order': False, 'shape': ({}, {}), }}", rows, cols);
  const std::size_t preamble = 10;  // magic (6), version (2), header length (2)
  header.append(63 - (preamble + header.size()) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  const std::size_t at = out.size();
  out.resize(at + values.size() * sizeof(std::int64_t));
  static_assert(std::endian::native == std::endian::little, "the .npy header says little-endian");
  std::memcpy(out.data() + at, values.data(), values.size() * sizeof(std::int64_t));
  return out;
}

}  // namespace

int order_command(const OrderArgs& args) {
  const config::Experiment exp = config::load_experiment(args.experiment, args.overrides);
  refuse_writing_onto(args.output, "-o", {args.experiment}, exp);
  const std::int64_t epochs = args.epochs > 0 ? args.epochs : exp.train.epochs;
  // Worker 0's order, which is every worker's unless auto_shard is off (then each shuffles with a
  // seed of its own) or the workers load different shard files.
  const data::ShardPlan plan = data::plan_shards(exp.data, 1, 0);
  data::DataSplits splits;
  try {
    splits = data::load_splits(exp.data, exp.seed, plan.files);
  } catch (const InputError& e) {  // located at the key that chose the data, as `run` locates it
    throw InputError(config::given_prefix(exp.data_where, {exp.source_file, 0, 0}) + e.what());
  }
  const std::int64_t n = splits.train.size();
  std::vector<std::int64_t> order;
  order.reserve(static_cast<std::size_t>(epochs * n));
  for (std::int64_t e = 0; e < epochs; ++e) {
    const std::vector<std::int64_t> epoch = data::shuffle_order(n, exp.data.shuffle_buffer, plan.train_seed(exp.seed), e);
    order.insert(order.end(), epoch.begin(), epoch.end());
  }
  write_file_atomically(args.output, npy_int64(order, epochs, n));
  fmt::print("Wrote the training order of {} to {}: {} epochs x {} samples (data.shuffle_buffer {}, seed {})\n",
             args.experiment, args.output, epochs, n, exp.data.shuffle_buffer, exp.seed);
  return kOk;
}

}  // namespace dtrain::app
