// MultiWorkerMirroredStrategy: mirrored over every worker process (MPI rank) and its local
// replicas. Each step the local replicas sum their gradients (the ring, in shared memory), then
// replica 0 sums them with every other worker's (PackedAllReduce: MPI_Allreduce or the ring over
// point-to-point, in packs) and the other local replicas copy its sum. With one replica per worker,
// at least two packs and communication.overlap, each pack's sum starts while backward computes the
// earlier layers.
#pragma once

#include <string_view>

#include "config/experiment.hpp"

namespace dtrain::distribute {

struct MultiWorkerMirroredOptions {
  static constexpr std::string_view kind = "multi_worker_mirrored";
  // The devices of EACH worker process; auto: one replica per process, the GPU of its local rank
  // where GPUs are visible, else a CPU.
  config::DeviceList devices;
  config::CommunicationConfig communication;
  config::RolesConfig roles;  // chief, workers and evaluator (no parameter servers)
  bool operator==(const MultiWorkerMirroredOptions&) const = default;
};

}  // namespace dtrain::distribute
