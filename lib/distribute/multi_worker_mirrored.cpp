#include "distribute/multi_worker_mirrored.hpp"

#include <algorithm>
#include <cstdlib>

#include <fmt/format.h>

#include "core/error.hpp"
#include "config/parse.hpp"
#include "device/context.hpp"
#include "distribute/nccl_communicator.hpp"
#include "distribute/packed_all_reduce.hpp"
#include "distribute/replicated_strategy.hpp"

namespace dtrain::distribute {

namespace {

class MultiWorkerMirroredStrategy final : public ReplicatedStrategy {
 public:
  // nccl: the workers' NCCL communicator (one GPU each), which then sums the gradients.
  MultiWorkerMirroredStrategy(ReplicaLayout layout, int total_threads, Communicator& workers,
                              const config::CommunicationConfig& communication, bool ring,
                              std::unique_ptr<Communicator> nccl = nullptr)
      : ReplicatedStrategy(std::move(layout), total_threads, &workers),
        ring_(ring),
        nccl_(std::move(nccl)),
        bytes_per_pack_(communication.bytes_per_pack),
        // Several local replicas first sum among themselves, after all of them finished backward.
        overlap_requested_(communication.overlap && num_local_replicas() == 1 && this->workers() > 1) {}

  std::string describe() const override {
    return fmt::format("strategy {} | workers {} | replicas {} ({} per worker: {}) | communication {}{}{}{}", layout().kind,
                       workers(), num_replicas_in_sync(), num_local_replicas(), device_list(layout().devices),
                       nccl_ ? "nccl" : workers() == 1 ? "none" : ring_ ? "ring" : "mpi",
                       bytes_per_pack_ > 0 && !nccl_ ? fmt::format(", packs of {} bytes", bytes_per_pack_) : "",  // NCCL: one sum
                       overlaps_backward() ? ", overlapping backward" : "",
                       overlap_requested_ && collectives_in_backward()
                           ? ", not overlapping backward (the model makes collectives during backward)"
                           : "");
  }

  void abandon_device_sums() override {
    ReplicatedStrategy::abandon_device_sums();
    if (nccl_) nccl_->abandon_device_sums();
  }

  void set_collectives_in_backward(bool yes) override {
    DTRAIN_CHECK(!reducer_, "set_collectives_in_backward() after the gradients were bound");
    ReplicatedStrategy::set_collectives_in_backward(yes);
  }

  void bind_gradients(int replica, device::Context& ctx, const Tensor& gradients,
                      std::span<const std::size_t> sizes) override {
    ReplicatedStrategy::bind_gradients(replica, ctx, gradients, sizes);
    // Across workers, this process's replica 0 speaks for it, from its host-side gradients.
    if (replica == 0 && workers() > 1 && !nccl_)
      reducer_ = std::make_unique<PackedAllReduce>(worker_group(), this->gradients(0), sizes, bytes_per_pack_, ring_,
                                                   overlap_requested_ && !collectives_in_backward());
  }

  void gradients_ready(const ReplicaContext& replica, std::size_t first, std::size_t count) override {
    if (replica.replica_id != 0 || !overlaps_backward()) return;
    // The variables' floats reach the host before their sum starts.
    const auto offsets = variable_offsets();
    staged(0).to_host(offsets[first], offsets[first + count] - offsets[first]);
    reducer_->ready(first, count);
  }

  bool overlaps_backward() const override { return reducer_ && reducer_->overlaps(); }

  void all_reduce_sum_in_replica(const ReplicaContext& replica, std::span<double> values, const char* what) override {
    check_no_sum_in_flight(what);
    ReplicatedStrategy::all_reduce_sum_in_replica(replica, values, what);
  }
  void all_reduce_sum_in_replica(const ReplicaContext& replica, std::span<std::int64_t> values,
                                 const char* what) override {
    check_no_sum_in_flight(what);
    ReplicatedStrategy::all_reduce_sum_in_replica(replica, values, what);
  }

  void sum_gradients(const ReplicaContext& replica) override {
    if (nccl_) {
      // One GPU per worker: NCCL sums the arena where backward wrote it, on the replica's stream;
      // a job of one worker too, so that it runs the path a larger job runs.
      StagedGradients& g = staged(replica.replica_id);
      nccl_->all_reduce_sum_on_device(g.context(), g.arena().address<float>(),
                                      static_cast<std::size_t>(g.arena().numel()), "gradients");
      return;
    }
    const bool several = num_local_replicas() > 1;
    if (!several && !reducer_) return;
    StagedGradients& g = staged(replica.replica_id);
    // Overlapping, replica 0's gradients reached the host as backward handed them over.
    if (!overlaps_backward()) g.to_host();
    if (several) local(replica).all_reduce_sum(g.host(), "gradients");
    if (reducer_) {
      // Replica 0 sums across workers (or waits for the packs already under way); the other
      // local replicas then copy its sum.
      if (replica.replica_id == 0) reducer_->finish();
      if (several) local(replica).broadcast(g.host(), 0, "gradients");
    }
    g.from_host();
  }

  double take_cross_worker_seconds() override { return reducer_ ? reducer_->take_collective_seconds() : 0.0; }
  double take_cross_worker_wait_seconds() override { return reducer_ ? reducer_->take_wait_seconds() : 0.0; }

 private:
  // The communication thread may be inside MPI now, and MPI is serialized.
  void check_no_sum_in_flight(const char* what) const {
    DTRAIN_CHECK(!reducer_ || !reducer_->in_flight(),
                 fmt::format("{}: a collective during backward while the gradient sums overlap it; the model must call "
                             "set_collectives_in_backward(true) before its gradients are bound",
                             what));
  }

  bool ring_;
  std::unique_ptr<Communicator> nccl_;
  std::int64_t bytes_per_pack_;
  bool overlap_requested_;
  std::unique_ptr<Reducer> reducer_;  // made with replica 0's gradients
};

void parse(const config::Section& s, config::StrategyConfig& out) {
  MultiWorkerMirroredOptions o;
  o.devices = config::read_devices_key(s, out);
  s.get("communication", o.communication, config::read_communication);
  o.roles = config::read_roles_key(s, out);
  config::check_parameter_servers(s, o.roles);
  out.options = o;
}

void write(const config::StrategyOptions& options, config::OptionsWriter& out) {
  const auto& o = options_as<MultiWorkerMirroredOptions>(options);
  config::write_devices(out, o.devices);
  const config::CommunicationConfig& c = o.communication;
  out.begin_map("communication");
  out.enumeration("implementation", config::communication_implementations, c.implementation);
  out.integer("bytes_per_pack", c.bytes_per_pack);
  out.boolean("overlap", c.overlap);
  out.number("timeout_seconds", c.timeout_seconds);
  out.end_map();
  const config::RolesConfig& r = o.roles;
  if (r.chief == 1 && r.worker < 0 && r.evaluator == 0) return;  // the default: every rank trains
  out.begin_map("roles");
  out.integer("chief", r.chief);
  if (r.worker >= 0) out.integer("worker", r.worker);  // left out: the rest
  out.integer("evaluator", r.evaluator);
  out.end_map();
}

std::vector<config::TemplateNote> template_notes() {
  std::vector<std::string_view> implementations;
  for (const auto& entry : config::communication_implementations) implementations.push_back(entry.name);
  const config::RolesConfig roles;
  return {{.key = "devices", .beside = "auto: one replica per rank (the GPU of its local rank, else a CPU), or [cpu:0, cpu:1]: replicas in each rank"},
          {.key = "communication",
           .above = fmt::format("implementation: {}; bytes_per_pack: gradients per all-reduce, 0 = one pack;\n"
                                "overlap: start a pack's all-reduce while backward computes the earlier layers;\n"
                                "timeout_seconds: a collective that takes longer aborts the job (exit 5)",
                                fmt::join(implementations, " | ")),
           .after = fmt::format("roles: {{chief: {}, evaluator: {}}}   # worker left out: every other rank; evaluator: "
                                "1 adds a rank that evaluates each checkpoint",
                                roles.chief, roles.evaluator)},
          {.key = "roles", .beside = std::string(config::roles_note)}};
}

// This process's index among the ranks of its node, as the MPI launchers say it (0 when started
// otherwise): which GPU `devices: auto` gives it.
int launcher_local_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"})
    if (const char* v = std::getenv(name); v && *v) return std::max(0, std::atoi(v));
  return 0;
}

std::vector<Device> local_devices(const config::StrategyConfig& config, int) {
  const config::DeviceList& devices = options_as<MultiWorkerMirroredOptions>(config).devices;
  // auto: one replica per worker process: its node's GPU of the same index as its local rank
  // where GPUs are visible (two ranks on a node of two GPUs: gpu:0 and gpu:1), else the CPU.
  if (const int gpus = devices.automatic ? automatic_gpus(config) : 0; gpus > 0)
    return {Device{Device::Kind::gpu, launcher_local_rank() % gpus}};
  return devices_of(devices, 1);
}

const config::RolesConfig* roles(const config::StrategyConfig& config) {
  return &options_as<MultiWorkerMirroredOptions>(config).roles;
}

std::unique_ptr<Strategy> make(const config::StrategyConfig& config, std::vector<Device> devices, int total_threads,
                               Communicator& workers) {
  const MultiWorkerMirroredOptions& o = options_as<MultiWorkerMirroredOptions>(config);
  using config::CommunicationImplementation;
  const auto impl = o.communication.implementation;
  const std::string where = config::location_prefix(o.communication.implementation_where, config.where);
  const bool one_gpu = devices.size() == 1 && on_gpus(devices);
  if (impl == CommunicationImplementation::nccl && !on_gpus(devices))
    throw ConfigError(fmt::format(
        "{}communication.implementation nccl needs GPU devices, and these workers' replicas are on {}; use ring or mpi "
        "(auto picks one)",
        where, device_list(devices)));
  if (impl == CommunicationImplementation::nccl && !one_gpu)
    throw ConfigError(fmt::format(
        "{}communication.implementation nccl takes one GPU per worker process, and each worker here has {}; start one "
        "rank per GPU (devices: auto gives each rank the GPU of its local rank), or use ring or mpi",
        where, device_list(devices)));
  if (impl == CommunicationImplementation::nccl && !nccl())
    throw ConfigError(fmt::format(
        "{}communication.implementation nccl over {}: {}, or use ring or mpi (they sum GPU replicas through the "
        "host)",
        where, device_list(devices), why_no_nccl()));
  workers.set_timeout(o.communication.timeout_seconds);
  // auto on one GPU per worker: NCCL where this build has it, as TensorFlow's AUTO picks it for GPUs.
  const bool use_nccl = impl == CommunicationImplementation::nccl ||
                        (impl == CommunicationImplementation::auto_select && one_gpu && nccl() && workers.size() > 1);
  ReplicaLayout layout{MultiWorkerMirroredOptions::kind.data(), std::move(devices), CrossDeviceOp::ring};
  if (impl == CommunicationImplementation::auto_select && use_nccl)
    layout.choice_note = fmt::format(
        "communication: auto chose nccl: {} workers of one GPU each, summed by NCCL in device memory", workers.size());
  else if (impl == CommunicationImplementation::auto_select && workers.size() > 1)
    layout.choice_note = fmt::format(
        "communication: auto chose mpi: {} {} workers, and the MPI library's own MPI_Allreduce picks its algorithm "
        "for the message size and process count",
        workers.size(), on_gpus(layout.devices) ? "GPU" : "CPU");
  return std::make_unique<MultiWorkerMirroredStrategy>(std::move(layout), total_threads, workers, o.communication,
                                                       impl == CommunicationImplementation::ring,
                                                       use_nccl ? nccl()->across_workers(workers) : nullptr);
}

const StrategyRegistration registered({.kind = MultiWorkerMirroredOptions::kind,
                                       .listed_at = 50,
                                       .keys = {"devices", "communication", "roles"},
                                       .parse = &parse,
                                       .write = &write,
                                       .summary = "one worker per MPI rank (mpirun -n 2 dtrain run FILE)",
                                       .launcher = "mpirun -n 2 ",
                                       .notes = &template_notes},
                                      {.local_devices = &local_devices, .roles = &roles, .make = &make});

}  // namespace

}  // namespace dtrain::distribute
