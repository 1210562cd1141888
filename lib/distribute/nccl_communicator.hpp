// NCCL's collectives over GPU memory (tf.distribute.NcclAllReduce), as Communicators:
//   local_gpus      the replica threads of one process, one GPU each (mirrored with
//                   cross_device_ops: nccl): one NCCL communicator per replica, made by
//                   ncclCommInitRank on each replica's own thread.
//   across_workers  one GPU per worker process (multi_worker_mirrored with
//                   communication.implementation: nccl): NCCL's unique id is broadcast from rank 0
//                   over the workers' MPI communicator, then every rank joins with ncclCommInitRank.
// Only the float sums of a gradient arena run on NCCL (all_reduce_sum_on_device, queued on the
// replica's stream after backward and before the optimizer's update: no staging through the
// host, and the host does not wait). Every host-memory collective (metric counts, the step loss,
// the stop agreement) stays on the threads' or MPI's communicator the NCCL one wraps.
//
// The communicators are made on the first device sum, not with the strategy: by then every
// replica's context exists, so a missing GPU has been reported as such (exit 2 naming the device
// and how many GPUs the machine has), and each replica thread has its device current.
//
// Determinism: NCCL picks its algorithm (ring or tree), protocol and channel count from the
// message size, the number of ranks and the topology it detects, and the order in which each
// element's terms are added follows from that choice. For a fixed configuration (the same GPUs,
// links, NCCL version and NCCL_* environment) a step's sums are the same bits every run; they
// differ in rounding from the host ops' order (thread_group.hpp), as TensorFlow's NCCL and
// hierarchical copy do.
//
// nccl_communicator.cpp is built only where CMake finds NCCL with CUDA, into the CUDA backend's
// module (backends/cuda/backend.cmake); it registers its factories when the module loads, which
// nccl() asks for (device/gpu_module.hpp). Without it nccl() is null, and the strategies refuse
// nccl with a ConfigError that says so.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "distribute/communicator.hpp"
#include "distribute/replica_group.hpp"

namespace dtrain::distribute {

struct NcclFactories {
  // The group of the local replicas on `devices` (every one a GPU, none twice).
  std::unique_ptr<ReplicaGroup> (*local_gpus)(const std::vector<Device>& devices) = nullptr;
  // This worker's endpoint of the NCCL communicator over every worker of `workers` (which must
  // outlive it), one GPU each; its host-memory collectives are the workers'.
  std::unique_ptr<Communicator> (*across_workers)(Communicator& workers) = nullptr;
  // "NCCL 2.28.3 (built with 2.28.3)": for dtrain info.
  std::string (*version)() = nullptr;
};

// The registered factories, after loading the CUDA module where this build has NCCL; null when
// it has none or the module cannot load.
const NcclFactories* nccl();
// Why nccl() is null: this build has no NCCL (what to rebuild with), or the CUDA module cannot load
// (the loader's words); the strategies' refusals end with it.
std::string why_no_nccl();
// Called once, by nccl_communicator.cpp as the module loads.
bool register_nccl(const NcclFactories& factories);

}  // namespace dtrain::distribute
