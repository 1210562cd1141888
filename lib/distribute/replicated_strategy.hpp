// What every strategy of this release is made of: local replicas on devices, each with its own
// copy of the variables, run on ReplicaThreads, combining their values through a ReplicaGroup,
// and the worker processes (a group of one unless the strategy spans processes). As it stands it
// is the mirrored strategy (the one-replica kinds are its one-replica layouts); the others
// override where the variables live and how gradients are summed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distribute/replica_threads.hpp"
#include "distribute/single_communicator.hpp"
#include "distribute/strategy.hpp"
#include "distribute/replica_group.hpp"
#include "distribute/staged_gradients.hpp"

namespace dtrain::distribute {

// A strategy's replicas in this process.
struct ReplicaLayout {
  ReplicaLayout(const char* kind, std::vector<Device> devices, CrossDeviceOp op = CrossDeviceOp::ring)
      : kind(kind), devices(std::move(devices)), op(op) {}
  const char* kind;             // the strategy's name, for describe()
  std::vector<Device> devices;  // one per local replica
  CrossDeviceOp op;             // how the local replicas sum floats (with more than one)
  std::string choice_note;      // why `auto` chose `op`
};

class ReplicatedStrategy : public Strategy {
 public:
  // workers: the worker processes; null = this process alone.
  ReplicatedStrategy(ReplicaLayout layout, int total_threads, Communicator* workers = nullptr);

  std::string describe() const override;
  const std::string& choice_note() const override { return layout_.choice_note; }
  int num_local_replicas() const override { return static_cast<int>(layout_.devices.size()); }
  int workers() const override { return workers_->size(); }
  int worker_index() const override { return workers_->rank(); }
  Device replica_device(int replica) const override;
  int threads_per_replica() const override { return threads_per_replica_; }

  bool holds_variables(int) const override { return true; }
  int primary_replica() const override { return 0; }
  void place_variables(std::span<const std::vector<Variable*>>) override {}

  void run(const ReplicaFn& fn) override;
  // The local group's device sums (ReplicaGroup::abandon_device_sums); a strategy with device sums
  // of its own across workers cancels those too.
  void abandon_device_sums() override { group_->abandon_device_sums(); }
  double reduce_sum(std::span<const double> per_replica) override;
  void all_reduce_sum(std::span<std::int64_t> values, const char* what) override { workers_->all_reduce_sum(values, what); }
  void all_reduce_sum(std::span<double> values, const char* what) override { workers_->all_reduce_sum(values, what); }
  int all_reduce_max(int value, const char* what) override { return workers_->all_reduce_max(value, what); }
  std::vector<std::int64_t> all_gather(std::int64_t mine, const char* what) override;
  void set_step(std::int64_t global_step) override { workers_->set_step(global_step); }

  void set_collectives_in_backward(bool yes) override { collectives_in_backward_ = yes; }
  void bind_gradients(int replica, device::Context& ctx, const Tensor& gradients,
                      std::span<const std::size_t> sizes) override;
  void gradients_ready(const ReplicaContext&, std::size_t, std::size_t) override {}
  bool overlaps_backward() const override { return false; }
  // Every replica's gradients become the sum (the thread group's cross-device op).
  void sum_gradients(const ReplicaContext& replica) override;
  bool update(const ReplicaContext& replica, const std::function<void()>& apply) override;
  void all_reduce_sum_in_replica(const ReplicaContext& replica, std::span<double> values, const char* what) override;
  void all_reduce_sum_in_replica(const ReplicaContext& replica, std::span<std::int64_t> values,
                                 const char* what) override;

  double take_cross_worker_seconds() override { return 0.0; }
  double take_cross_worker_wait_seconds() override { return 0.0; }

 protected:
  Communicator& local(const ReplicaContext& replica) { return group_->endpoint(replica.replica_id); }
  // A replica's gradients where the host-memory collectives sum them (staged_gradients.hpp).
  StagedGradients& staged(int replica) { return gradients_[static_cast<std::size_t>(replica)]; }
  std::span<float> gradients(int replica) { return staged(replica).host(); }
  // The float offset in the arena of each variable, and one past the last.
  std::span<const std::size_t> variable_offsets() const { return offsets_; }
  Communicator& worker_group() { return *workers_; }
  const ReplicaLayout& layout() const { return layout_; }
  bool collectives_in_backward() const { return collectives_in_backward_; }

 private:
  std::vector<ReplicaContext> contexts() const;

  ReplicaLayout layout_;
  int threads_per_replica_;
  SingleCommunicator alone_;  // the workers of a strategy that runs in this process alone
  Communicator* workers_;
  std::unique_ptr<ReplicaGroup> group_;
  std::vector<StagedGradients> gradients_;  // per local replica, bound once
  std::vector<std::size_t> offsets_;        // of each variable in an arena (the same for every replica)
  bool collectives_in_backward_ = false;
  ReplicaThreads threads_;  // last: its threads use the members above
};

// "cpu:0, cpu:1"
std::string device_list(const std::vector<Device>& devices);
// Every device a GPU (and at least one).
bool on_gpus(const std::vector<Device>& devices);

}  // namespace dtrain::distribute
