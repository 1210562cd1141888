// The messages of ParameterServerStrategy: MPI point-to-point on a duplicate of MPI_COMM_WORLD of
// its own, so they never meet the collectives of the rest of the job. World ranks: the chief
// (coordinator) 0, then the workers, then the parameter servers (roles.hpp).
//
//   chief -> worker   an order: run global step g of epoch e, answer a roll call, or stop
//   worker -> chief   a step's result (loss, samples, staleness, metric state), or its answer to
//                     a roll call, as doubles
//   worker -> server  pull (the server's shards, and its version: updates applied so far), or
//                     push (gradients read at a version; the server applies them as they arrive
//                     and answers how many updates landed in between: the staleness)
//   chief -> server   gather (values, optimizer slots, iterations), a roll call, or stop
//
// The roll call comes before the stop: a rank that died with nothing asked of it (a worker idle
// since the last boundary, a server after the last gather) is noticed by nobody else, and every
// survivor told to stop normally would then wait forever in MPI_Finalize for it.
//
// Nothing waits without a limit on one peer: every wait polls (giving the core away, for
// oversubscribed ranks) until a limit, and a peer that does not answer by then is named in the
// exception. A server never blocks on a worker: replies are sent without waiting, and it keeps
// answering the others while a push's gradients are on their way (a push whose data does not
// arrive in time is dropped). This is what lets the coordinator survive a worker that dies (under
// mpirun --enable-recovery, where the other ranks keep running).
//
// The limits, with T = communication.timeout_seconds:
//   T      the coordinator's patience with a worker that has steps in flight (then it is lost)
//   T / 2  a worker's or the coordinator's with a server (server_timeout): a worker stuck on a
//          lost server reports it before the coordinator would give up on that worker
//   T      a server's with the gradients of a push: only that worker's push waits (the server
//          answers the others meanwhile), and by then the coordinator has given its steps away
//   2 T    a worker's or a server's with the coordinator (coordinator_timeout), which may be
//          evaluating the test split or writing a checkpoint meanwhile
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace dtrain::distribute {

// A parameter server did not answer in time: the job cannot go on without its variables.
struct ServerLost : PeerLostError {
  ServerLost(int rank, const std::string& what) : PeerLostError(what), server_rank(rank) {}
  int server_rank;
};

struct StepOrder {
  enum Kind : std::int64_t { step = 0, stop = 1, stop_after_loss = 2, roll_call = 3 };
  std::int64_t kind = step;
  std::int64_t global_step = 0;
  std::int64_t epoch = 0;
  // The step of the epoch the coordinator started it at (0, or a resumed checkpoint's step):
  // where in its share a worker's input starts the epoch.
  std::int64_t epoch_first_step = 0;
};

struct StepResultMessage {
  int worker_rank = 0;
  std::vector<double> payload;
};

// What a server does with requests (the training layer owns the variables and the optimizer).
struct ServerHandlers {
  std::function<void(std::vector<float>& out)> values;  // its shards, in shard order
  std::function<void(std::span<const float> gradients)> apply;
  std::function<std::int64_t(std::vector<float>& out)> state;  // values then slots; returns iterations
  // Whether this server's process was asked to stop (a signal): told to the workers that pull, who
  // pass it on to the coordinator. Null: never.
  std::function<bool()> stop_requested;
};

class PsTransport {
 public:
  // Collective over MPI_COMM_WORLD: every rank of the job (the evaluator too) makes it once.
  explicit PsTransport(double timeout_seconds);
  ~PsTransport();
  PsTransport(const PsTransport&) = delete;
  PsTransport& operator=(const PsTransport&) = delete;

  // Whether a rank of the job is known to be gone (a worker, server or coordinator that stopped
  // answering, or the coordinator's word that one did). MPI_Finalize must then not be called:
  // with OpenMPI 4.1.4 under --enable-recovery it waits forever for the dead rank over TCP, and
  // over shared memory too once another survivor has ended without it (measured). The strategy
  // reports it (Strategy::lost_a_rank) and the app ends the process without finalizing. The
  // coordinator passes it on with its stop messages, so that every survivor knows.
  void mark_peer_lost();
  bool peer_lost() const;

  int rank() const { return rank_; }
  int size() const { return size_; }
  double timeout_seconds() const { return timeout_; }
  // How long a worker or the coordinator waits for a server's answer, and a worker or a server
  // for the coordinator's next message (the limits above).
  double server_timeout() const { return timeout_ / 2; }
  double coordinator_timeout() const { return 2 * timeout_; }

  // ---- coordinator
  void send_order(int worker_rank, const StepOrder& order);
  // A result that has arrived, else nullopt after a short wait.
  std::optional<StepResultMessage> poll_result();
  // The server's values and optimizer state; returns its iterations. ServerLost when the server
  // does not answer within server_timeout().
  std::int64_t gather(int server_rank, std::vector<float>& state);
  void stop_server(int server_rank);
  // Whether the server answers a roll call within server_timeout(); when it does not, a peer is
  // lost (peer_lost()).
  bool server_answers(int server_rank);

  // ---- worker
  // The next order from the chief; PeerLostError after coordinator_timeout() without one.
  StepOrder receive_order();
  // Waits up to `seconds` for the coordinator to take it (a small message: at once, unless the
  // coordinator is gone).
  void send_result(std::span<const double> payload, double seconds);
  // Returns the server's version; `values` must have the size of its shards. ServerLost when the
  // server does not answer within server_timeout(). `server_asked_to_stop` (when given) is set to
  // whether the server's process was asked to stop (ServerHandlers::stop_requested).
  std::int64_t pull(int server_rank, std::span<float> values, bool* server_asked_to_stop = nullptr);
  // Returns the staleness: updates the server applied between `read_version` and this one.
  std::int64_t push(int server_rank, std::int64_t read_version, std::span<const float> gradients);

  // ---- server: answers requests until the chief says stop. `gradient_floats` is the size of a
  // push. PeerLostError when no request at all came for coordinator_timeout() (the chief is gone).
  void serve(const ServerHandlers& handlers, std::size_t gradient_floats);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int rank_ = 0, size_ = 1;
  double timeout_ = 60.0;
};

}  // namespace dtrain::distribute
