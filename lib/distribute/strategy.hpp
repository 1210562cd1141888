// Strategy: how replicas are laid out and how their values are combined — nothing else
// (tf.distribute.Strategy). The training loop calls run(), reduce(), sum_gradients() and
// update() and never asks which kind of strategy it has.
//
//   default           one replica on the calling thread; any loss reduction
//   one_device        one replica on `device`
//   mirrored          one replica per device, each on its own thread, each with its own copy of
//                     the variables; gradients are all-reduced and every copy applies the update
//   central_storage   one replica per device (own thread), ONE copy of the variables on the
//                     parameter device; gradients are summed there and the update applied once
//   multi_worker_mirrored  mirrored over every worker process (MPI rank) and its local devices:
//                     gradients are summed locally, then across workers (ring or MPI_Allreduce,
//                     packed into buckets of communication.bytes_per_pack; with one replica per
//                     worker each pack's sum overlaps the rest of backward, PackedAllReduce)
//
// Replica threads are created once and live as long as the strategy; the cores are divided among
// them (threads_per_replica) so there are never more compute threads than cores.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "config/experiment.hpp"
#include "core/tensor.hpp"
#include "distribute/cluster.hpp"
#include "distribute/cross_device_ops.hpp"
#include "distribute/packed_all_reduce.hpp"

namespace dtrain::distribute {

enum class ReduceOp { sum, mean };

struct ReplicaContext {
  int replica_id = 0;            // among this process's replicas
  int num_replicas_in_sync = 1;  // over all workers
};

class Strategy {
 public:
  // total_threads: the compute threads this process may use. cluster: the worker processes
  // (needed by multi_worker_mirrored; the others run in this process alone).
  Strategy(const config::StrategyConfig& config, int total_threads, Cluster* cluster = nullptr);
  ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  config::StrategyKind kind() const { return kind_; }
  int num_replicas_in_sync() const { return static_cast<int>(devices_.size()) * workers(); }
  // This process's replicas and their devices.
  int num_local_replicas() const { return static_cast<int>(devices_.size()); }
  const std::vector<Device>& devices() const { return devices_; }
  int workers() const { return cluster_ ? cluster_->size() : 1; }
  int worker_index() const { return cluster_ ? cluster_->rank() : 0; }
  // Only the chief prints and writes files.
  bool is_chief() const { return worker_index() == 0; }
  Cluster* cluster() const { return cluster_; }
  int threads_per_replica() const { return threads_per_replica_; }
  // Mirrored strategies keep one variable copy per replica; central storage keeps one in all.
  bool mirrors_variables() const { return kind_ != config::StrategyKind::central_storage; }
  // The cross-device op summing gradients ("none" with one replica).
  std::string cross_device_ops_name() const;
  // Why `auto` chose what it chose; empty when the experiment named the op.
  const std::string& choice_note() const { return choice_note_; }
  // "strategy mirrored | replicas 2 (cpu:0, cpu:1) | cross-device ops ring"
  std::string describe() const;

  // Runs fn on every replica and returns when all have finished. With one replica fn runs on the
  // calling thread. If a replica throws, the others are released from any collective they wait
  // in (they stop with BarrierBroken) and the first exception is rethrown here.
  void run(const std::function<void(const ReplicaContext&)>& fn);

  // One value per replica, combined (tf.distribute.Strategy.reduce).
  double reduce(ReduceOp op, std::span<const double> per_replica) const;

  // Each replica registers its gradient buffers once, before its first sum_gradients().
  void bind_gradients(int replica, const BufferList& buffers);
  // Inside run(), during backward: variables [first, first + count) of the replica's list hold
  // their final gradients for this step. Across workers, their sum may start now.
  void gradients_ready(const ReplicaContext& replica, std::size_t first, std::size_t count);
  // Whether the sums across workers overlap backward (communication.overlap, one local replica,
  // gradients in more than one pack). Known once replica 0 has bound its gradients.
  bool overlaps_backward() const { return across_workers_ && across_workers_->overlaps(); }
  // Inside run(): sums the replicas' gradients — into every replica (mirrored), or into the
  // replica that holds the central variables (central storage).
  void sum_gradients(const ReplicaContext& replica);
  // Inside run(): applies `apply` once per variable copy: on every replica when variables are
  // mirrored, on replica 0 (the parameter device's) otherwise. Returns whether it ran here.
  bool update(const ReplicaContext& replica, const std::function<void()>& apply);
  // Seconds since the last call inside the collectives summing gradients across workers, and
  // blocked waiting for them (less than the first when they overlap backward); multi-worker only.
  double take_cross_worker_seconds();
  double take_cross_worker_wait_seconds();

 private:
  void worker(int replica);

  config::StrategyKind kind_;
  Cluster* cluster_ = nullptr;  // set for multi_worker_mirrored only
  bool ring_between_workers_ = false;
  bool overlap_ = false;  // allowed here; overlaps_backward() says whether the packs make it happen
  std::int64_t bytes_per_pack_ = 0;
  std::vector<BufferList> local_gradients_;
  std::unique_ptr<PackedAllReduce> across_workers_;  // made with replica 0's gradients
  std::vector<Device> devices_;
  int threads_per_replica_ = 1;
  std::unique_ptr<CrossDeviceOps> ops_;
  std::string choice_note_;

  // Replica threads: run() publishes `task_` under a new generation, each worker runs it once.
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(const ReplicaContext&)>* task_ = nullptr;
  std::uint64_t generation_ = 0;
  int remaining_ = 0;
  bool shutting_down_ = false;
  std::exception_ptr first_error_;
};

// Parses "cpu:3" / "gpu:0" (already normalised by the config parser).
Device parse_device(const std::string& name);

}  // namespace dtrain::distribute
