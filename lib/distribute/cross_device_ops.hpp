// Cross-device ops: how the replicas of one process sum their gradient lists
// (tf.distribute.CrossDeviceOps). Every replica thread calls all_reduce with its own list of
// buffers (same count and sizes on every replica); on return each replica's buffers hold the sum
// over all replicas. A collective: every replica must call it, in the same order.
//
// Every implementation is deterministic: the order in which each element's terms are added is
// fixed by the algorithm, never by thread timing, so a seed reproduces a run. The algorithms add
// in different orders, so their results may differ from each other in the last bits.
//
// Shapes: replica r's list is B buffers of sizes n_0..n_{B-1} (identical for every r), seen as
// one logical array of T = sum n_b floats. all_reduce allocates nothing.
//
// Failure: if a replica throws, the strategy calls barrier().break_barrier(); every replica
// waiting inside a collective then throws BarrierBroken and the buffers' contents are
// unspecified.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "distribute/barrier.hpp"

namespace dtrain::distribute {

// One replica's gradients: a list of float buffers.
struct BufferList {
  std::vector<float*> data;
  std::vector<std::size_t> sizes;
  std::size_t total() const;
};

class CrossDeviceOps {
 public:
  // num_replicas >= 1, else InternalError.
  explicit CrossDeviceOps(int num_replicas);
  virtual ~CrossDeviceOps() = default;
  CrossDeviceOps(const CrossDeviceOps&) = delete;
  CrossDeviceOps& operator=(const CrossDeviceOps&) = delete;
  virtual const char* name() const = 0;
  int num_replicas() const { return num_replicas_; }

  // Before the first all_reduce: every replica's buffer list (they stay the same afterwards).
  // Replicas may bind concurrently from their own threads. That the lists agree across replicas
  // is checked by every replica at the start of each collective (InternalError on all of them).
  void bind(int replica, const BufferList& buffers);
  // Called by replica `replica`'s thread; returns when its buffers hold the sum.
  virtual void all_reduce(int replica) = 0;
  // The sum only where the variables live: on replica `destination` (CentralStorage). The
  // default is an all_reduce (after checking destination is a replica: InternalError if not).
  virtual void reduce_to(int replica, int destination);
  // The barrier replicas meet at; the strategy breaks it when a replica fails.
  Barrier& barrier() { return barrier_; }

 protected:
  const BufferList& buffers(int replica) const { return lists_[static_cast<std::size_t>(replica)]; }
  // The opening of every collective: waits until every replica has written its buffers, then
  // checks the bound lists agree (each replica does the same check, so all of them throw or none).
  void enter_collective(int replica);
  int num_replicas_;
  std::vector<BufferList> lists_;
  Barrier barrier_;
};

// Replica 0 adds every other replica's buffers into its own (in replica order), then every
// replica copies the sum back. Element sum order: ((x_0 + x_1) + x_2) + ...
class ReductionToOneDevice final : public CrossDeviceOps {
 public:
  using CrossDeviceOps::CrossDeviceOps;
  const char* name() const override { return "reduction_to_one_device"; }
  void all_reduce(int replica) override;
  // Only `destination`'s buffers receive the sum, as ((x_d + x_0) + x_1) + ... over the other
  // replicas in ascending order; every other replica's buffers are left unchanged.
  void reduce_to(int replica, int destination) override;
};

// Two groups (the first ceil(N/2) replicas, and the rest): each group's first replica sums its
// group in order, leader 0 adds the second group's sum, and the result is copied back down
// through the leaders (TensorFlow's hierarchical copy). Element sum order:
// (x_0 + ... + x_{h-1}) + (x_h + ... + x_{N-1}), each group summed left to right.
class HierarchicalCopy final : public CrossDeviceOps {
 public:
  using CrossDeviceOps::CrossDeviceOps;
  const char* name() const override { return "hierarchical_copy"; }
  void all_reduce(int replica) override;
};

// A chunked ring in shared memory: the gradient list is cut into num_replicas chunks; a
// reduce-scatter of num_replicas - 1 steps leaves each replica with one fully summed chunk, and
// an all-gather of num_replicas - 1 steps copies every chunk everywhere. Every replica thread adds
// and copies the same share of the data.
class Ring final : public CrossDeviceOps {
 public:
  using CrossDeviceOps::CrossDeviceOps;
  const char* name() const override { return "ring"; }
  void all_reduce(int replica) override;
};

// "reduction_to_one_device", "hierarchical_copy" or "ring"; anything else is an InternalError
// (the strategy resolves "auto" and refuses "nccl" on CPU before calling this).
std::unique_ptr<CrossDeviceOps> make_cross_device_ops(const std::string& name, int num_replicas);

}  // namespace dtrain::distribute
