#include "data/distributed.hpp"

#include <algorithm>
#include <cstring>

#include "core/error.hpp"

namespace dtrain::data {

DistributedIterator::DistributedIterator(const Dataset& dataset, config::DistributeMode mode,
                                         const InputContext& context, std::int64_t global_batch,
                                         PipelineOptions options)
    : mode_(mode),
      replicas_(context.num_replicas_in_sync / std::max(1, context.num_input_pipelines)),
      first_replica_(context.input_pipeline_id * replicas_),
      replicas_in_sync_(context.num_replicas_in_sync),
      global_batch_(global_batch),
      out_(static_cast<std::size_t>(replicas_)),
      own_x_(static_cast<std::size_t>(replicas_)),
      own_y_(static_cast<std::size_t>(replicas_)) {
  if (context.num_input_pipelines < 1 || context.num_replicas_in_sync % context.num_input_pipelines != 0)
    throw InternalError("every input pipeline must serve the same number of replicas");
  if (mode == config::DistributeMode::per_replica && context.num_input_pipelines > 1)
    throw ConfigError("data.distribute: per_replica with several workers is not supported yet; use split_global_batch");
  if (mode_ == config::DistributeMode::split_global_batch) {
    options.batch_size = global_batch_;
    pipeline_ = std::make_unique<Pipeline>(dataset, options);
    steps_ = pipeline_->steps_per_epoch();
  } else {
    options.batch_size = context.get_per_replica_batch_size(global_batch_);
    pipeline_ = std::make_unique<Pipeline>(dataset, options);
    steps_ = (pipeline_->steps_per_epoch() + replicas_ - 1) / replicas_;
  }
}

void DistributedIterator::start_epoch(std::int64_t epoch, std::int64_t first_step) {
  const std::int64_t pipeline_step =
      mode_ == config::DistributeMode::split_global_batch ? first_step
                                                          : std::min(first_step * replicas_, pipeline_->steps_per_epoch());
  pipeline_->start_epoch(epoch, pipeline_step);
}

const std::vector<ReplicaBatch>* DistributedIterator::next() {
  if (mode_ == config::DistributeMode::split_global_batch) {
    const Batch* b = pipeline_->next();
    if (!b) return nullptr;
    global_samples_ = b->size;
    const std::int64_t base = b->size / replicas_in_sync_, extra = b->size % replicas_in_sync_;
    auto rows_before = [&](std::int64_t g) { return g * base + std::min(g, extra); };
    for (int r = 0; r < replicas_; ++r) {
      const std::int64_t g = first_replica_ + r;
      ReplicaBatch& rb = out_[static_cast<std::size_t>(r)];
      const std::int64_t begin = rows_before(g), end = rows_before(g + 1);
      rb.size = end - begin;
      if (rb.size > 0) {
        rb.x = b->x.slice_rows(begin, end);
        rb.y = b->y.slice_rows(begin, end);
      }
    }
    return &out_;
  }
  // per_replica: consecutive batches, copied because the pipeline reuses its two slots.
  bool any = false;
  global_samples_ = 0;
  for (int r = 0; r < replicas_; ++r) {
    ReplicaBatch& rb = out_[static_cast<std::size_t>(r)];
    const Batch* b = pipeline_->next();
    rb.size = b ? b->size : 0;
    global_samples_ += rb.size;
    if (!b) continue;
    any = true;
    Tensor& x = own_x_[static_cast<std::size_t>(r)];
    Tensor& y = own_y_[static_cast<std::size_t>(r)];
    x.ensure(b->x.shape(), b->x.dtype());
    y.ensure(b->y.shape(), b->y.dtype());
    std::memcpy(x.raw(), b->x.raw(), b->x.bytes());
    std::memcpy(y.raw(), b->y.raw(), b->y.bytes());
    rb.x = x;
    rb.y = y;
  }
  return any ? &out_ : nullptr;
}

}  // namespace dtrain::data
