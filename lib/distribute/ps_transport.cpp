#include "distribute/ps_transport.hpp"

#include <mpi.h>

#include <chrono>
#include <algorithm>
#include <climits>
#include <list>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::distribute {

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kOrderTag = 7201;
constexpr int kResultTag = 7202;
constexpr int kRequestTag = 7203;
constexpr int kPushDataTag = 7204;
constexpr int kReplyTag = 7205;
constexpr int kValuesTag = 7206;

enum RequestKind : std::int64_t {
  pull_request = 0,
  push_request = 1,
  gather_request = 2,
  stop_request = 3,
  roll_call_request = 4
};

void check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw InternalError(fmt::format("{} failed: {}; the parameter-server job cannot go on", call, std::string(text, len)));
}

int count_of(std::size_t n) {
  DTRAIN_CHECK(n <= static_cast<std::size_t>(INT_MAX), fmt::format("{} floats are more than one MPI message carries", n));
  return static_cast<int>(n);
}

// Polls, first yielding (a reply is usually close), then sleeping: ranks share few cores.
class Poll {
 public:
  explicit Poll(double seconds) : start_(Clock::now()), limit_(seconds) {}
  bool expired() const { return std::chrono::duration<double>(Clock::now() - start_).count() > limit_; }
  void pause() const {
    if (Clock::now() - start_ < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

 private:
  Clock::time_point start_;
  double limit_;
};

// Waits for the requests; false (leaving them pending) when the time runs out first.
bool wait_for(MPI_Request* requests, int count, double seconds) {
  Poll poll(seconds);
  for (;;) {
    int done = 0;
    check(MPI_Testall(count, requests, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done) return true;
    if (poll.expired()) return false;
    poll.pause();
  }
}

}  // namespace

struct PsTransport::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  bool peer_lost = false;
  // A server's replies still travelling (a reply to a dead worker never completes: it stays here).
  struct Outgoing {
    MPI_Request request[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    std::int64_t header[4] = {0, 0, 0, 0};
    std::vector<float> data;
  };
  std::list<Outgoing> outgoing;

  void reap() {
    for (auto it = outgoing.begin(); it != outgoing.end();) {
      int done = 0;
      check(MPI_Testall(2, it->request, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
      it = done ? outgoing.erase(it) : std::next(it);
    }
  }
  void reply(int to, std::int64_t a, std::int64_t b, std::vector<float>* data) {
    Outgoing& o = outgoing.emplace_back();
    o.header[0] = a;
    o.header[1] = b;
    check(MPI_Isend(o.header, 2, MPI_INT64_T, to, kReplyTag, comm, &o.request[0]), "MPI_Isend");
    if (data) {
      o.data.swap(*data);
      check(MPI_Isend(o.data.data(), count_of(o.data.size()), MPI_FLOAT, to, kValuesTag, comm, &o.request[1]),
            "MPI_Isend");
    }
  }
  // A request's reply: the header, then (values != null) the floats, of a size known or probed.
  std::int64_t await_reply(int from, std::int64_t* second, std::span<float> values, std::vector<float>* sized,
                           double seconds, const char* what) {
    std::int64_t header[2] = {0, 0};
    MPI_Request req;
    check(MPI_Irecv(header, 2, MPI_INT64_T, from, kReplyTag, comm, &req), "MPI_Irecv");
    if (!wait_for(&req, 1, seconds)) {
      MPI_Cancel(&req);
      peer_lost = true;
      throw ServerLost(from, fmt::format("parameter server rank {} did not answer a {} within {:g} s: it is lost, and "
                                         "the job cannot go on without its variables",
                                         from, what, seconds));
    }
    if (second) *second = header[1];
    if (sized) {
      Poll poll(seconds);
      MPI_Status status;
      for (;;) {
        int flag = 0;
        check(MPI_Iprobe(from, kValuesTag, comm, &flag, &status), "MPI_Iprobe");
        if (flag) break;
        if (poll.expired()) {
          peer_lost = true;
          throw ServerLost(from, fmt::format("parameter server rank {} did not send its {} within {:g} s", from, what, seconds));
        }
        poll.pause();
      }
      int n = 0;
      check(MPI_Get_count(&status, MPI_FLOAT, &n), "MPI_Get_count");
      sized->resize(static_cast<std::size_t>(n));
      values = *sized;
    }
    if (!values.empty() || sized) {
      MPI_Request vreq;
      check(MPI_Irecv(values.data(), count_of(values.size()), MPI_FLOAT, from, kValuesTag, comm, &vreq), "MPI_Irecv");
      if (!wait_for(&vreq, 1, seconds)) {
        MPI_Cancel(&vreq);
        peer_lost = true;
        throw ServerLost(from, fmt::format("parameter server rank {} did not send its {} within {:g} s", from, what, seconds));
      }
    }
    return header[0];
  }
  // A few integers to `to`, without waiting: over TCP a send to a dead rank never completes (and
  // a blocking one would hang the coordinator), so it stays in `outgoing`.
  void post(int to, int tag, std::initializer_list<std::int64_t> values) {
    reap();
    Outgoing& o = outgoing.emplace_back();
    DTRAIN_CHECK(values.size() <= std::size(o.header), fmt::format("a message of {} integers", values.size()));
    std::copy(values.begin(), values.end(), o.header);
    check(MPI_Isend(o.header, static_cast<int>(values.size()), MPI_INT64_T, to, tag, comm, &o.request[0]), "MPI_Isend");
  }
  void request(int to, std::int64_t kind, std::int64_t version) { post(to, kRequestTag, {kind, version}); }

  // A server's push whose gradients have not all arrived.
  struct Push {
    int from = 0;
    std::int64_t read_version = 0;
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<float> gradients;
    Clock::time_point since;
  };
  // Pushes given up on. A receive that had started already cannot be cancelled and may still
  // complete (a sender late rather than dead): its buffer is kept while the transport lives.
  std::list<Push> abandoned;
  void abandon(Push&& push) {
    MPI_Cancel(&push.request);
    int done = 0;
    if (MPI_Test(&push.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) return;
    abandoned.push_back(std::move(push));
  }
};

PsTransport::PsTransport(double timeout_seconds) : impl_(std::make_unique<Impl>()), timeout_(timeout_seconds) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized)
    throw ConfigError("strategy kind parameter_server runs as an MPI job: start it with mpirun -n (1 + ps + workers)");
  check(MPI_Comm_dup(MPI_COMM_WORLD, &impl_->comm), "MPI_Comm_dup");
  // Errors come back as codes: a lost worker must not take the coordinator with it.
  check(MPI_Comm_set_errhandler(impl_->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_rank(impl_->comm, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(impl_->comm, &size_), "MPI_Comm_size");
}

// The communicator is not freed: freeing is collective, and a lost rank would never take part.
// MPI_Finalize releases it, or the process ends without it after a lost rank (peer_lost()).
PsTransport::~PsTransport() = default;

void PsTransport::mark_peer_lost() { impl_->peer_lost = true; }
bool PsTransport::peer_lost() const { return impl_->peer_lost; }

void PsTransport::send_order(int worker_rank, const StepOrder& order) {
  impl_->post(worker_rank, kOrderTag, {order.kind, order.global_step, order.epoch, order.epoch_first_step});
}

std::optional<StepResultMessage> PsTransport::poll_result() {
  impl_->reap();
  Poll poll(0.05);
  for (;;) {
    int flag = 0;
    MPI_Status status;
    check(MPI_Iprobe(MPI_ANY_SOURCE, kResultTag, impl_->comm, &flag, &status), "MPI_Iprobe");
    if (flag) {
      int n = 0;
      check(MPI_Get_count(&status, MPI_DOUBLE, &n), "MPI_Get_count");
      StepResultMessage m;
      m.worker_rank = status.MPI_SOURCE;
      m.payload.resize(static_cast<std::size_t>(n));
      check(MPI_Recv(m.payload.data(), n, MPI_DOUBLE, status.MPI_SOURCE, kResultTag, impl_->comm, MPI_STATUS_IGNORE),
            "MPI_Recv");
      return m;
    }
    if (poll.expired()) return std::nullopt;
    poll.pause();
  }
}

std::int64_t PsTransport::gather(int server_rank, std::vector<float>& state) {
  impl_->request(server_rank, gather_request, 0);
  std::int64_t iterations = 0;
  impl_->await_reply(server_rank, &iterations, {}, &state, server_timeout(), "gather");
  return iterations;
}

void PsTransport::stop_server(int server_rank) {
  impl_->post(server_rank, kRequestTag, {stop_request, impl_->peer_lost ? 1 : 0});
}

bool PsTransport::server_answers(int server_rank) {
  impl_->request(server_rank, roll_call_request, 0);
  try {
    impl_->await_reply(server_rank, nullptr, {}, nullptr, server_timeout(), "roll call");
  } catch (const ServerLost&) {
    return false;  // await_reply noted the loss
  }
  return true;
}

StepOrder PsTransport::receive_order() {
  std::int64_t o[4] = {0, 0, 0, 0};
  MPI_Request req;
  check(MPI_Irecv(o, 4, MPI_INT64_T, 0, kOrderTag, impl_->comm, &req), "MPI_Irecv");
  if (!wait_for(&req, 1, coordinator_timeout())) {
    MPI_Cancel(&req);
    impl_->peer_lost = true;
    // The app names this rank in front of the message.
    throw PeerLostError(fmt::format("no order from the coordinator (rank 0) for {:g} s: it is lost", coordinator_timeout()));
  }
  if (o[0] == StepOrder::stop_after_loss) {
    impl_->peer_lost = true;
    o[0] = StepOrder::stop;
  }
  return StepOrder{o[0], o[1], o[2], o[3]};
}

void PsTransport::send_result(std::span<const double> payload, double seconds) {
  MPI_Request req;
  check(MPI_Isend(payload.data(), count_of(payload.size()), MPI_DOUBLE, 0, kResultTag, impl_->comm, &req), "MPI_Isend");
  if (!wait_for(&req, 1, seconds)) {
    impl_->peer_lost = true;
    throw PeerLostError(fmt::format("the coordinator (rank 0) did not take a step's result within {:g} s: it is lost",
                                    seconds));
  }
}

std::int64_t PsTransport::pull(int server_rank, std::span<float> values, bool* server_asked_to_stop) {
  impl_->request(server_rank, pull_request, 0);
  std::int64_t stop = 0;
  const std::int64_t version = impl_->await_reply(server_rank, &stop, values, nullptr, server_timeout(), "pull");
  if (server_asked_to_stop) *server_asked_to_stop = stop != 0;
  return version;
}

std::int64_t PsTransport::push(int server_rank, std::int64_t read_version, std::span<const float> gradients) {
  impl_->request(server_rank, push_request, read_version);
  MPI_Request req;
  check(MPI_Isend(gradients.data(), count_of(gradients.size()), MPI_FLOAT, server_rank, kPushDataTag, impl_->comm, &req),
        "MPI_Isend");
  std::int64_t staleness = 0;
  impl_->await_reply(server_rank, &staleness, {}, nullptr, server_timeout(), "push");
  // The server answers only once it has the gradients, so the send has completed.
  check(MPI_Wait(&req, MPI_STATUS_IGNORE), "MPI_Wait");
  return staleness;
}

void PsTransport::serve(const ServerHandlers& handlers, std::size_t gradient_floats) {
  std::int64_t version = 0;
  // Pushes whose gradients are still on their way: at most one per worker, which waits for the
  // answer before it sends this server anything else. The server goes on answering the others
  // meanwhile: waiting here for a worker that died between its request and its gradients would
  // keep the others waiting, and they give up on a server after server_timeout() (T / 2), which
  // would name a healthy server lost.
  std::list<Impl::Push> pushes;
  std::vector<std::vector<float>> spare;  // the buffers of applied pushes, for the next ones
  Poll idle(coordinator_timeout());
  for (;;) {
    impl_->reap();
    bool applied = false;
    for (auto it = pushes.begin(); it != pushes.end();) {
      int done = 0;
      // An error (the sender died while sending) drops the push like a timeout: it is that
      // worker's failure, not this server's.
      const bool failed = MPI_Test(&it->request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS;
      if (!failed && done) {
        handlers.apply(it->gradients);
        impl_->reply(it->from, version + 1, version - it->read_version, nullptr);
        ++version;
        spare.push_back(std::move(it->gradients));
        it = pushes.erase(it);
        applied = true;
      } else if (failed || std::chrono::duration<double>(Clock::now() - it->since).count() > timeout_) {
        // Only its worker waits for it, and after T the coordinator has given that worker's
        // steps to the others.
        impl_->abandon(std::move(*it));
        it = pushes.erase(it);
      } else {
        ++it;
      }
    }
    int flag = 0;
    MPI_Status status;
    check(MPI_Iprobe(MPI_ANY_SOURCE, kRequestTag, impl_->comm, &flag, &status), "MPI_Iprobe");
    if (!flag) {
      if (applied) continue;
      if (idle.expired()) {
        impl_->peer_lost = true;
        throw PeerLostError(fmt::format("this parameter server had no request for {:g} s: the coordinator (rank 0) is lost",
                                        coordinator_timeout()));
      }
      idle.pause();
      continue;
    }
    idle = Poll(coordinator_timeout());
    std::int64_t r[2] = {0, 0};
    const int from = status.MPI_SOURCE;
    check(MPI_Recv(r, 2, MPI_INT64_T, from, kRequestTag, impl_->comm, MPI_STATUS_IGNORE), "MPI_Recv");
    switch (r[0]) {
      case pull_request: {
        std::vector<float> values;
        handlers.values(values);
        impl_->reply(from, version, handlers.stop_requested && handlers.stop_requested() ? 1 : 0, &values);
        break;
      }
      case push_request: {
        Impl::Push& push = pushes.emplace_back();
        push.from = from;
        push.read_version = r[1];
        push.since = Clock::now();
        if (spare.empty()) {
          push.gradients.resize(gradient_floats);
        } else {
          push.gradients = std::move(spare.back());
          spare.pop_back();
        }
        check(MPI_Irecv(push.gradients.data(), count_of(gradient_floats), MPI_FLOAT, from, kPushDataTag, impl_->comm,
                        &push.request),
              "MPI_Irecv");
        break;
      }
      case gather_request: {
        std::vector<float> state;
        const std::int64_t iterations = handlers.state(state);
        impl_->reply(from, version, iterations, &state);
        break;
      }
      case roll_call_request: impl_->reply(from, version, 0, nullptr); break;
      case stop_request: {
        if (r[1] != 0) impl_->peer_lost = true;
        // The chief's last message: every step has been answered, unless the job is failing.
        for (Impl::Push& push : pushes) impl_->abandon(std::move(push));
        // Replies still travelling to live ranks finish first (those to a lost worker never do).
        Poll drain(std::min(timeout_, 2.0));
        while (!impl_->outgoing.empty() && !drain.expired()) {
          impl_->reap();
          drain.pause();
        }
        return;
      }
      default: throw InternalError(fmt::format("parameter server rank {}: unknown request {} from rank {}", rank_, r[0], from));
    }
  }
}

}  // namespace dtrain::distribute
