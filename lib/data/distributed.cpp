#include "data/distributed.hpp"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/checked.hpp"
#include "core/error.hpp"

namespace dtrain::data {
namespace {

// The samples of the batch that starts at `begin` in a share of `samples`: a full `batch`, a short
// last one, or none (past the end, or short under drop_remainder).
std::int64_t batch_samples(std::int64_t samples, std::int64_t begin, std::int64_t batch, bool drop_remainder) {
  if (begin >= samples) return 0;
  const std::int64_t count = std::min(batch, samples - begin);
  return drop_remainder && count < batch ? 0 : count;
}

std::int64_t batches_in(std::int64_t samples, std::int64_t batch, bool drop_remainder) {
  return drop_remainder ? samples / batch : ceil_div(samples, batch);
}

}  // namespace

DistributedIterator::DistributedIterator(const Dataset& dataset, config::DistributeMode mode,
                                         const InputContext& context, std::int64_t global_batch,
                                         PipelineOptions options, const ShareSizes& share_sizes)
    : mode_(mode),
      replicas_(context.num_replicas_in_sync / std::max(1, context.num_input_pipelines)),
      global_batch_(global_batch),
      out_(static_cast<std::size_t>(replicas_)),
      own_x_(static_cast<std::size_t>(replicas_)),
      own_y_(static_cast<std::size_t>(replicas_)),
      own_ids_(static_cast<std::size_t>(replicas_)) {
  const int pipelines = context.num_input_pipelines;
  const int id = context.input_pipeline_id;
  if (pipelines < 1 || id < 0 || id >= pipelines || context.num_replicas_in_sync % pipelines != 0)
    throw InternalError("every input pipeline must serve the same number of replicas");
  if (global_batch_ < 1)
    throw ConfigError(fmt::format("the global batch size is {}; it must be at least 1", global_batch_));
  if (global_batch_ < pipelines)
    throw ConfigError(fmt::format("a global batch of {} leaves some of the {} workers without samples; use a global "
                                  "batch of at least {}",
                                  global_batch_, pipelines, pipelines));
  if (mode_ == config::DistributeMode::split_global_batch && options.shard_count > 1 && pipelines > 1) {
    // Data sharding: every worker holds the same shuffled order, so each takes its replicas' rows
    // of the global batch one process would take, whatever the batch and worker count. (A lone
    // pipeline over one shard, a parameter-server worker's, batches its own share below.)
    if (options.shard_count != pipelines || options.shard_index != id)
      throw InternalError(fmt::format("input pipeline {} of {} was given shard {} of {}", id, pipelines,
                                      options.shard_index, options.shard_count));
    options.shard_count = 1;
    options.shard_index = 0;
    options.batch_size = global_batch_;
    options.parts = context.num_replicas_in_sync;
    options.part_begin = id * replicas_;
    options.part_end = (id + 1) * replicas_;
    whole_order_ = true;
  } else if (mode_ == config::DistributeMode::split_global_batch) {
    options.batch_size = global_batch_ / pipelines + (id < global_batch_ % pipelines ? 1 : 0);
  } else {
    options.batch_size = context.get_per_replica_batch_size(global_batch_);
  }
  pipeline_ = std::make_unique<Pipeline>(dataset, options);
  if (share_sizes) {
    pipeline_samples_ = share_sizes(pipeline_->size());
  } else if (pipelines == 1) {
    pipeline_samples_.assign(1, pipeline_->size());
  }
  if (static_cast<int>(pipeline_samples_.size()) != pipelines ||
      pipeline_samples_[static_cast<std::size_t>(id)] != pipeline_->size())
    throw InternalError(fmt::format("input pipeline {} of {} holds {} samples, which its peers were not told",
                                    id, pipelines, pipeline_->size()));
  if (whole_order_) {
    // Accounted as one pipeline over the whole order; every worker must hold the same one.
    for (const std::int64_t samples : pipeline_samples_)
      if (samples != pipeline_->size())
        throw InputError(fmt::format("the workers hold different datasets ({} and {} samples) although each should "
                                     "load all of it under data sharding",
                                     pipeline_->size(), samples));
    pipeline_samples_.resize(1);
  }
  for (std::size_t p = 0; p < pipeline_samples_.size(); ++p)
    steps_ = std::max(steps_, steps_of(pipeline_samples_[p], pipeline_batch_of(static_cast<int>(p))));
}

std::int64_t DistributedIterator::pipeline_batch_of(int pipeline) const {
  const auto pipelines = static_cast<std::int64_t>(pipeline_samples_.size());
  if (mode_ == config::DistributeMode::per_replica || whole_order_) return pipeline_->options().batch_size;
  return global_batch_ / pipelines + (pipeline < global_batch_ % pipelines ? 1 : 0);
}

std::int64_t DistributedIterator::steps_of(std::int64_t samples, std::int64_t batch) const {
  const bool drop = pipeline_->options().drop_remainder;
  if (mode_ == config::DistributeMode::split_global_batch) return batches_in(samples, batch, drop);
  return ceil_div(batches_in(samples, batch, drop), replicas_);
}

std::int64_t DistributedIterator::samples_at(std::int64_t samples, std::int64_t batch, std::int64_t step) const {
  const bool drop = pipeline_->options().drop_remainder;
  if (mode_ == config::DistributeMode::split_global_batch) return batch_samples(samples, step * batch, batch, drop);
  std::int64_t total = 0;
  for (std::int64_t j = step * replicas_; j < (step + 1) * replicas_; ++j) total += batch_samples(samples, j * batch, batch, drop);
  return total;
}

void DistributedIterator::start_epoch(std::int64_t epoch, std::int64_t first_step) {
  if (first_step < 0 || first_step > steps_)
    throw InputError(fmt::format("cannot start epoch {} at step {}: an epoch has {} steps of global batch {}; the "
                                 "saved iterator state does not match this dataset and batch size",
                                 epoch, first_step, steps_, global_batch_));
  const std::int64_t batches_before = mode_ == config::DistributeMode::split_global_batch ? first_step : first_step * replicas_;
  pipeline_->start_epoch(epoch, std::min(batches_before, pipeline_->steps_per_epoch()));
  step_ = first_step;
}

const std::vector<ReplicaBatch>* DistributedIterator::next() {
  if (step_ >= steps_) return nullptr;
  global_samples_ = 0;
  for (std::size_t p = 0; p < pipeline_samples_.size(); ++p)
    global_samples_ += samples_at(pipeline_samples_[p], pipeline_batch_of(static_cast<int>(p)), step_);
  ++step_;

  if (mode_ == config::DistributeMode::split_global_batch) {
    const Batch* b = pipeline_->next();
    const std::int64_t size = b ? b->size : 0;
    // Under data sharding this worker's batch is its replicas' rows of the whole step's batch, so
    // each local replica takes the rows the whole batch's split gives it there (granule or not).
    const PipelineOptions& o = pipeline_->options();
    const int in_sync = whole_order_ ? o.parts : replicas_, first = whole_order_ ? o.part_begin : 0;
    const std::int64_t whole = whole_order_ ? global_samples_ : size;
    auto rows_before = [&](int r) {
      return replica_offset(whole, in_sync, first + r, o.part_granule) - replica_offset(whole, in_sync, first, o.part_granule);
    };
    for (int r = 0; r < replicas_; ++r) {
      ReplicaBatch& rb = out_[static_cast<std::size_t>(r)];
      const std::int64_t begin = rows_before(r), end = rows_before(r + 1);
      DTRAIN_CHECK(end <= size, fmt::format("replica {}'s rows [{}, {}) lie past its worker's {} rows of the step",
                                            r, begin, end, size));
      rb.size = end - begin;
      if (rb.size > 0) {
        rb.x = b->x.slice_rows(begin, end);
        rb.y = b->y.slice_rows(begin, end);
        rb.ids = std::span<const std::int64_t>(b->ids).subspan(static_cast<std::size_t>(begin),
                                                               static_cast<std::size_t>(rb.size));
      } else {
        rb.ids = {};
      }
    }
    return &out_;
  }
  // per_replica: consecutive batches, copied because the pipeline reuses its two slots.
  for (int r = 0; r < replicas_; ++r) {
    ReplicaBatch& rb = out_[static_cast<std::size_t>(r)];
    const Batch* b = pipeline_->next();
    rb.size = b ? b->size : 0;
    rb.ids = {};
    if (!b) continue;
    Tensor& x = own_x_[static_cast<std::size_t>(r)];
    Tensor& y = own_y_[static_cast<std::size_t>(r)];
    x.ensure(b->x.shape(), b->x.dtype());
    y.ensure(b->y.shape(), b->y.dtype());
    std::memcpy(x.raw(), b->x.raw(), b->x.bytes());
    std::memcpy(y.raw(), b->y.raw(), b->y.bytes());
    auto& ids = own_ids_[static_cast<std::size_t>(r)];
    ids.assign(b->ids.begin(), b->ids.end());
    rb.x = x;
    rb.y = y;
    rb.ids = ids;
  }
  return &out_;
}

}  // namespace dtrain::data
