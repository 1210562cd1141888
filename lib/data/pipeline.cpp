#include "data/pipeline.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include <fmt/format.h>

#include "core/checked.hpp"
#include "core/compute_thread.hpp"
#include "core/error.hpp"
#include "core/rng.hpp"

namespace dtrain::data {

std::vector<std::int64_t> shuffle_order(std::int64_t size, std::int64_t buffer, std::uint64_t seed, std::int64_t epoch) {
  DTRAIN_CHECK(size >= 0 && buffer >= 0 && epoch >= 0, "shuffle_order needs non-negative size, buffer and epoch");
  std::vector<std::int64_t> order;
  order.reserve(static_cast<std::size_t>(size));
  if (buffer <= 1 || size <= 1) {
    order.resize(static_cast<std::size_t>(size));
    std::iota(order.begin(), order.end(), std::int64_t{0});
    return order;
  }
  Rng rng(seed, RngStream::shuffle, static_cast<std::uint64_t>(epoch));
  std::vector<std::int64_t> pool(static_cast<std::size_t>(std::min(buffer, size)));
  std::iota(pool.begin(), pool.end(), std::int64_t{0});
  auto next_input = static_cast<std::int64_t>(pool.size());
  while (!pool.empty()) {
    const auto slot = static_cast<std::size_t>(rng.below(pool.size()));
    order.push_back(pool[slot]);
    if (next_input < size) {
      pool[slot] = next_input++;
    } else {
      pool[slot] = pool.back();
      pool.pop_back();
    }
  }
  return order;
}

std::int64_t part_offset(std::int64_t size, int parts, int part, std::int64_t granule) {
  const std::int64_t units = ceil_div(size, granule);
  const std::int64_t base = units / parts, extra = units % parts;
  return std::min(size, (part * base + std::min<std::int64_t>(part, extra)) * granule);
}

std::int64_t replica_offset(std::int64_t size, int replicas, int replica, std::int64_t granule) {
  const std::int64_t each = ceil_div(ceil_div(size, granule), replicas);
  return std::min(size, replica * each * granule);
}

Pipeline::Pipeline(const Dataset& dataset, PipelineOptions options) : dataset_(dataset), options_(options) {
  if (options_.batch_size < 1)
    throw ConfigError(fmt::format("batch size {} is less than 1; set data.batch_size_per_replica to at least 1",
                                  options_.batch_size));
  if (options_.shuffle_buffer < 0)
    throw ConfigError(fmt::format("data.shuffle_buffer {} is negative; use 0 for no shuffling", options_.shuffle_buffer));
  DTRAIN_CHECK(dataset_.x.defined() && dataset_.y.defined(), "pipeline over a dataset without tensors");
  DTRAIN_CHECK(dataset_.x.dtype() == DType::u8 || dataset_.x.dtype() == DType::f32,
               fmt::format("pipeline converts u8 or f32 features, not {}", dtype_name(dataset_.x.dtype())));
  DTRAIN_CHECK(dataset_.y.shape().rank() >= 1 && dataset_.y.shape()[0] == dataset_.size(), "x and y sizes differ");
  DTRAIN_CHECK(options_.shard_count >= 1 && options_.shard_index >= 0 && options_.shard_index < options_.shard_count,
               fmt::format("shard {} of {} does not exist", options_.shard_index, options_.shard_count));
  DTRAIN_CHECK(options_.parts >= 1 && options_.part_begin >= 0 && options_.part_begin < options_.part_end &&
                   options_.part_end <= options_.parts,
               fmt::format("parts [{}, {}) of {} do not exist", options_.part_begin, options_.part_end, options_.parts));
}

std::int64_t Pipeline::size() const {
  const std::int64_t n = dataset_.size(), count = options_.shard_count, index = options_.shard_index;
  return n > index ? ceil_div(n - index, count) : 0;
}

Pipeline::~Pipeline() { stop_worker(); }

std::int64_t Pipeline::steps_per_epoch() const {
  const std::int64_t n = size();
  const std::int64_t b = options_.batch_size;
  return options_.drop_remainder ? n / b : ceil_div(n, b);
}

void Pipeline::start_epoch(std::int64_t epoch, std::int64_t first_step) {
  stop_worker();
  const std::int64_t steps = steps_per_epoch();
  if (epoch < 0 || first_step < 0 || first_step > steps)
    throw InputError(fmt::format("cannot start epoch {} at step {}: an epoch of {} has {} steps of batch {}; the saved "
                                 "iterator state does not match this dataset and batch size",
                                 epoch, first_step, dataset_.description, steps, options_.batch_size));
  order_ = shuffle_order(dataset_.size(), options_.shuffle_buffer, options_.seed, epoch);
  if (options_.shard_count > 1) {
    std::size_t kept = 0;
    for (std::size_t i = static_cast<std::size_t>(options_.shard_index); i < order_.size();
         i += static_cast<std::size_t>(options_.shard_count))
      order_[kept++] = order_[i];
    order_.resize(kept);
  }
  epoch_steps_ = steps;
  delivered_ = first_step;
  prepared_ = first_step;
  stop_ = false;
  worker_error_ = nullptr;
  started_ = true;
  if (options_.prefetch && first_step < steps) worker_ = std::thread(&Pipeline::worker_loop, this);
}

const Batch* Pipeline::next() {
  DTRAIN_CHECK(started_, "Pipeline::next() before start_epoch()");
  if (delivered_ >= epoch_steps_) return nullptr;
  const std::int64_t step = delivered_;
  Batch& slot = slots_[step % 2];
  if (!options_.prefetch) {
    fill(slot, step);
    delivered_ = step + 1;
    return &slot;
  }
  {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return prepared_ > step || worker_error_; });
    if (worker_error_) std::rethrow_exception(worker_error_);
    delivered_ = step + 1;
  }
  changed_.notify_all();
  return &slot;
}

void Pipeline::worker_loop() {
  flush_denormals();  // it scales the batches it converts
  for (;;) {
    std::int64_t step = 0;
    {
      std::unique_lock lock(mutex_);
      // prepared_ <= delivered_: the slot of step prepared_ held a batch the caller has released.
      changed_.wait(lock, [&] { return stop_ || prepared_ <= delivered_; });
      if (stop_) return;
      step = prepared_;
    }
    if (step >= epoch_steps_) return;
    try {
      fill(slots_[step % 2], step);
    } catch (...) {
      std::lock_guard lock(mutex_);
      worker_error_ = std::current_exception();
      changed_.notify_all();
      return;
    }
    {
      std::lock_guard lock(mutex_);
      prepared_ = step + 1;
    }
    changed_.notify_all();
  }
}

void Pipeline::stop_worker() {
  if (!worker_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  worker_.join();
}

// Gathers the samples of one step in shuffled order: x rows converted to f32 times x_scale, y rows
// copied as they are. ensure() reuses the slot's storage, so steady state allocates nothing.
void Pipeline::fill(Batch& batch, std::int64_t step) const {
  const std::int64_t n = size();
  const std::int64_t begin = step * options_.batch_size;
  const std::int64_t whole = std::min(options_.batch_size, n - begin);
  // This pipeline's rows of the batch: all of them unless it keeps some replicas' parts.
  const std::int64_t first = replica_offset(whole, options_.parts, options_.part_begin, options_.part_granule);
  const std::int64_t count = replica_offset(whole, options_.parts, options_.part_end, options_.part_granule) - first;
  const std::int64_t row = dataset_.x.shape().tail().numel();

  batch.x.ensure(dataset_.x.shape().tail().with_batch(count), DType::f32);
  float* x_out = batch.x.data<float>();
  // A batch's rows lie anywhere in a dataset larger than the caches: each one waited for memory
  // (26 us for 64 Fashion-MNIST rows on the 2-core EPYC, on a core the lanes also want). Loads
  // started a few rows ahead halve that.
  constexpr std::int64_t kRowsAhead = 4;
  const auto sample = [&](std::int64_t i) { return order_[static_cast<std::size_t>(begin + first + i)]; };
  for (std::int64_t i = 0; i < std::min(kRowsAhead, count); ++i) prefetch_sample(dataset_, sample(i));
  for (std::int64_t i = 0; i < count; ++i) {
    if (i + kRowsAhead < count) prefetch_sample(dataset_, sample(i + kRowsAhead));
    sample_as_f32(dataset_, sample(i), x_out + i * row);
  }

  batch.y.ensure(dataset_.y.shape().tail().with_batch(count), dataset_.y.dtype());
  const std::size_t y_row_bytes = static_cast<std::size_t>(dataset_.y.shape().tail().numel()) * dtype_size(dataset_.y.dtype());
  const auto* y_in = static_cast<const char*>(dataset_.y.raw());
  auto* y_out = static_cast<char*>(batch.y.raw());
  for (std::int64_t i = 0; i < count; ++i)
    std::memcpy(y_out + static_cast<std::size_t>(i) * y_row_bytes, y_in + static_cast<std::size_t>(sample(i)) * y_row_bytes,
                y_row_bytes);
  batch.ids.resize(static_cast<std::size_t>(count));  // within the capacity of earlier steps: no allocation
  for (std::int64_t i = 0; i < count; ++i)
    batch.ids[static_cast<std::size_t>(i)] = (begin + first + i) * options_.shard_count + options_.shard_index;
  batch.size = count;
  batch.step = step;
}

}  // namespace dtrain::data
