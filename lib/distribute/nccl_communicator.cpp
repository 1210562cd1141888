// NCCL's communicators (nccl_communicator.hpp). Built only where CMake found NCCL with CUDA.
#include "distribute/nccl_communicator.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <set>

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>

#include "distribute/thread_group.hpp"

namespace dtrain::distribute {

namespace {

std::string version_text(int code) {
  // NCCL_VERSION_CODE since 2.9: major * 10000 + minor * 100 + patch.
  return fmt::format("{}.{}.{}", code / 10000, code / 100 % 100, code % 100);
}

std::string nccl_version() {
  int runtime = 0;
  const bool found = ncclGetVersion(&runtime) == ncclSuccess;
  return fmt::format("NCCL {} (built with {})", found ? version_text(runtime) : "unknown", version_text(NCCL_VERSION_CODE));
}

// A failed NCCL call: what NCCL says, the call, the devices, and where to look further. A failure
// of the machine's setup (transport, a peer, CUDA underneath) is a ConfigError (exit 2) the user
// can act on; a misuse is a dtrain bug.
[[noreturn]] void throw_nccl(ncclResult_t status, const char* call, const std::string& where, ncclComm_t comm = nullptr) {
  const char* last = ncclGetLastError(comm);
  const std::string message =
      fmt::format("NCCL {} failed over {}: {}{}{}; run with NCCL_DEBUG=WARN for NCCL's own account", call, where,
                  ncclGetErrorString(status), last && *last ? ": " : "", last ? last : "");
  if (status == ncclInvalidArgument || status == ncclInvalidUsage || status == ncclInternalError)
    throw InternalError(message);
  throw ConfigError(message);
}

#define DTRAIN_NCCL_CALL(where, call)                                          \
  do {                                                                         \
    const ncclResult_t dtrain_nccl_status_ = (call);                           \
    if (dtrain_nccl_status_ != ncclSuccess) throw_nccl(dtrain_nccl_status_, #call, (where)); \
  } while (0)

void set_device(Device device) {
  const cudaError_t status = cudaSetDevice(device.index);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    throw ConfigError(fmt::format("NCCL over {}: cudaSetDevice({}) failed: {}", device.to_string(), device.index,
                                  cudaGetErrorString(status)));
  }
}

// One NCCL sum queued on the replica's stream, in place (NCCL allows sendbuff == recvbuff).
void all_reduce_on_stream(ncclComm_t comm, device::Context& ctx, float* values, std::size_t count, const char* what,
                          const std::string& where) {
  void* stream = ctx.native_stream();
  DTRAIN_CHECK(stream != nullptr, fmt::format("{}: the {} backend of {} has no stream for NCCL to queue on", what,
                                              ctx.backend(), ctx.device().to_string()));
  if (count == 0) return;
  set_device(ctx.device());  // NCCL launches on the calling thread's current device
  DTRAIN_NCCL_CALL(where, ncclAllReduce(values, values, count, ncclFloat, ncclSum, comm, static_cast<cudaStream_t>(stream)));
}

// What both NCCL communicators share: every host-memory collective goes to the communicator
// beside them (the replica threads' or the workers'); only the sums of device memory are NCCL's.
class NcclCommunicator : public Communicator {
 public:
  explicit NcclCommunicator(Communicator& host) : host_(host) {}
  const char* name() const override { return "nccl"; }
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  void all_reduce_sum(std::span<float> values, const char* what) override { host_.all_reduce_sum(values, what); }
  void all_reduce_sum(std::span<double> values, const char* what) override { host_.all_reduce_sum(values, what); }
  void all_reduce_sum(std::span<std::int64_t> values, const char* what) override { host_.all_reduce_sum(values, what); }
  int all_reduce_max(int value, const char* what) override { return host_.all_reduce_max(value, what); }
  void reduce_sum_to(std::span<float> values, int root, const char* what) override {
    host_.reduce_sum_to(values, root, what);
  }
  void broadcast(std::span<float> values, int root, const char* what) override { host_.broadcast(values, root, what); }
  void broadcast(std::span<double> values, int root, const char* what) override { host_.broadcast(values, root, what); }
  void set_step(std::int64_t step) override { host_.set_step(step); }
  void set_timeout(double seconds) override { host_.set_timeout(seconds); }
  bool sums_device_memory() const override { return true; }

 protected:
  Communicator& host() { return host_; }

 private:
  // Nothing rings over an NCCL communicator (PackedAllReduce's ring is for host memory).
  RingTransport& ring_transport() override {
    throw InternalError("an NCCL communicator has no host ring; its float sums of device memory run on NCCL");
  }

  Communicator& host_;
};

// ---- the replica threads of one process, one GPU each

class NcclLocalGroup;

// Replica r's endpoint: its float sums of device memory go through NCCL, everything else through
// the host-memory thread group beside it.
class NcclEndpoint final : public NcclCommunicator {
 public:
  NcclEndpoint(NcclLocalGroup& group, ThreadCommunicator& host) : NcclCommunicator(host), group_(group) {}
  void all_reduce_sum_on_device(device::Context& ctx, float* values, std::size_t count, const char* what) override;

 private:
  NcclLocalGroup& group_;
};

class NcclLocalGroup final : public ReplicaGroup {
 public:
  explicit NcclLocalGroup(const std::vector<Device>& devices)
      : devices_(devices), host_(static_cast<int>(devices.size()), CrossDeviceOp::ring), comms_(devices.size(), nullptr) {
    std::set<int> seen;
    for (const Device& d : devices_) {
      DTRAIN_CHECK(d.kind == Device::Kind::gpu, fmt::format("the nccl replica group got {}, not a GPU", d.to_string()));
      // NCCL hangs when one GPU is two ranks of a communicator.
      DTRAIN_CHECK(seen.insert(d.index).second,
                   fmt::format("the nccl replica group got {} twice; NCCL needs a different GPU per replica", d.to_string()));
    }
    for (int r = 0; r < host_.size(); ++r) endpoints_.push_back(std::make_unique<NcclEndpoint>(*this, host_.endpoint(r)));
  }
  ~NcclLocalGroup() override {
    if (!made_) return;
    // One thread finalizes every communicator of the clique: inside one group, so that none waits
    // for a peer that this same thread has not reached yet. Errors are not thrown from here.
    (void)ncclGroupStart();
    for (ncclComm_t c : comms_) (void)ncclCommFinalize(c);
    (void)ncclGroupEnd();
    for (ncclComm_t c : comms_) (void)ncclCommDestroy(c);
  }
  NcclLocalGroup(const NcclLocalGroup&) = delete;
  NcclLocalGroup& operator=(const NcclLocalGroup&) = delete;

  int size() const override { return host_.size(); }
  const char* name() const override { return "nccl"; }
  Communicator& endpoint(int replica) override {
    DTRAIN_CHECK(replica >= 0 && replica < size(),
                 fmt::format("replica {} is outside the nccl group's [0, {})", replica, size()));
    return *endpoints_[static_cast<std::size_t>(replica)];
  }
  Barrier& barrier() override { return host_.barrier(); }
  // ncclCommAbort, not finalize or destroy: those wait for the queued sums, which wait for the
  // failed replica's. The next sum makes a new clique (comm()).
  void abandon_device_sums() override {
    if (!made_) return;
    for (ncclComm_t& c : comms_) {
      (void)ncclCommAbort(c);
      c = nullptr;
    }
    made_ = false;
  }

  // Replica r's communicator, made on the first sum: every replica arrives, replica 0 makes the
  // whole clique with ncclCommInitAll (one thread: a failure is one exception, which breaks the
  // barrier for the others instead of leaving them inside NCCL's initialization), and every
  // replica leaves with its own.
  ncclComm_t comm(int replica) {
    if (made_) return comms_[static_cast<std::size_t>(replica)];
    host_.barrier().arrive_and_wait();
    if (replica == 0 && !made_) {
      std::vector<int> indices;
      for (const Device& d : devices_) indices.push_back(d.index);
      DTRAIN_NCCL_CALL(where(), ncclCommInitAll(comms_.data(), size(), indices.data()));
      made_ = true;
    }
    host_.barrier().arrive_and_wait();  // publishes comms_ and made_ to every replica
    return comms_[static_cast<std::size_t>(replica)];
  }
  std::string where() const {
    std::string s;
    for (const Device& d : devices_) s += (s.empty() ? "" : ", ") + d.to_string();
    return s;
  }

 private:
  std::vector<Device> devices_;
  ThreadGroup host_;  // the host-memory collectives, and the replicas' barrier
  std::vector<ncclComm_t> comms_;
  // Written by replica 0 between two barriers, read by each replica on its own thread afterwards.
  bool made_ = false;
  std::vector<std::unique_ptr<NcclEndpoint>> endpoints_;
};

void NcclEndpoint::all_reduce_sum_on_device(device::Context& ctx, float* values, std::size_t count, const char* what) {
  ncclComm_t comm = group_.comm(rank());
  all_reduce_on_stream(comm, ctx, values, count, what, group_.where());
}

// ---- one GPU per worker process

class NcclWorkerCommunicator final : public NcclCommunicator {
 public:
  explicit NcclWorkerCommunicator(Communicator& workers) : NcclCommunicator(workers) {}
  ~NcclWorkerCommunicator() override {
    if (comm_) (void)ncclCommDestroy(comm_);
  }
  NcclWorkerCommunicator(const NcclWorkerCommunicator&) = delete;
  NcclWorkerCommunicator& operator=(const NcclWorkerCommunicator&) = delete;

  void all_reduce_sum_on_device(device::Context& ctx, float* values, std::size_t count, const char* what) override {
    DTRAIN_CHECK(!abandoned_, fmt::format("{}: a device sum after a failed step abandoned NCCL's communicator", what));
    if (!comm_) join(ctx.device());
    all_reduce_on_stream(comm_, ctx, values, count, what, where_);
  }

 private:
  // Every worker calls this at the same point (its first device sum): rank 0 makes NCCL's unique
  // id, the workers' own communicator carries it to the others, and each joins with its GPU.
  void join(Device device) {
    where_ = fmt::format("{} workers (this one rank {} on {})", size(), rank(), device.to_string());
    ncclUniqueId id{};
    if (rank() == 0) DTRAIN_NCCL_CALL(where_, ncclGetUniqueId(&id));
    // The id is opaque bytes; a broadcast of doubles moves bytes unchanged (no arithmetic, and
    // every rank is the same kind of machine), so it rides on the collective the group has.
    std::array<double, (sizeof(ncclUniqueId) + sizeof(double) - 1) / sizeof(double)> words{};
    std::memcpy(words.data(), &id, sizeof id);
    host().broadcast(std::span<double>(words), 0, "NCCL unique id");
    std::memcpy(&id, words.data(), sizeof id);
    set_device(device);
    DTRAIN_NCCL_CALL(where_, ncclCommInitRank(&comm_, size(), id, rank()));
  }

  // The other workers may wait in the sum this one queued (or it in theirs): abort, do not
  // destroy, which would wait for it. No sum follows: the failed step ends the job, and a new
  // communicator would need every worker to join it at the same point.
  void abandon_device_sums() override {
    if (comm_) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
    abandoned_ = true;
  }

  ncclComm_t comm_ = nullptr;
  bool abandoned_ = false;
  std::string where_;
};

std::unique_ptr<ReplicaGroup> make_local(const std::vector<Device>& devices) {
  return std::make_unique<NcclLocalGroup>(devices);
}

std::unique_ptr<Communicator> make_across_workers(Communicator& workers) {
  return std::make_unique<NcclWorkerCommunicator>(workers);
}

const bool registered = register_nccl({.local_gpus = &make_local, .across_workers = &make_across_workers,
                                       .version = &nccl_version});

}  // namespace

}  // namespace dtrain::distribute
