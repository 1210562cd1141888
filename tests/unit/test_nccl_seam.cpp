// What of NCCL's part can run without a GPU: the strategies' choices and refusals for nccl, the
// seam a device-memory communicator plugs into, and `devices: auto` on a machine without GPUs.
// The NCCL sums themselves are the GPU tests' (tests/gpu/test_gpu_nccl.cpp).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "config/parse.hpp"
#include "core/error.hpp"
#include "device/context.hpp"
#include "distribute/nccl_communicator.hpp"
#include "distribute/single_communicator.hpp"
#include "distribute/strategy.hpp"
#include "distribute/thread_group.hpp"
#include "dtrain/build_info.hpp"

using namespace dtrain;

namespace {

config::StrategyConfig strategy(const std::string& yaml) { return config::parse_strategy_section(yaml, "nccl.yaml"); }

}  // namespace

TEST_CASE("nccl is a cross-device op by name; host groups refuse it and do not sum device memory") {
  CHECK(distribute::cross_device_op_named("nccl") == distribute::CrossDeviceOp::nccl);
  CHECK(std::string(distribute::name_of(distribute::CrossDeviceOp::nccl)) == "nccl");
  CHECK_THROWS_AS(distribute::ThreadGroup(2, distribute::CrossDeviceOp::nccl), InternalError);
  distribute::ThreadGroup group(1, distribute::CrossDeviceOp::ring);
  distribute::Communicator& endpoint = group.endpoint(0);
  CHECK_FALSE(endpoint.sums_device_memory());
  const auto cpu = device::make_context(Device{});
  float values[2] = {1, 2};
  CHECK_THROWS_WITH_AS(endpoint.all_reduce_sum_on_device(*cpu, values, 2, "gradients"),
                       doctest::Contains("gradients: the ring communicator sums host memory only"), InternalError);
  distribute::SingleCommunicator alone;
  CHECK_FALSE(alone.sums_device_memory());
  // The CPU backend queues nothing: NCCL would have no stream to take.
  CHECK(cpu->native_stream() == nullptr);
}

TEST_CASE("nccl is registered exactly where the build has NCCL, and says its version") {
  const distribute::NcclFactories* nccl = distribute::nccl();
  CHECK((nccl != nullptr) == build_info::have_nccl);
  if (nccl) CHECK(nccl->version().find("NCCL 2.") == 0);
}

TEST_CASE("mirrored with nccl: refused on CPUs at its key; on GPUs a strategy whose group sums device memory") {
  distribute::SingleCommunicator alone;
  CHECK_THROWS_WITH_AS(
      distribute::make_strategy(strategy("{kind: mirrored, devices: [cpu:0, cpu:1], cross_device_ops: nccl}"), 2, alone),
      doctest::Contains("nccl.yaml:1:61: cross_device_ops nccl needs GPU devices (gpu:N), and these replicas are on "
                        "cpu:0, cpu:1"),
      ConfigError);
  const auto gpus = strategy("{kind: mirrored, devices: [gpu:0, gpu:1], cross_device_ops: nccl}");
  if (!build_info::have_nccl) {
    CHECK_THROWS_WITH_AS(distribute::make_strategy(gpus, 2, alone), doctest::Contains("this build has no NCCL"),
                         ConfigError);
    return;
  }
  // No GPU is touched yet: NCCL's communicators are made on the first sum, after the replicas'
  // contexts (a missing GPU is the context's error, naming the device and the GPUs found).
  const auto s = distribute::make_strategy(gpus, 2, alone);
  CHECK(s->describe() == "strategy mirrored | replicas 2 (gpu:0, gpu:1) | cross-device ops nccl");
  CHECK(s->choice_note().empty());
  // auto on GPUs picks nccl, and says why.
  const auto chosen = distribute::make_strategy(strategy("{kind: mirrored, devices: [gpu:0, gpu:1]}"), 2, alone);
  CHECK(chosen->describe() == "strategy mirrored | replicas 2 (gpu:0, gpu:1) | cross-device ops nccl");
  CHECK(chosen->choice_note().find("cross_device_ops: auto chose nccl: 2 GPU replicas") == 0);
}

TEST_CASE("multi_worker_mirrored with nccl: one GPU per worker, refused otherwise at its key") {
  distribute::SingleCommunicator alone;
  CHECK_THROWS_WITH_AS(
      distribute::make_strategy(
          strategy("{kind: multi_worker_mirrored, devices: [cpu:0], communication: {implementation: nccl}}"), 1, alone),
      doctest::Contains("communication.implementation nccl needs GPU devices"), ConfigError);
  CHECK_THROWS_WITH_AS(
      distribute::make_strategy(
          strategy("{kind: multi_worker_mirrored, devices: [gpu:0, gpu:1], communication: {implementation: nccl}}"), 2,
          alone),
      doctest::Contains("nccl takes one GPU per worker process, and each worker here has gpu:0, gpu:1"), ConfigError);
  const auto one = strategy("{kind: multi_worker_mirrored, devices: [gpu:0], communication: {implementation: nccl}}");
  if (!build_info::have_nccl) {
    CHECK_THROWS_WITH_AS(distribute::make_strategy(one, 1, alone), doctest::Contains("this build has no NCCL"),
                         ConfigError);
    return;
  }
  CHECK(distribute::make_strategy(one, 1, alone)->describe() ==
        "strategy multi_worker_mirrored | workers 1 | replicas 1 (1 per worker: gpu:0) | communication nccl");
}

TEST_CASE("devices: auto without a visible GPU is today's CPU layout") {
  if (device::device_count(Device::Kind::gpu) > 0) {
    MESSAGE("this machine has a GPU: devices: auto takes it (the GPU tests check that)");
    return;
  }
  CHECK(device::device_count(Device::Kind::cpu) == 0);  // the CPU backend counts no devices: auto uses the cores
  distribute::SingleCommunicator alone;
  const auto mirrored = distribute::make_strategy(config::strategy_config_of("mirrored"), 2, alone);
  CHECK(mirrored->replica_device(0).kind == Device::Kind::cpu);
  CHECK(mirrored->num_local_replicas() == 2);
  CHECK(mirrored->choice_note().find("devices: auto") == std::string::npos);
  const auto mwm = distribute::make_strategy(config::strategy_config_of("multi_worker_mirrored"), 2, alone);
  CHECK(mwm->replica_device(0).kind == Device::Kind::cpu);
}
