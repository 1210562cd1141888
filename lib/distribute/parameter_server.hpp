// tf.distribute.experimental.ParameterServerStrategy over MPI ranks: the chief (rank 0) is the
// coordinator, then come the workers, then the parameter servers (roles.hpp). The variables and
// their optimizer slots live on the servers, each cut into shards by the variable partitioner
// (partitioner.hpp); a worker runs the steps the coordinator schedules on one batch of its own
// input, reading the variables from the servers and pushing its gradients back, and each server
// applies the optimizer to its shards as pushes arrive: asynchronously, no worker waits for
// another.
//
// To the training loop each rank is one replica on its own (collectives are no-ops, the replicas
// in sync are 1: a scheduled step's loss and gradients are those of one worker's batch, as in
// TensorFlow), and the loop is not the trainer's: schedules_steps() says so, and the coordinator,
// worker and server loops this kind registers with the trainer
// (train/strategies/parameter_server_loop.cpp) run instead. An evaluator rank is an
// ordinary one-replica process that evaluates checkpoints.
#pragma once

#include <memory>
#include <string_view>

#include "config/experiment.hpp"
#include "distribute/partitioner.hpp"
#include "distribute/ps_transport.hpp"
#include "distribute/replicated_strategy.hpp"
#include "distribute/roles.hpp"

namespace dtrain::distribute {

struct ParameterServerOptions {
  static constexpr std::string_view kind = "parameter_server";
  config::CommunicationConfig communication;  // timeout_seconds: how long a rank waits for another
  config::RolesConfig roles;                  // chief (the coordinator), workers, parameter servers, evaluator
  VariablePartitionerConfig variable_partitioner;
  bool operator==(const ParameterServerOptions&) const = default;
};

class ParameterServerStrategy final : public ReplicatedStrategy {
 public:
  ParameterServerStrategy(const config::StrategyConfig& config, int total_threads);

  std::string describe() const override;
  // The coordinator prints and writes the run's files; an evaluator rank is alone on its side of
  // the job and writes its own.
  bool is_chief() const override { return role_ == Role::chief || role_ == Role::evaluator; }
  // Gradients go to the servers, which apply them: nothing is applied where they are computed.
  bool update(const ReplicaContext&, const std::function<void()>&) override { return false; }
  bool schedules_steps() const override { return role_ != Role::evaluator; }
  bool lost_a_rank() const override { return transport_->peer_lost(); }

  Role role() const { return role_; }
  const RolePlan& plan() const { return plan_; }
  // World ranks of worker i and of server s.
  int worker_rank(int i) const { return plan_.chiefs + i; }
  int server_rank(int s) const { return plan_.chiefs + plan_.workers + s; }
  // This rank among the workers (a worker only).
  int worker_number() const { return transport_->rank() - plan_.chiefs; }
  const VariablePartitionerConfig& partitioner() const { return partitioner_; }
  PsTransport& transport() { return *transport_; }
  double timeout_seconds() const { return transport_->timeout_seconds(); }

 private:
  RolePlan plan_;
  Role role_ = Role::chief;
  VariablePartitionerConfig partitioner_;
  std::unique_ptr<PsTransport> transport_;
};

}  // namespace dtrain::distribute
