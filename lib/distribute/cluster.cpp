#include "distribute/cluster.hpp"

#include <mpi.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::distribute {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kCensusRequestTag = 7001;
constexpr int kCensusReplyTag = 7002;
constexpr int kAbortNoticeTag = 7003;
constexpr int kTrainingDoneTag = 7004;
constexpr int kNoticeBytes = 1024;

// Where a rank is: its global step and how many collectives it has entered.
struct Position {
  std::int64_t step;
  std::uint64_t collective;
};

void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    throw InternalError(fmt::format("{} failed: {}", call, std::string(text, static_cast<std::size_t>(len))));
  }
}

}  // namespace

struct Cluster::Comm {
  MPI_Comm handle = MPI_COMM_NULL;
};

bool Cluster::launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"})
    if (std::getenv(var)) return true;
  return false;
}

Cluster::Cluster() : comm_(std::make_unique<Comm>()) {
  if (!launched_by_mpi()) return;
  int provided = 0;
  // Collectives are made by one thread at a time (the main thread, or replica 0's thread).
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
  if (provided < MPI_THREAD_SERIALIZED)
    throw InternalError("the MPI library does not support MPI_THREAD_SERIALIZED, which dtrain needs");
  // Errors come back as return codes so the watchdog can report them instead of MPI aborting.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  world_rank_ = rank_;
  world_size_ = size_;
  comm_->handle = MPI_COMM_WORLD;
  mpi_ = true;
}

Cluster::~Cluster() {
  if (!mpi_) return;
  if (comm_->handle != MPI_COMM_WORLD) MPI_Comm_free(&comm_->handle);
  MPI_Finalize();
}

void Cluster::split(bool trains) {
  if (!mpi_) return;
  MPI_Comm group = MPI_COMM_NULL;
  // Collective over the world: every rank calls it once, before any collective of its group.
  check(MPI_Comm_split(MPI_COMM_WORLD, trains ? 0 : 1, world_rank_, &group), "MPI_Comm_split");
  MPI_Comm_set_errhandler(group, MPI_ERRORS_RETURN);
  comm_->handle = group;
  MPI_Comm_rank(group, &rank_);
  MPI_Comm_size(group, &size_);
}

void Cluster::send_training_done(int world_rank) {
  if (!mpi_) return;
  int done = 1;
  // Buffered by MPI (one int), so the chief never waits for an evaluator busy evaluating.
  MPI_Request request;
  check(MPI_Isend(&done, 1, MPI_INT, world_rank, kTrainingDoneTag, MPI_COMM_WORLD, &request), "MPI_Isend");
  check(MPI_Wait(&request, MPI_STATUS_IGNORE), "MPI_Wait");
}

bool Cluster::training_done() {
  if (!mpi_) return true;
  int pending = 0;
  MPI_Status status;
  MPI_Iprobe(MPI_ANY_SOURCE, kTrainingDoneTag, MPI_COMM_WORLD, &pending, &status);
  if (!pending) return false;
  int done = 0;
  MPI_Recv(&done, 1, MPI_INT, status.MPI_SOURCE, kTrainingDoneTag, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
  return true;
}

void Cluster::answer_census() {
  int pending = 0;
  MPI_Status status;
  // Another rank timed out and is about to abort the job: say where this rank stands first.
  MPI_Iprobe(MPI_ANY_SOURCE, kAbortNoticeTag, comm_->handle, &pending, &status);
  if (pending) {
    char missing[kNoticeBytes] = {};
    MPI_Recv(missing, kNoticeBytes, MPI_CHAR, status.MPI_SOURCE, kAbortNoticeTag, comm_->handle, MPI_STATUS_IGNORE);
    missing[kNoticeBytes - 1] = '\0';
    std::fprintf(stderr,
                 "dtrain: rank %d: at step %lld in collective #%llu when rank %d timed out; ranks that did not arrive: %s; "
                 "the job is aborted (exit code %d)\n",
                 rank_, static_cast<long long>(step_), static_cast<unsigned long long>(collective_), status.MPI_SOURCE,
                 missing, kCollectiveTimeoutExit);
    std::fflush(stderr);
  }
  MPI_Iprobe(MPI_ANY_SOURCE, kCensusRequestTag, comm_->handle, &pending, &status);
  while (pending) {
    int dummy = 0;
    MPI_Recv(&dummy, 1, MPI_INT, status.MPI_SOURCE, kCensusRequestTag, comm_->handle, MPI_STATUS_IGNORE);
    Position here{step_, collective_};
    MPI_Send(&here, sizeof here, MPI_BYTE, status.MPI_SOURCE, kCensusReplyTag, comm_->handle);
    MPI_Iprobe(MPI_ANY_SOURCE, kCensusRequestTag, comm_->handle, &pending, &status);
  }
}

void Cluster::report_timeout(const char* what) {
  // Ask every other rank where it is; the live ones answer from their own wait loops. A rank that
  // does not answer within a few seconds is dead or stuck outside a collective.
  std::vector<MPI_Request> requests;
  int dummy = 0;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    requests.emplace_back();
    MPI_Isend(&dummy, 1, MPI_INT, r, kCensusRequestTag, comm_->handle, &requests.back());
  }
  std::vector<bool> answered(static_cast<std::size_t>(size_), false);
  std::vector<Position> where(static_cast<std::size_t>(size_), Position{-1, 0});
  answered[static_cast<std::size_t>(rank_)] = true;
  where[static_cast<std::size_t>(rank_)] = Position{step_, collective_};
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  while (Clock::now() < deadline) {
    answer_census();
    int flag = 0;
    MPI_Status status;
    MPI_Iprobe(MPI_ANY_SOURCE, kCensusReplyTag, comm_->handle, &flag, &status);
    if (flag) {
      Position p{};
      MPI_Recv(&p, sizeof p, MPI_BYTE, status.MPI_SOURCE, kCensusReplyTag, comm_->handle, MPI_STATUS_IGNORE);
      answered[static_cast<std::size_t>(status.MPI_SOURCE)] = true;
      where[static_cast<std::size_t>(status.MPI_SOURCE)] = p;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  std::string missing;
  for (int r = 0; r < size_; ++r) {
    const auto i = static_cast<std::size_t>(r);
    if (!answered[i]) {
      missing += fmt::format("{}rank {} (no answer: dead, or stuck outside a collective)", missing.empty() ? "" : ", ", r);
    } else if (where[i].collective < collective_) {
      missing += fmt::format("{}rank {} (at step {}, collective #{})", missing.empty() ? "" : ", ", r, where[i].step,
                             where[i].collective);
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
    MPI_Isend(notice, kNoticeBytes, MPI_CHAR, r, kAbortNoticeTag, comm_->handle, &notices.back());
  }
  const auto grace = Clock::now() + std::chrono::seconds(1);
  while (Clock::now() < grace) {
    answer_census();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  MPI_Abort(MPI_COMM_WORLD, kCollectiveTimeoutExit);
  std::_Exit(kCollectiveTimeoutExit);
}

void Cluster::wait(void* requests, int count, const char* what) {
  auto* req = static_cast<MPI_Request*>(requests);
  const auto start = Clock::now();
  const auto limit = std::chrono::duration<double>(timeout_seconds_);
  int done = 0;
  for (;;) {
    check(MPI_Testall(count, req, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done) return;
    answer_census();
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

void Cluster::all_reduce(void* data, int count, Element element, bool max, const char* what) {
  if (!mpi_ || size_ == 1) return;
  ++collective_;
  const MPI_Datatype type = element == Element::f32 ? MPI_FLOAT
                            : element == Element::f64 ? MPI_DOUBLE
                            : element == Element::i64 ? MPI_INT64_T
                                                      : MPI_INT;
  MPI_Request req;
  check(MPI_Iallreduce(MPI_IN_PLACE, data, count, type, max ? MPI_MAX : MPI_SUM, comm_->handle, &req), "MPI_Iallreduce");
  wait(&req, 1, what);
}

void Cluster::all_reduce_sum(std::span<float> values, const char* what) {
  all_reduce(values.data(), static_cast<int>(values.size()), Element::f32, false, what);
}

void Cluster::all_reduce_sum(std::span<double> values, const char* what) {
  all_reduce(values.data(), static_cast<int>(values.size()), Element::f64, false, what);
}

void Cluster::all_reduce_sum(std::span<std::int64_t> values, const char* what) {
  all_reduce(values.data(), static_cast<int>(values.size()), Element::i64, false, what);
}

int Cluster::all_reduce_max(int value, const char* what) {
  all_reduce(&value, 1, Element::i32, true, what);
  return value;
}

void Cluster::ring_all_reduce_sum(std::span<float> values, const char* what) {
  if (!mpi_ || size_ == 1) return;
  ++collective_;
  const std::size_t n = static_cast<std::size_t>(size_), total = values.size();
  auto chunk_begin = [&](std::size_t c) { return c * total / n; };
  auto chunk_size = [&](std::size_t c) { return static_cast<int>(chunk_begin(c + 1) - chunk_begin(c)); };
  ring_scratch_.resize(total / n + 1);
  const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
  const std::size_t r = static_cast<std::size_t>(rank_);
  constexpr int kRingTag = 7100;
  // Reduce-scatter: at step s send chunk (r - s) to the right, receive chunk (r - s - 1) from the
  // left and add it in; afterwards this rank holds the full sum of chunk (r + 1).
  for (std::size_t s = 0; s + 1 < n; ++s) {
    const std::size_t send = (r + n - s) % n, recv = (r + 2 * n - s - 1) % n;
    MPI_Request reqs[2];
    check(MPI_Irecv(ring_scratch_.data(), chunk_size(recv), MPI_FLOAT, left, kRingTag, comm_->handle, &reqs[0]), "MPI_Irecv");
    check(MPI_Isend(values.data() + chunk_begin(send), chunk_size(send), MPI_FLOAT, right, kRingTag, comm_->handle, &reqs[1]),
          "MPI_Isend");
    wait(reqs, 2, what);
    float* own = values.data() + chunk_begin(recv);
    for (int i = 0; i < chunk_size(recv); ++i) own[i] += ring_scratch_[static_cast<std::size_t>(i)];
  }
  // All-gather: at step s pass on the complete chunk (r + 1 - s), receive chunk (r - s).
  for (std::size_t s = 0; s + 1 < n; ++s) {
    const std::size_t send = (r + 1 + n - s) % n, recv = (r + n - s) % n;
    MPI_Request reqs[2];
    check(MPI_Irecv(values.data() + chunk_begin(recv), chunk_size(recv), MPI_FLOAT, left, kRingTag, comm_->handle, &reqs[0]),
          "MPI_Irecv");
    check(MPI_Isend(values.data() + chunk_begin(send), chunk_size(send), MPI_FLOAT, right, kRingTag, comm_->handle, &reqs[1]),
          "MPI_Isend");
    wait(reqs, 2, what);
  }
}

void Cluster::abort(int exit_code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (mpi_) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

void Cluster::barrier(const char* what) {
  if (!mpi_ || size_ == 1) return;
  ++collective_;
  MPI_Request req;
  check(MPI_Ibarrier(comm_->handle, &req), "MPI_Ibarrier");
  wait(&req, 1, what);
}

}  // namespace dtrain::distribute
