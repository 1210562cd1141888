#include "distribute/thread_group.hpp"

#include <algorithm>
#include <bit>

#include <fmt/format.h>

#include "core/error.hpp"
#include "device/gpu_module.hpp"
#include "dtrain/build_info.hpp"
#include "distribute/nccl_communicator.hpp"

namespace dtrain::distribute {

namespace {

// dst[i] += src[i]: the one addition every sum of the group is made of.
template <class T>
void add_into(std::span<T> dst, std::span<T> src) {
  for (std::size_t i = 0; i < dst.size(); ++i) dst[i] += src[i];
}

template <class T>
void copy_from(std::span<T> dst, std::span<T> src) {
  std::copy(src.begin(), src.end(), dst.begin());
}

constexpr auto kAdd = [](auto dst, auto src) { add_into(dst, src); };

int checked_size(int size) {
  DTRAIN_CHECK(size >= 1, fmt::format("a thread group needs at least one replica, got {}", size));
  return size;
}

}  // namespace

const char* name_of(CrossDeviceOp op) {
  switch (op) {
    case CrossDeviceOp::reduction_to_one_device: return "reduction_to_one_device";
    case CrossDeviceOp::hierarchical_copy: return "hierarchical_copy";
    case CrossDeviceOp::ring: return "ring";
    case CrossDeviceOp::nccl: return "nccl";
  }
  return "?";
}

CrossDeviceOp cross_device_op_named(const std::string& name) {
  for (CrossDeviceOp op : {CrossDeviceOp::reduction_to_one_device, CrossDeviceOp::hierarchical_copy, CrossDeviceOp::ring,
                           CrossDeviceOp::nccl})
    if (name == name_of(op)) return op;
  throw InternalError("unknown cross_device_ops '" + name +
                      "'; expected reduction_to_one_device, hierarchical_copy, ring or nccl (the strategy must resolve "
                      "'auto' before this)");
}

namespace {
// Written once as the CUDA module loads (by nccl_communicator.cpp where it is built), read-only
// afterwards.
NcclFactories& nccl_registry() {
  static NcclFactories factories;
  return factories;
}
}  // namespace

const NcclFactories* nccl() {
  // The communicators register when the CUDA module loads (or before main, where the backend is
  // linked in); the loader's once flag orders that registration before this read.
  if (build_info::have_nccl) (void)device::load_cuda_backend();
  return nccl_registry().local_gpus ? &nccl_registry() : nullptr;
}

std::string why_no_nccl() {
  if (!build_info::have_nccl)
    return "this build has no NCCL (CMake found no nccl.h and libnccl beside CUDA); rebuild where NCCL is installed";
  return device::load_cuda_backend();
}

bool register_nccl(const NcclFactories& factories) {
  DTRAIN_CHECK(!nccl_registry().local_gpus, "the NCCL communicators were registered twice");
  nccl_registry() = factories;
  return true;
}

std::unique_ptr<ReplicaGroup> make_replica_group(int size, CrossDeviceOp op) {
  return std::make_unique<ThreadGroup>(size, op);
}

std::unique_ptr<ReplicaGroup> make_replica_group(const std::vector<Device>& devices, CrossDeviceOp op) {
  if (op != CrossDeviceOp::nccl) return make_replica_group(static_cast<int>(devices.size()), op);
  DTRAIN_CHECK(nccl() != nullptr, "cross_device_ops nccl in a build without NCCL (the strategy must refuse it first)");
  return nccl()->local_gpus(devices);
}

ThreadGroup::ThreadGroup(int size, CrossDeviceOp op)
    : size_(checked_size(size)), op_(op), barrier_(size_) {
  DTRAIN_CHECK(op_ != CrossDeviceOp::nccl, "a thread group sums host memory; nccl is NcclGroup's (nccl_communicator.hpp)");
  slots_.resize(static_cast<std::size_t>(size_));
  for (int area = 0; area < 2; ++area) {
    posted_slots_[area].resize(static_cast<std::size_t>(size_));
    posted_[area].resize(static_cast<std::size_t>(size_) * kPostedValues);
  }
  for (int r = 0; r < size_; ++r) endpoints_.push_back(std::unique_ptr<ThreadCommunicator>(new ThreadCommunicator(*this, r)));
  waits_ = std::make_unique<Waited[]>(static_cast<std::size_t>(size_));
}

void ThreadGroup::arrive(int replica) {
  waits_[static_cast<std::size_t>(replica)].seconds += barrier_.arrive_and_wait();
}

ThreadCommunicator& ThreadGroup::endpoint(int replica) {
  DTRAIN_CHECK(replica >= 0 && replica < size_,
               fmt::format("replica {} is outside the thread group's [0, {})", replica, size_));
  return *endpoints_[static_cast<std::size_t>(replica)];
}

void ThreadGroup::check_root(int root, const char* what) const {
  DTRAIN_CHECK(root >= 0 && root < size_, fmt::format("{}: root {} is outside the thread group's [0, {})", what, root, size_));
}

template <class T>
void ThreadGroup::enter(int replica, std::span<T> values, const char* what) {
  slots_[static_cast<std::size_t>(replica)] = Slot{values.data(), values.size()};
  arrive(replica);
  check_slots(slots_, what);
}

void ThreadGroup::check_slots(const std::vector<Slot>& slots, const char* what) const {
  const Slot& first = slots[0];
  for (int r = 0; r < size_; ++r) {
    const Slot& other = slots[static_cast<std::size_t>(r)];
    DTRAIN_CHECK(other.data != nullptr || other.count == 0,
                 fmt::format("{} over the {} thread group: replica {}'s values are null but have {} elements", what,
                             name(), r, other.count));
    if (r == 0) continue;
    DTRAIN_CHECK(other.count == first.count,
                 fmt::format("{} over the {} thread group: replica {} gives {} values, replica 0 gives {}; every replica "
                             "must give the same length",
                             what, name(), r, other.count, first.count));
    // The algorithms read one replica's values while writing another's: shared memory would make
    // that a data race and a wrong sum.
    DTRAIN_CHECK(first.count == 0 || other.data != first.data,
                 fmt::format("{} over the {} thread group: replica {}'s values are the same memory as replica 0's", what,
                             name(), r));
  }
}

// Phases (a barrier after each): replica 0 combines; the others copy from it. The last barrier
// keeps replica 0 from returning (and overwriting its values) while others still copy.
template <class T, class Combine>
void ThreadGroup::reduce_then_copy(int replica, std::span<T> values, const char* what, Combine combine) {
  if (size_ == 1) return;
  enter(replica, values, what);
  combine_then_copy(replica, values, slots_, combine);
}

template <class T, class Combine>
void ThreadGroup::combine_then_copy(int replica, std::span<T> values, const std::vector<Slot>& slots, Combine combine) {
  if (replica == 0)
    for (int r = 1; r < size_; ++r) combine(values, values_in<T>(slots, r));
  arrive(replica);
  if (replica != 0) copy_from(values, values_in<T>(slots, 0));
  arrive(replica);
}

// Phases, each ended by a barrier (skipped where the phase is empty for every replica):
//   1. each leader (0 and h) adds its group's members into itself; the groups are disjoint;
//   2. leader 0 adds leader h;
//   3. leader h and the members of group 0 copy from leader 0;
//   4. the members of group 1 copy from leader h (the last barrier also keeps the leaders from
//      returning while a member still copies).
void ThreadGroup::hierarchical_copy(int replica, std::span<float> values, const char* what) {
  if (size_ == 1) return;
  const int second_leader = (size_ + 1) / 2;
  const bool in_first_group = replica < second_leader;
  const int leader = in_first_group ? 0 : second_leader;
  const int group_end = in_first_group ? second_leader : size_;
  enter(replica, values, what);

  if (replica == leader)
    for (int r = leader + 1; r < group_end; ++r) kAdd(values, values_of<float>(r));
  // Phases with nothing to do for any replica skip their barrier; the choice depends on N only,
  // so every replica makes the same one.
  const bool groups_have_members = size_ > 2;
  const bool second_group_has_members = size_ - second_leader > 1;
  if (groups_have_members) arrive(replica);

  if (replica == 0) kAdd(values, values_of<float>(second_leader));
  arrive(replica);

  if (replica != 0 && (in_first_group || replica == second_leader))
    copy_from(values, values_of<float>(0));
  arrive(replica);

  if (!second_group_has_members) return;
  if (!in_first_group && replica != second_leader)
    copy_from(values, values_of<float>(second_leader));
  arrive(replica);
}

const char* ThreadCommunicator::name() const { return group_.name(); }

int ThreadCommunicator::size() const { return group_.size(); }

double ThreadCommunicator::waited_seconds() const { return group_.waits_[static_cast<std::size_t>(replica_)].seconds; }

void ThreadCommunicator::all_reduce_sum(std::span<float> values, const char* what) {
  switch (group_.op()) {
    case CrossDeviceOp::reduction_to_one_device: group_.reduce_then_copy(replica_, values, what, kAdd); return;
    case CrossDeviceOp::hierarchical_copy: group_.hierarchical_copy(replica_, values, what); return;
    case CrossDeviceOp::ring: ring_all_reduce_sum(values, what); return;
    case CrossDeviceOp::nccl: break;  // refused by the constructor
  }
}

// Why one barrier: the lanes of a replica sum batch statistics twice in every batch
// normalization's forward. With reduce_then_copy's three barriers, a lane that slept at the first
// (its partner late by more than the spin) woke tens of microseconds after its partner arrived,
// who by then waited at the second barrier, slept there too, and so on: on the 2-core EPYC the
// first sum of a forward took 60-110 us at the median on each lane.
// Every replica posts its values' address and length (and, up to kPostedValues, a copy of them)
// before the one barrier all sums begin with, so all of them see the same lengths after it and
// take the same way on: add the copies, or, for longer values, reduce_then_copy's last two phases.
template <class T>
void ThreadCommunicator::all_reduce_sum_posted(std::span<T> values, const char* what) {
  static_assert(sizeof(T) == sizeof(std::uint64_t));
  const int n = size();
  if (n == 1) return;
  const std::size_t area = posted_sums_ % 2, count = values.size();
  const auto copy_of = [&](int r) {
    return group_.posted_[area].data() + static_cast<std::size_t>(r) * ThreadGroup::kPostedValues;
  };
  const std::vector<ThreadGroup::Slot>& slots = group_.posted_slots_[area];
  const bool copied = count <= ThreadGroup::kPostedValues;
  if (copied) {
    std::uint64_t* mine = copy_of(replica_);
    for (std::size_t i = 0; i < count; ++i) mine[i] = std::bit_cast<std::uint64_t>(values[i]);
  }
  group_.posted_slots_[area][static_cast<std::size_t>(replica_)] = ThreadGroup::Slot{values.data(), count};
  group_.arrive(replica_);
  ++posted_sums_;  // after the wait: a broken barrier leaves every replica's count as it was
  group_.check_slots(slots, what);  // the same lengths everywhere from here on, or an error everywhere
  if (copied) {
    // Every replica adds the copies in replica order, as reduce_then_copy's replica 0 adds.
    for (std::size_t i = 0; i < count; ++i) {
      T sum = std::bit_cast<T>(copy_of(0)[i]);
      for (int r = 1; r < n; ++r) sum += std::bit_cast<T>(copy_of(r)[i]);
      values[i] = sum;
    }
    return;
  }
  group_.combine_then_copy(replica_, values, slots, kAdd);
}

void ThreadCommunicator::all_reduce_sum(std::span<double> values, const char* what) {
  all_reduce_sum_posted(values, what);
}

void ThreadCommunicator::all_reduce_sum(std::span<std::int64_t> values, const char* what) {
  all_reduce_sum_posted(values, what);
}

int ThreadCommunicator::all_reduce_max(int value, const char* what) {
  group_.reduce_then_copy(replica_, std::span<int>(&value, 1), what, [](std::span<int> dst, std::span<int> src) {
    dst[0] = std::max(dst[0], src[0]);
  });
  return value;
}

void ThreadCommunicator::reduce_sum_to(std::span<float> values, int root, const char* what) {
  group_.check_root(root, what);
  if (size() == 1) return;
  group_.enter(replica_, values, what);
  // Every replica thread adds its own slice of the values into the root's, so the sum runs on all
  // of the group's cores (it ran on the root's alone: lanes' gradients of the seed CNN, 0.9 MB
  // each, waited on one core every step). Each element still gets root + x_0 + x_1 + ... in
  // ascending order: the bits are the same whoever adds them. Slices are whole 64-byte lines, so
  // no two threads write into one cache line.
  const std::size_t n = values.size();
  constexpr std::size_t kLine = 64 / sizeof(float);
  const std::size_t lines = (n + kLine - 1) / kLine;
  const auto at = [&](int r) { return std::min(n, lines * static_cast<std::size_t>(r) / static_cast<std::size_t>(size()) * kLine); };
  const std::size_t begin = at(replica_), count = at(replica_ + 1) - begin;
  const std::span<float> into = group_.values_of<float>(root).subspan(begin, count);
  for (int r = 0; r < size(); ++r)
    if (r != root) kAdd(into, group_.values_of<float>(r).subspan(begin, count));
  // The sources must stay untouched, and the root must not return, until every slice is added.
  group_.arrive(replica_);
}

template <class T>
void ThreadCommunicator::broadcast_values(std::span<T> values, int root, const char* what) {
  group_.check_root(root, what);
  if (size() == 1) return;
  group_.enter(replica_, values, what);
  if (replica_ != root) copy_from(values, group_.values_of<T>(root));
  group_.arrive(replica_);
}

void ThreadCommunicator::broadcast(std::span<float> values, int root, const char* what) {
  broadcast_values(values, root, what);
}

void ThreadCommunicator::broadcast(std::span<double> values, int root, const char* what) {
  broadcast_values(values, root, what);
}

// Why no step reads memory another thread writes in that same step (N >= 2, indices mod N):
//   reduce-scatter step s: replica r writes its own chunk r-s-1 and reads chunk r-s-1 of its left
//     neighbour r-1. That neighbour writes its own chunk (r-1)-s-1 = r-s-2 != r-s-1, and r's own
//     chunk r-s-1 is read by its right neighbour r+1 as chunk (r+1)-s-1 = r-s != r-s-1.
//   all-gather step s: replica r writes its own chunk r-s and reads chunk r-s of r-1, which
//     writes its own chunk r-1-s != r-s; r+1 reads r's chunk r+1-s != r-s.
// A barrier ends every step (including the switch between the phases, where for N == 2 the chunks
// would collide), and the last one keeps a replica from returning and overwriting its values
// while its right neighbour still reads them.
void ThreadCommunicator::open(std::span<float> values, const char* what) { group_.enter(replica_, values, what); }

void ThreadCommunicator::exchange(std::span<float> values, RingChunk /*send: the right neighbour reads it*/,
                                  RingChunk recv, bool accumulate, const char* /*what*/) {
  const int left = (replica_ + size() - 1) % size();
  std::span<float> mine = values.subspan(recv.begin, recv.size());
  std::span<float> theirs = group_.values_of<float>(left).subspan(recv.begin, recv.size());
  if (accumulate) {
    add_into(mine, theirs);
  } else {
    copy_from(mine, theirs);
  }
  group_.arrive(replica_);
}

}  // namespace dtrain::distribute
