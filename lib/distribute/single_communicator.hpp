// A group of one: the process alone (not started by an MPI launcher), or a strategy that runs in
// one process. Every collective leaves the values as they are.
#pragma once

#include "distribute/ring.hpp"
#include "distribute/worker_group.hpp"

namespace dtrain::distribute {

class SingleCommunicator final : public WorkerGroup, private RingTransport {
 public:
  const char* name() const override { return "single"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(std::span<float>, const char*) override {}
  void all_reduce_sum(std::span<double>, const char*) override {}
  void all_reduce_sum(std::span<std::int64_t>, const char*) override {}
  int all_reduce_max(int value, const char*) override { return value; }
  void reduce_sum_to(std::span<float> values, int root, const char* what) override;
  void broadcast(std::span<float>, int root, const char* what) override { check_root(root, what); }
  void broadcast(std::span<double>, int root, const char* what) override { check_root(root, what); }

  int world_rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::optional<RolePlan> assign_roles(const config::RolesConfig&, const char*) override { return std::nullopt; }
  void send_training_done(int) override {}
  bool training_done() override { return true; }

 private:
  void end_job(int) override {}  // there are no others
  static void check_root(int root, const char* what);
  RingTransport& ring_transport() override { return *this; }
  // A ring of one has no steps.
  void open(std::span<float>, const char*) override {}
  void exchange(std::span<float>, RingChunk, RingChunk, bool, const char*) override {}
};

}  // namespace dtrain::distribute
