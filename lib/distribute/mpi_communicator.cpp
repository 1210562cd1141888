#include "distribute/mpi_communicator.hpp"

#include <mpi.h>

#include <chrono>
#include <csignal>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"
#include "distribute/agreement.hpp"

namespace dtrain::distribute {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kCensusRequestTag = 7001;
constexpr int kCensusReplyTag = 7002;
constexpr int kAbortNoticeTag = 7003;
constexpr int kTrainingDoneTag = 7004;
constexpr int kRingTag = 7100;
constexpr int kNoticeBytes = 1024;

// Where a rank is: its global step and how many collectives it has entered.
struct Position {
  std::int64_t step;
  std::uint64_t collective;
};

std::string error_string(int rc) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return fmt::format("MPI error code {}", rc);
  return std::string(text, static_cast<std::size_t>(len));
}

// MPI counts are ints.
int mpi_count(std::size_t n, const char* what) {
  DTRAIN_CHECK(n <= static_cast<std::size_t>(INT_MAX),
               fmt::format("{}: {} elements are more than one MPI message can carry", what, n));
  return static_cast<int>(n);
}

}  // namespace

struct MpiCommunicator::Comm {
  MPI_Comm handle = MPI_COMM_NULL;
};

bool MpiCommunicator::launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"})
    if (std::getenv(var)) return true;
  return false;
}

MpiCommunicator::MpiCommunicator() : comm_(std::make_unique<Comm>()) {
  int provided = 0;
  // Until MPI_ERRORS_RETURN is set below, a failure here ends the process with MPI's message.
  succeeded(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread", Failure::raise);
  if (provided < MPI_THREAD_SERIALIZED)
    throw InternalError("the MPI library does not support MPI_THREAD_SERIALIZED, which dtrain needs; use an MPI built "
                        "with thread support (Debian's OpenMPI has it)");
  // Errors come back as return codes so that they can be reported instead of MPI aborting.
  succeeded(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", Failure::raise);
  succeeded(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank", Failure::raise);
  succeeded(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size", Failure::raise);
  world_rank_ = rank_;
  world_size_ = size_;
  comm_->handle = MPI_COMM_WORLD;
  // OpenMPI's TCP transport writes to its peers' sockets with plain writev(): once a peer process
  // has died, a write racing the connection's reset raises SIGPIPE, whose default action ends this
  // process without a word (seen: a parameter-server coordinator killed while its worker's host
  // went down). Ignored, the write fails with EPIPE, and the transport reports the peer lost,
  // which the strategies handle.
  std::signal(SIGPIPE, SIG_IGN);
  learn_hosts();
}

void MpiCommunicator::learn_hosts() {
  char mine[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  succeeded(MPI_Get_processor_name(mine, &len), "MPI_Get_processor_name", Failure::raise);
  std::vector<char> all(static_cast<std::size_t>(size_) * MPI_MAX_PROCESSOR_NAME);
  succeeded(MPI_Allgather(mine, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
                          comm_->handle),
            "MPI_Allgather", Failure::raise);
  hosts_.clear();
  bool several = false;
  for (int r = 0; r < size_; ++r) {
    const char* name = all.data() + static_cast<std::size_t>(r) * MPI_MAX_PROCESSOR_NAME;
    hosts_.emplace_back(name, strnlen(name, MPI_MAX_PROCESSOR_NAME));
    several = several || hosts_.back() != hosts_.front();
  }
  if (!several) hosts_.clear();
}

MpiCommunicator::~MpiCommunicator() {
  // Best effort: a destructor cannot report, and the job is ending anyway.
  if (comm_->handle != MPI_COMM_WORLD && comm_->handle != MPI_COMM_NULL) MPI_Comm_free(&comm_->handle);
  MPI_Finalize();
}

bool MpiCommunicator::succeeded(int rc, const char* call, Failure failure) const {
  if (rc == MPI_SUCCESS) return true;
  if (failure == Failure::ignore) return false;
  throw InternalError(fmt::format("{} failed on rank {} of {}: {}; the MPI job cannot go on (a rank may have died or the "
                                  "connection between the ranks failed: see mpirun's messages)",
                                  call, world_rank_, world_size_, error_string(rc)));
}

std::optional<RolePlan> MpiCommunicator::assign_roles(const config::RolesConfig& roles, const char* tf_config) {
  // Each rank resolves its roles (TF_CONFIG is its own), and they agree on whether that failed
  // before the split, which every rank must join: one report and no abort where the roles do not
  // fit the world, each rank's own where only its TF_CONFIG is wrong.
  std::optional<RolePlan> plan;
  agree_on_every_worker(*this, "assigning the roles",
                        [&] { plan = resolve_roles(roles, tf_config, world_size_, world_rank_); });
  // Each rank's TF_CONFIG may pass its own checks and still describe another job than the others'
  // (the ranks would split into other groups, and wait for ever): they must all see one plan.
  if (!same_on_every_worker(*this, plan->describe(), "the roles"))
    throw JobConfigError(fmt::format("the ranks' {} describe different jobs (rank 0's: {}); give every rank the "
                                     "same cluster",
                                     plan->source, plan->describe()));
  split(plan->role_of(world_rank_) != Role::evaluator);
  return plan;
}

void MpiCommunicator::split(bool trains) {
  MPI_Comm group = MPI_COMM_NULL;
  // Collective over the world: every rank calls it once, before any collective of its group.
  succeeded(MPI_Comm_split(MPI_COMM_WORLD, trains ? 0 : 1, world_rank_, &group), "MPI_Comm_split", Failure::raise);
  comm_->handle = group;
  succeeded(MPI_Comm_set_errhandler(group, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler", Failure::raise);
  succeeded(MPI_Comm_rank(group, &rank_), "MPI_Comm_rank", Failure::raise);
  succeeded(MPI_Comm_size(group, &size_), "MPI_Comm_size", Failure::raise);
  learn_hosts();
}

void MpiCommunicator::send_training_done(int world_rank) {
  int done = rank_lost() ? 2 : 1;
  // Buffered by MPI (one int), so the chief never waits for an evaluator busy evaluating.
  MPI_Request request;
  succeeded(MPI_Isend(&done, 1, MPI_INT, world_rank, kTrainingDoneTag, MPI_COMM_WORLD, &request), "MPI_Isend",
            Failure::raise);
  succeeded(MPI_Wait(&request, MPI_STATUS_IGNORE), "MPI_Wait", Failure::raise);
}

bool MpiCommunicator::training_done() {
  int pending = 0;
  MPI_Status status;
  succeeded(MPI_Iprobe(MPI_ANY_SOURCE, kTrainingDoneTag, MPI_COMM_WORLD, &pending, &status), "MPI_Iprobe",
            Failure::raise);
  if (!pending) return false;
  int done = 0;
  succeeded(MPI_Recv(&done, 1, MPI_INT, status.MPI_SOURCE, kTrainingDoneTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
            "MPI_Recv", Failure::raise);
  if (done == 2) note_rank_lost();
  return true;
}

void MpiCommunicator::answer_census(Failure failure) {
  int pending = 0;
  MPI_Status status;
  // Another rank timed out and is about to abort the job: say where this rank stands first.
  if (!succeeded(MPI_Iprobe(MPI_ANY_SOURCE, kAbortNoticeTag, comm_->handle, &pending, &status), "MPI_Iprobe", failure))
    return;
  if (pending) {
    char missing[kNoticeBytes] = {};
    if (succeeded(MPI_Recv(missing, kNoticeBytes, MPI_CHAR, status.MPI_SOURCE, kAbortNoticeTag, comm_->handle,
                           MPI_STATUS_IGNORE),
                  "MPI_Recv", failure)) {
      missing[kNoticeBytes - 1] = '\0';
      std::fprintf(stderr,
                   "dtrain: rank %d: at step %lld in collective #%llu when rank %d timed out; ranks that did not arrive: "
                   "%s; the job is aborted (exit code %d)\n",
                   rank_, static_cast<long long>(step_), static_cast<unsigned long long>(collective_), status.MPI_SOURCE,
                   missing, kCollectiveTimeoutExit);
      std::fflush(stderr);
      before_watchdog_abort(kCollectiveTimeoutExit);
    }
  }
  if (!succeeded(MPI_Iprobe(MPI_ANY_SOURCE, kCensusRequestTag, comm_->handle, &pending, &status), "MPI_Iprobe", failure))
    return;
  while (pending) {
    int dummy = 0;
    if (!succeeded(MPI_Recv(&dummy, 1, MPI_INT, status.MPI_SOURCE, kCensusRequestTag, comm_->handle, MPI_STATUS_IGNORE),
                   "MPI_Recv", failure))
      return;
    Position here{step_, collective_};
    if (!succeeded(MPI_Send(&here, sizeof here, MPI_BYTE, status.MPI_SOURCE, kCensusReplyTag, comm_->handle), "MPI_Send",
                   failure))
      return;
    if (!succeeded(MPI_Iprobe(MPI_ANY_SOURCE, kCensusRequestTag, comm_->handle, &pending, &status), "MPI_Iprobe",
                   failure))
      return;
  }
}

// The abort sequence: every MPI call here is best effort (a failure only means less is reported),
// since the job ends with MPI_Abort whatever happens.
void MpiCommunicator::report_timeout(const char* what) {
  before_watchdog_abort(kCollectiveTimeoutExit);  // first: another rank's abort may end this one any time now
  // Ask every other rank where it is; the live ones answer from their own wait loops. A rank that
  // does not answer within a few seconds is dead or stuck outside a collective.
  std::vector<MPI_Request> requests;
  int dummy = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    requests.emplace_back();
    if (MPI_Isend(&dummy, 1, MPI_INT, r, kCensusRequestTag, comm_->handle, &requests.back()) != MPI_SUCCESS)
      requests.pop_back();
  }
  std::vector<bool> answered(static_cast<std::size_t>(size_), false);
  std::vector<Position> where(static_cast<std::size_t>(size_), Position{-1, 0});
  answered[static_cast<std::size_t>(rank_)] = true;
  where[static_cast<std::size_t>(rank_)] = Position{step_, collective_};
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  while (Clock::now() < deadline) {
    answer_census(Failure::ignore);
    int flag = 0;
    MPI_Status status;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kCensusReplyTag, comm_->handle, &flag, &status) == MPI_SUCCESS && flag) {
      Position p{};
      if (MPI_Recv(&p, sizeof p, MPI_BYTE, status.MPI_SOURCE, kCensusReplyTag, comm_->handle, MPI_STATUS_IGNORE) ==
          MPI_SUCCESS) {
        answered[static_cast<std::size_t>(status.MPI_SOURCE)] = true;
        where[static_cast<std::size_t>(status.MPI_SOURCE)] = p;
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  std::string missing;
  // Across hosts each rank is named with its host: "rank 2 on host b (no answer: ...)".
  const auto on_host = [&](std::size_t i) { return hosts_.empty() ? std::string() : " on host " + hosts_[i]; };
  for (int r = 0; r < size_; ++r) {
    const auto i = static_cast<std::size_t>(r);
    if (!answered[i]) {
      missing += fmt::format("{}rank {}{} (no answer: dead, or stuck outside a collective)", missing.empty() ? "" : ", ",
                             r, on_host(i));
    } else if (where[i].collective < collective_) {
      missing += fmt::format("{}rank {}{} (at step {}, collective #{})", missing.empty() ? "" : ", ", r, on_host(i),
                             where[i].step, where[i].collective);
    }
  }
  std::fprintf(stderr,
               "dtrain: rank %d: collective '%s' (#%llu) at step %lld did not complete within %.0f s; ranks that did not "
               "arrive: %s; aborting the job (exit code %d)\n",
               rank_, what, static_cast<unsigned long long>(collective_), static_cast<long long>(step_), timeout_seconds_,
               missing.empty() ? "none identified" : missing.c_str(), kCollectiveTimeoutExit);
  std::fflush(stderr);
  // Let the live ranks print their view before the abort ends them.
  char notice[kNoticeBytes] = {};
  std::snprintf(notice, sizeof notice, "%s", missing.empty() ? "none identified" : missing.c_str());
  std::vector<MPI_Request> notices;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || !answered[static_cast<std::size_t>(r)]) continue;
    notices.emplace_back();
    if (MPI_Isend(notice, kNoticeBytes, MPI_CHAR, r, kAbortNoticeTag, comm_->handle, &notices.back()) != MPI_SUCCESS)
      notices.pop_back();
  }
  const auto grace = Clock::now() + std::chrono::seconds(1);
  while (Clock::now() < grace) {
    answer_census(Failure::ignore);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  MPI_Abort(MPI_COMM_WORLD, kCollectiveTimeoutExit);
  std::_Exit(kCollectiveTimeoutExit);
}

void MpiCommunicator::wait(void* requests, int count, const char* what) {
  auto* req = static_cast<MPI_Request*>(requests);
  const auto start = Clock::now();
  const auto limit = std::chrono::duration<double>(timeout_seconds_);
  int done = 0;
  for (;;) {
    succeeded(MPI_Testall(count, req, &done, MPI_STATUSES_IGNORE), "MPI_Testall", Failure::raise);
    if (done) return;
    answer_census(Failure::raise);
    if (Clock::now() - start > limit) report_timeout(what);
    // OpenMPI moves a non-blocking collective forward only inside MPI calls, so the polls must
    // follow each other closely: sleeping between them made a 2-rank step 20% slower. Yielding
    // instead gives the core to whatever else is runnable there (backward, when overlapped;
    // other ranks, when oversubscribed) and polls again at once when nothing is. A long wait
    // (a slow or lost rank) then backs off to sleeps.
    if (yield_while_waiting_.load(std::memory_order_relaxed) || Clock::now() - start < std::chrono::milliseconds(20)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

void MpiCommunicator::reduce(void* data, std::size_t count, Element element, bool max, int root, const char* what) {
  if (size_ == 1) return;
  ++collective_;
  const MPI_Datatype type = element == Element::f32   ? MPI_FLOAT
                            : element == Element::f64 ? MPI_DOUBLE
                            : element == Element::i64 ? MPI_INT64_T
                                                      : MPI_INT;
  const int n = mpi_count(count, what);
  MPI_Request req;
  if (root < 0) {
    succeeded(MPI_Iallreduce(MPI_IN_PLACE, data, n, type, max ? MPI_MAX : MPI_SUM, comm_->handle, &req),
              "MPI_Iallreduce", Failure::raise);
  } else {
    // The root sums in place; the others only send, so their values stay as they are.
    succeeded(MPI_Ireduce(root == rank_ ? MPI_IN_PLACE : data, root == rank_ ? data : nullptr, n, type,
                          max ? MPI_MAX : MPI_SUM, root, comm_->handle, &req),
              "MPI_Ireduce", Failure::raise);
  }
  wait(&req, 1, what);
}

void MpiCommunicator::all_reduce_sum(std::span<float> values, const char* what) {
  reduce(values.data(), values.size(), Element::f32, false, -1, what);
}

void MpiCommunicator::all_reduce_sum(std::span<double> values, const char* what) {
  reduce(values.data(), values.size(), Element::f64, false, -1, what);
}

void MpiCommunicator::all_reduce_sum(std::span<std::int64_t> values, const char* what) {
  reduce(values.data(), values.size(), Element::i64, false, -1, what);
}

int MpiCommunicator::all_reduce_max(int value, const char* what) {
  reduce(&value, 1, Element::i32, true, -1, what);
  return value;
}

void MpiCommunicator::reduce_sum_to(std::span<float> values, int root, const char* what) {
  DTRAIN_CHECK(root >= 0 && root < size_, fmt::format("{}: root {} is outside the {} ranks", what, root, size_));
  reduce(values.data(), values.size(), Element::f32, false, root, what);
}

void MpiCommunicator::broadcast(void* data, std::size_t count, Element element, int root, const char* what) {
  DTRAIN_CHECK(root >= 0 && root < size_, fmt::format("{}: root {} is outside the {} ranks", what, root, size_));
  if (size_ == 1) return;
  ++collective_;
  const MPI_Datatype type = element == Element::f32 ? MPI_FLOAT : MPI_DOUBLE;
  MPI_Request req;
  succeeded(MPI_Ibcast(data, mpi_count(count, what), type, root, comm_->handle, &req), "MPI_Ibcast", Failure::raise);
  wait(&req, 1, what);
}

void MpiCommunicator::broadcast(std::span<float> values, int root, const char* what) {
  broadcast(values.data(), values.size(), Element::f32, root, what);
}

void MpiCommunicator::broadcast(std::span<double> values, int root, const char* what) {
  broadcast(values.data(), values.size(), Element::f64, root, what);
}

void MpiCommunicator::open(std::span<float> values, const char* what) {
  ++collective_;
  mpi_count(values.size(), what);
  ring_scratch_.resize(values.size() / static_cast<std::size_t>(size_) + 1);  // grows once, to the largest chunk
}

void MpiCommunicator::exchange(std::span<float> values, RingChunk send, RingChunk recv, bool accumulate,
                               const char* what) {
  const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
  float* into = accumulate ? ring_scratch_.data() : values.data() + recv.begin;
  MPI_Request reqs[2];
  succeeded(MPI_Irecv(into, static_cast<int>(recv.size()), MPI_FLOAT, left, kRingTag, comm_->handle, &reqs[0]),
            "MPI_Irecv", Failure::raise);
  succeeded(MPI_Isend(values.data() + send.begin, static_cast<int>(send.size()), MPI_FLOAT, right, kRingTag,
                      comm_->handle, &reqs[1]),
            "MPI_Isend", Failure::raise);
  wait(reqs, 2, what);
  if (!accumulate) return;
  float* own = values.data() + recv.begin;
  for (std::size_t i = 0; i < recv.size(); ++i) own[i] += ring_scratch_[i];
}

void MpiCommunicator::end_job(int exit_code) {
  MPI_Abort(MPI_COMM_WORLD, exit_code);  // best effort: abort() ends this process whatever it returns
}

}  // namespace dtrain::distribute
