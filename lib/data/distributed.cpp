#include "data/distributed.hpp"

#include <cstring>

namespace dtrain::data {

DistributedIterator::DistributedIterator(const Dataset& dataset, config::DistributeMode mode,
                                         const InputContext& context, std::int64_t global_batch,
                                         PipelineOptions options)
    : mode_(mode),
      replicas_(context.num_replicas_in_sync),
      global_batch_(global_batch),
      out_(static_cast<std::size_t>(context.num_replicas_in_sync)),
      own_x_(static_cast<std::size_t>(context.num_replicas_in_sync)),
      own_y_(static_cast<std::size_t>(context.num_replicas_in_sync)) {
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
    const std::int64_t base = b->size / replicas_, extra = b->size % replicas_;
    std::int64_t begin = 0;
    for (int r = 0; r < replicas_; ++r) {
      ReplicaBatch& rb = out_[static_cast<std::size_t>(r)];
      rb.size = base + (r < extra ? 1 : 0);
      const std::int64_t end = begin + rb.size;
      if (rb.size > 0) {
        rb.x = b->x.slice_rows(begin, end);
        rb.y = b->y.slice_rows(begin, end);
      }
      begin = end;
    }
    return &out_;
  }
  // per_replica: consecutive batches, copied because the pipeline reuses its two slots.
  bool any = false;
  for (int r = 0; r < replicas_; ++r) {
    ReplicaBatch& rb = out_[static_cast<std::size_t>(r)];
    const Batch* b = pipeline_->next();
    rb.size = b ? b->size : 0;
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
