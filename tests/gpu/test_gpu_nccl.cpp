// NCCL's communicators on real GPUs (distribute/nccl_communicator.hpp): a sum over one GPU (the
// local group and the workers' communicator, which every machine with a GPU can run), over two
// GPUs when the machine has them, and mirrored training over two GPUs against one.
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "distribute/nccl_communicator.hpp"
#include "distribute/single_communicator.hpp"
#include "dtrain/build_info.hpp"
#include "gpu_support.hpp"
#include "../unit/trainer_support.hpp"

using namespace dtrain;
using namespace dtrain::gpu_testing;
namespace cuda = dtrain::backends::cuda;

namespace {

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  return n;
}

bool skip_without_nccl() {
  if (distribute::nccl()) return false;
  MESSAGE("SKIP: this build has no NCCL (CMake found no nccl.h and libnccl beside CUDA)");
  return true;
}

// Every variable of replica `replica`'s model, read back from its GPU (the unit tests' weights()
// reads host memory in place).
std::vector<double> gpu_weights(train::Trainer& t, int replica = 0) {
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<double> w;
  for (const Variable* v : t.model(replica).variables()) {
    const Device d = t.strategy().replica_device(replica);
    REQUIRE(cudaSetDevice(d.index) == cudaSuccess);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<float> host(static_cast<std::size_t>(v->value.numel()));
    REQUIRE(cudaMemcpy(host.data(), v->value.raw(), host.size() * sizeof(float), cudaMemcpyDefault) == cudaSuccess);
    w.insert(w.end(), host.begin(), host.end());
  }
  return w;
}

}  // namespace

TEST_CASE("nccl over one GPU: the local group and the workers' communicator leave the sum of one in place") {
  if (skip_without_nccl()) return;
  MESSAGE(distribute::nccl()->version());
  auto& ctx = gpu();
  CHECK(ctx.native_stream() == static_cast<void*>(ctx.stream()));
  const std::vector<float> values = uniform(1000, -1.0f, 1.0f, 1);
  SUBCASE("local group") {
    auto group = distribute::make_replica_group({Device{Device::Kind::gpu, 0}}, distribute::CrossDeviceOp::nccl);
    distribute::Communicator& endpoint = group->endpoint(0);
    REQUIRE(endpoint.sums_device_memory());
    device::Buffer b = upload(values);
    for (int round = 0; round < 2; ++round)  // the second round reuses the communicator made by the first
      endpoint.all_reduce_sum_on_device(ctx, ptr<float>(b), values.size(), "gradients");
    CHECK(download<float>(b, values.size()) == values);
    // The host collectives go on beside NCCL.
    double loss = 2.5;
    endpoint.all_reduce_sum(std::span<double>(&loss, 1), "step loss");
    CHECK(loss == 2.5);
  }
  SUBCASE("one worker") {
    distribute::SingleCommunicator alone;
    auto workers = distribute::nccl()->across_workers(alone);
    REQUIRE(workers->sums_device_memory());
    device::Buffer b = upload(values);
    workers->all_reduce_sum_on_device(ctx, ptr<float>(b), values.size(), "gradients");
    CHECK(download<float>(b, values.size()) == values);
  }
}

TEST_CASE("nccl over two GPUs: every replica holds the sum, the same bits twice") {
  if (skip_without_nccl()) return;
  if (gpu_count() < 2) {
    MESSAGE("SKIP: this machine has " << gpu_count() << " GPU; the two-GPU NCCL sum needs two");
    return;
  }
  const std::size_t n = 100003;  // not a multiple of NCCL's chunks
  const std::vector<float> a = uniform(n, -1.0f, 1.0f, 2), b = uniform(n, -1.0f, 1.0f, 3);
  auto group = distribute::make_replica_group({Device{Device::Kind::gpu, 0}, Device{Device::Kind::gpu, 1}},
                                              distribute::CrossDeviceOp::nccl);
  std::vector<std::vector<float>> results(2);
  auto replica = [&](int r) {
    auto ctx = cuda::make_cuda_context({Device::Kind::gpu, r});
    auto& c = cuda::CudaContext::of(*ctx);
    c.activate();
    const std::vector<float>& mine = r == 0 ? a : b;
    device::Buffer buffer = c.allocate(n * sizeof(float));
    c.copy_from_host(mine.data(), buffer.get(), n * sizeof(float));
    group->endpoint(r).all_reduce_sum_on_device(*ctx, static_cast<float*>(buffer.get()), n, "gradients");
    results[static_cast<std::size_t>(r)].resize(n);
    c.copy_to_host(buffer.get(), results[static_cast<std::size_t>(r)].data(), n * sizeof(float));
  };
  std::thread t0(replica, 0), t1(replica, 1);
  t0.join();
  t1.join();
  CHECK(results[0] == results[1]);
  std::size_t off = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (results[0][i] != a[i] + b[i]) ++off;  // two terms: any order gives the same float
  CHECK(off == 0);
}

TEST_CASE("nccl over two GPUs: a sum whose peer never comes is abandoned, and the group sums afresh after") {
  if (skip_without_nccl()) return;
  if (gpu_count() < 2) {
    MESSAGE("SKIP: this machine has " << gpu_count() << " GPU; abandoning a two-GPU NCCL sum needs two");
    return;
  }
  const std::size_t n = 4099;
  auto group = distribute::make_replica_group({Device{Device::Kind::gpu, 0}, Device{Device::Kind::gpu, 1}},
                                              distribute::CrossDeviceOp::nccl);
  std::vector<std::unique_ptr<device::Context>> contexts;
  std::vector<device::Buffer> buffers;
  for (int r = 0; r < 2; ++r) {
    contexts.push_back(cuda::make_cuda_context({Device::Kind::gpu, r}));
    auto& c = cuda::CudaContext::of(*contexts.back());
    c.activate();
    buffers.push_back(c.allocate(n * sizeof(float)));
    const std::vector<float> ones(n, 1.0f);
    c.copy_from_host(ones.data(), buffers.back().get(), n * sizeof(float));
  }
  auto sum_on = [&](int r) {
    cuda::CudaContext::of(*contexts[static_cast<std::size_t>(r)]).activate();
    group->endpoint(r).all_reduce_sum_on_device(*contexts[static_cast<std::size_t>(r)],
                                                static_cast<float*>(buffers[static_cast<std::size_t>(r)].get()), n,
                                                "gradients");
  };
  auto both = [&] {
    std::thread t0(sum_on, 0), t1(sum_on, 1);
    t0.join();
    t1.join();
  };
  both();  // makes the clique: 2 everywhere
  // Replica 1 fails before its sum: replica 0's waits on its GPU for ever, and so would the
  // stream's synchronize of its context's teardown, until the group abandons it.
  sum_on(0);
  group->abandon_device_sums();
  auto& c0 = cuda::CudaContext::of(*contexts[0]);
  c0.activate();
  // The aborted sum no longer holds the stream: it drains (a bound, so that a regression fails
  // here rather than hangs in the synchronize of the teardown).
  const auto stream = static_cast<cudaStream_t>(contexts[0]->native_stream());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  cudaError_t state = cudaErrorNotReady;
  while ((state = cudaStreamQuery(stream)) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline)
    std::this_thread::yield();
  REQUIRE_MESSAGE(state != cudaErrorNotReady, "the abandoned NCCL sum still holds replica 0's stream after 60 s");
  c0.synchronize();
  // A later step makes a new clique and sums as before.
  std::vector<float> ones(n, 1.0f);
  for (int r = 0; r < 2; ++r) {
    auto& c = cuda::CudaContext::of(*contexts[static_cast<std::size_t>(r)]);
    c.activate();
    c.copy_from_host(ones.data(), buffers[static_cast<std::size_t>(r)].get(), n * sizeof(float));
  }
  both();
  for (int r = 0; r < 2; ++r) {
    auto& c = cuda::CudaContext::of(*contexts[static_cast<std::size_t>(r)]);
    c.activate();
    std::vector<float> back(n);
    c.copy_to_host(buffers[static_cast<std::size_t>(r)].get(), back.data(), n * sizeof(float));
    CHECK(back == std::vector<float>(n, 2.0f));
  }
}

TEST_CASE("mirrored over two GPUs with nccl follows one GPU on the same global batch") {
  if (skip_without_nccl()) return;
  if (gpu_count() < 2) {
    MESSAGE("SKIP: this machine has " << gpu_count() << " GPU; mirrored over two GPUs needs two");
    return;
  }
  const auto experiment = [](const std::string& strategy, int per_replica) {
    return testing::small_data_experiment("nccl", 5, strategy, per_replica) + R"(model:
  input_shape: [28, 28, 1]
  layers:
    - conv2d: {filters: 4, kernel_size: 3, strides: 2, activation: relu}
    - max_pool2d: {pool_size: 2}
    - flatten: {}
    - dense: {units: 16, activation: relu, kernel_regularizer: {l2: 1.0e-3}}
    - dense: {units: 10}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: sgd, learning_rate: 0.05, momentum: 0.9}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, threads: 1, progress: none}
)";
  };
  // As the unit tests' trajectory_of and check_follows, with the weights read from the GPUs.
  auto reference = testing::make_trainer(experiment("{kind: one_device, device: gpu:0}", 32));
  auto mirrored =
      testing::make_trainer(experiment("{kind: mirrored, devices: [gpu:0, gpu:1], cross_device_ops: nccl}", 16));
  REQUIRE(mirrored->strategy().num_replicas_in_sync() == 2);
  CHECK(gpu_weights(*mirrored) == gpu_weights(*reference));
  for (const int steps : {1, 49}) {
    reference->train_steps(0, steps);
    mirrored->train_steps(0, steps);
    CAPTURE(steps);
    CHECK(testing::rel_diff(gpu_weights(*mirrored), gpu_weights(*reference)) < (steps == 1 ? 1e-5 : 1e-4));
  }
  CHECK(gpu_weights(*mirrored, 1) == gpu_weights(*mirrored, 0));  // the copies stay the same bits
}
