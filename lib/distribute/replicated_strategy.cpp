#include "distribute/replicated_strategy.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::distribute {

std::string device_list(const std::vector<Device>& devices) {
  std::string s;
  for (const Device& d : devices) s += (s.empty() ? "" : ", ") + d.to_string();
  return s;
}

bool on_gpus(const std::vector<Device>& devices) {
  return !devices.empty() &&
         std::all_of(devices.begin(), devices.end(), [](const Device& d) { return d.kind == Device::Kind::gpu; });
}

ReplicatedStrategy::ReplicatedStrategy(ReplicaLayout layout, int total_threads, Communicator* workers)
    : layout_(std::move(layout)),
      threads_per_replica_(std::max(1, std::max(1, total_threads) / std::max(1, static_cast<int>(layout_.devices.size())))),
      workers_(workers ? workers : &alone_),
      group_(make_replica_group(layout_.devices, layout_.op)),
      gradients_(layout_.devices.size()),
      threads_(contexts(), threads_per_replica_, group_->barrier()) {}

std::vector<ReplicaContext> ReplicatedStrategy::contexts() const {
  std::vector<ReplicaContext> out;
  for (int r = 0; r < num_local_replicas(); ++r) out.push_back(replica_context(r));
  return out;
}

std::string ReplicatedStrategy::describe() const {
  return fmt::format("strategy {} | replicas {} ({}) | cross-device ops {}", layout_.kind, num_replicas_in_sync(),
                     device_list(layout_.devices), num_local_replicas() > 1 ? group_->name() : "none");
}

Device ReplicatedStrategy::replica_device(int replica) const {
  DTRAIN_CHECK(replica >= 0 && replica < num_local_replicas(),
               fmt::format("replica {} is outside the strategy's [0, {})", replica, num_local_replicas()));
  return layout_.devices[static_cast<std::size_t>(replica)];
}

double ReplicatedStrategy::reduce_sum(std::span<const double> per_replica) {
  double sum = 0.0;
  for (double v : per_replica) sum += v;  // replica order: deterministic
  workers_->all_reduce_sum(std::span<double>(&sum, 1), "reduce over replicas");
  return sum;
}

std::vector<std::int64_t> ReplicatedStrategy::all_gather(std::int64_t mine, const char* what) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(workers()), 0);
  all[static_cast<std::size_t>(worker_index())] = mine;
  workers_->all_reduce_sum(std::span<std::int64_t>(all), what);
  return all;
}

void ReplicatedStrategy::run(const ReplicaFn& fn) {
  try {
    threads_.run(fn);
  } catch (...) {
    // Every replica thread has stopped; a device sum another replica queued waits on its GPU for
    // the failed one's, and the contexts' teardown would wait for it: cancel it, then report.
    abandon_device_sums();
    throw;
  }
}

void ReplicatedStrategy::bind_gradients(int replica, device::Context& ctx, const Tensor& gradients,
                                        std::span<const std::size_t> sizes) {
  DTRAIN_CHECK(replica >= 0 && replica < num_local_replicas(),
               fmt::format("bind_gradients: replica {} is outside [0, {})", replica, num_local_replicas()));
  // Each replica writes only its own slot, so replicas may bind from their own threads; the
  // offsets are the same for every replica, and replica 0 writes them.
  gradients_[static_cast<std::size_t>(replica)] = StagedGradients(ctx, gradients);
  if (replica == 0) {
    offsets_.assign(1, 0);
    for (std::size_t n : sizes) offsets_.push_back(offsets_.back() + n);
  }
}

void ReplicatedStrategy::sum_gradients(const ReplicaContext& replica) {
  if (num_local_replicas() == 1) return;  // alone in this process: nothing to sum here
  StagedGradients& g = staged(replica.replica_id);
  Communicator& here = local(replica);
  if (here.sums_device_memory()) {
    // NCCL: summed where backward wrote, queued on the replica's stream before its update.
    here.all_reduce_sum_on_device(g.context(), g.arena().address<float>(), static_cast<std::size_t>(g.arena().numel()),
                                  "gradients");
    return;
  }
  g.to_host();
  here.all_reduce_sum(g.host(), "gradients");
  g.from_host();
}

bool ReplicatedStrategy::update(const ReplicaContext& replica, const std::function<void()>& apply) {
  if (!holds_variables(replica.replica_id)) return false;
  apply();
  return true;
}

void ReplicatedStrategy::all_reduce_sum_in_replica(const ReplicaContext& replica, std::span<double> values,
                                                   const char* what) {
  Communicator& here = local(replica);
  here.all_reduce_sum(values, what);
  if (workers() == 1) return;
  // Across workers this process's replica 0 speaks for it; the others then copy its sum.
  if (replica.replica_id == 0) workers_->all_reduce_sum(values, what);
  here.broadcast(values, 0, what);
}

void ReplicatedStrategy::all_reduce_sum_in_replica(const ReplicaContext& replica, std::span<std::int64_t> values,
                                                   const char* what) {
  Communicator& here = local(replica);
  here.all_reduce_sum(values, what);
  if (workers() == 1) return;
  // Replica 0 sums across workers; the others then take its sum by adding zeros to it (exact for
  // integers: the group has no integer broadcast, and needs none).
  if (replica.replica_id == 0) workers_->all_reduce_sum(values, what);
  else std::fill(values.begin(), values.end(), std::int64_t{0});
  here.all_reduce_sum(values, what);
}

}  // namespace dtrain::distribute
