#include "distribute/strategy.hpp"

#include <omp.h>

#include <algorithm>
#include <charconv>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/error.hpp"

namespace dtrain::distribute {

namespace {

std::string where(const config::SourceLocation& loc) {
  if (loc.line > 0) return fmt::format("{}:{}:{}: ", loc.file, loc.line, loc.column);
  return loc.file.empty() ? std::string() : loc.file + ": ";
}

std::string device_list(const std::vector<Device>& devices) {
  std::string s;
  for (const Device& d : devices) s += (s.empty() ? "" : ", ") + d.to_string();
  return s;
}

}  // namespace

Device parse_device(const std::string& name) {
  Device d;
  const auto colon = name.find(':');
  const std::string kind = name.substr(0, colon);
  int index = -1;
  if (colon != std::string::npos) {
    const char* first = name.data() + colon + 1;
    const char* last = name.data() + name.size();
    auto [end, ec] = std::from_chars(first, last, index);
    if (ec != std::errc() || end != last) index = -1;
  }
  if ((kind != "cpu" && kind != "gpu") || index < 0)
    throw ConfigError(fmt::format("'{}' is not a device name; write cpu:N or gpu:N", name));
  d.kind = kind == "cpu" ? Device::Kind::cpu : Device::Kind::gpu;
  d.index = index;
  return d;
}

Strategy::Strategy(const config::StrategyConfig& config, int total_threads, Cluster* cluster) : kind_(config.kind) {
  using config::StrategyKind;
  total_threads = std::max(1, total_threads);
  switch (kind_) {
    case StrategyKind::default_strategy: devices_ = {Device{}}; break;
    case StrategyKind::one_device: devices_ = {parse_device(config.device)}; break;
    case StrategyKind::multi_worker_mirrored:
      if (!cluster) throw InternalError("multi_worker_mirrored needs the cluster of worker processes");
      cluster_ = cluster;
      cluster_->set_timeout(config.communication.timeout_seconds);
      bytes_per_pack_ = config.communication.bytes_per_pack;
      if (config.devices_auto) {
        devices_ = {Device{}};  // one CPU replica per worker process
        break;
      }
      for (const auto& name : config.devices) devices_.push_back(parse_device(name));
      break;
    case StrategyKind::mirrored:
    case StrategyKind::central_storage:
      if (config.devices_auto) {
        // One logical CPU device per core: each replica then gets one compute thread.
        for (int i = 0; i < total_threads; ++i) devices_.push_back(Device{Device::Kind::cpu, i});
      } else {
        for (const auto& name : config.devices) devices_.push_back(parse_device(name));
      }
      break;
  }
  for (const Device& d : devices_)
    if (d.kind == Device::Kind::gpu)
      throw ConfigError(fmt::format("{}device {}: this build of dtrain has no CUDA backend; use cpu:N devices",
                                    where(config.devices_where.line ? config.devices_where : config.where), d.to_string()));
  const int n = num_local_replicas();
  threads_per_replica_ = std::max(1, total_threads / n);

  if (kind_ == StrategyKind::multi_worker_mirrored) {
    using config::CommunicationImplementation;
    const auto impl = config.communication.implementation;
    if (impl == CommunicationImplementation::nccl)
      throw ConfigError(fmt::format(
          "{}communication.implementation nccl needs GPU devices, and these workers' replicas are on {}; use ring or mpi "
          "(auto picks one)",
          where(config.communication.implementation_where.line ? config.communication.implementation_where : config.where),
          device_list(devices_)));
    ring_between_workers_ = impl == CommunicationImplementation::ring;
    if (impl == CommunicationImplementation::auto_select && workers() > 1)
      choice_note_ = fmt::format(
          "communication: auto chose mpi: {} CPU workers, and the MPI library's own MPI_Allreduce picks its algorithm "
          "for the message size and process count",
          workers());
    if (n > 1) ops_ = make_cross_device_ops("ring", n);
    // Several local replicas first sum among themselves, after all of them finished backward.
    overlap_ = config.communication.overlap && n == 1 && workers() > 1;
  } else if (kind_ == StrategyKind::mirrored) {
    std::string op;
    switch (config.cross_device_ops) {
      case config::CrossDeviceOpsKind::nccl:
        throw ConfigError(fmt::format(
            "{}cross_device_ops nccl needs GPU devices (gpu:N), and these replicas are on {}; use ring, "
            "hierarchical_copy or reduction_to_one_device (auto picks one)",
            where(config.cross_device_ops_where.line ? config.cross_device_ops_where : config.where), device_list(devices_)));
      case config::CrossDeviceOpsKind::auto_select:
        op = "ring";
        if (n > 1)
          choice_note_ = fmt::format(
              "cross_device_ops: auto chose ring: {} CPU replicas share one memory, and the chunked ring spreads the "
              "summation evenly over every replica thread (reduction_to_one_device would leave it all to one)",
              n);
        break;
      default: op = config::name_of(config.cross_device_ops); break;
    }
    if (n > 1) ops_ = make_cross_device_ops(op, n);
  } else if (kind_ == StrategyKind::central_storage && n > 1) {
    // The variables live on the parameter device: the gradients are summed there only.
    ops_ = make_cross_device_ops("reduction_to_one_device", n);
  }

  if (n > 1) {
    workers_.reserve(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) workers_.emplace_back(&Strategy::worker, this, r);
  }
}

Strategy::~Strategy() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    shutting_down_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

std::string Strategy::cross_device_ops_name() const { return ops_ ? ops_->name() : "none"; }

std::string Strategy::describe() const {
  if (kind_ == config::StrategyKind::multi_worker_mirrored)
    return fmt::format("strategy {} | workers {} | replicas {} ({} per worker: {}) | communication {}{}{}",
                       config::name_of(kind_), workers(), num_replicas_in_sync(), num_local_replicas(),
                       device_list(devices_), workers() == 1 ? "none" : ring_between_workers_ ? "ring" : "mpi",
                       bytes_per_pack_ > 0 ? fmt::format(", packs of {} bytes", bytes_per_pack_) : "",
                       overlaps_backward() ? ", overlapping backward" : "");
  return fmt::format("strategy {} | replicas {} ({}) | cross-device ops {}", config::name_of(kind_),
                     num_replicas_in_sync(), device_list(devices_), cross_device_ops_name());
}

void Strategy::worker(int replica) {
  // OpenMP's thread count is per thread: this replica's oneDNN primitives use its share of cores.
  omp_set_num_threads(threads_per_replica_);
  std::uint64_t seen = 0;
  for (;;) {
    const std::function<void(const ReplicaContext&)>* task = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return shutting_down_ || generation_ != seen; });
      if (shutting_down_) return;
      seen = generation_;
      task = task_;
    }
    try {
      (*task)(ReplicaContext{replica, num_replicas_in_sync()});
    } catch (const BarrierBroken&) {
      // Another replica failed and broke the collectives; its error is the one reported.
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!first_error_) first_error_ = std::current_exception();
      if (ops_) ops_->barrier().break_barrier();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (--remaining_ == 0) done_cv_.notify_all();
  }
}

void Strategy::run(const std::function<void(const ReplicaContext&)>& fn) {
  if (workers_.empty()) {
    // One local replica: it is still one of the replicas in sync across every worker.
    fn(ReplicaContext{0, num_replicas_in_sync()});
    return;
  }
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    task_ = &fn;
    remaining_ = num_local_replicas();  // this process's threads only: other workers have their own
    first_error_ = nullptr;
    ++generation_;
    start_cv_.notify_all();
    done_cv_.wait(lock, [&] { return remaining_ == 0; });
    task_ = nullptr;
    error = first_error_;
  }
  if (error) {
    if (ops_) ops_->barrier().reset();
    std::rethrow_exception(error);
  }
}

double Strategy::reduce(ReduceOp op, std::span<const double> per_replica) const {
  double sum = 0.0;
  for (double v : per_replica) sum += v;  // replica order: deterministic
  if (cluster_) cluster_->all_reduce_sum(std::span<double>(&sum, 1), "reduce over replicas");
  return op == ReduceOp::sum ? sum : sum / static_cast<double>(num_replicas_in_sync());
}

void Strategy::bind_gradients(int replica, const BufferList& buffers) {
  if (ops_) ops_->bind(replica, buffers);
  if (local_gradients_.size() <= static_cast<std::size_t>(replica)) local_gradients_.resize(static_cast<std::size_t>(replica) + 1);
  local_gradients_[static_cast<std::size_t>(replica)] = buffers;
  // Across workers, this process's replica 0 speaks for it.
  if (replica == 0 && cluster_ && cluster_->size() > 1)
    across_workers_ = std::make_unique<PackedAllReduce>(*cluster_, buffers, bytes_per_pack_, ring_between_workers_, overlap_);
}

void Strategy::gradients_ready(const ReplicaContext& replica, std::size_t first, std::size_t count) {
  if (replica.replica_id == 0 && overlaps_backward()) across_workers_->ready(first, count);
}

void Strategy::sum_gradients(const ReplicaContext& replica) {
  if (ops_) {
    if (mirrors_variables()) {
      ops_->all_reduce(replica.replica_id);
    } else {
      ops_->reduce_to(replica.replica_id, 0);
    }
  }
  if (!across_workers_) return;
  // Replica 0 sums across workers (or waits for the packs already under way); the other local
  // replicas then copy its sum.
  if (replica.replica_id == 0) across_workers_->finish();
  if (ops_) {
    ops_->barrier().arrive_and_wait();
    if (replica.replica_id != 0) {
      const BufferList& mine = local_gradients_[static_cast<std::size_t>(replica.replica_id)];
      const BufferList& first = local_gradients_[0];
      for (std::size_t i = 0; i < mine.data.size(); ++i) std::copy_n(first.data[i], mine.sizes[i], mine.data[i]);
    }
    ops_->barrier().arrive_and_wait();
  }
}

double Strategy::take_cross_worker_seconds() { return across_workers_ ? across_workers_->take_collective_seconds() : 0.0; }

double Strategy::take_cross_worker_wait_seconds() { return across_workers_ ? across_workers_->take_wait_seconds() : 0.0; }

bool Strategy::update(const ReplicaContext& replica, const std::function<void()>& apply) {
  if (!mirrors_variables() && replica.replica_id != 0) return false;
  apply();
  return true;
}

}  // namespace dtrain::distribute
