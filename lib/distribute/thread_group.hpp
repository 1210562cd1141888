// The replica threads of one process as a group that makes collectives together in shared memory
// (tf.distribute's CrossDeviceOps). Each replica thread calls the collectives of its own endpoint,
// group.endpoint(r), with its own values; every replica must call each collective, in the same
// order, with values of the same length in memory of its own.
//
// Float sums run the group's cross-device op; each is deterministic (the order in which each
// element's terms are added is fixed by the algorithm, never by thread timing), and they differ
// from each other only in that order:
//   reduction_to_one_device  replica 0 adds every other replica's values into its own in replica
//                            order, then every replica copies the sum: ((x_0 + x_1) + x_2) + ...
//   hierarchical_copy        two groups (the first ceil(N/2) replicas, and the rest): each group's
//                            first replica sums its group in order, replica 0 adds the second
//                            group's sum, and the result is copied back down through the leaders
//                            (TensorFlow's hierarchical copy): (x_0 + ... + x_{h-1}) + (x_h + ...)
//   ring                     the chunked ring of ring.hpp, each replica reading its left
//                            neighbour's values: every replica thread adds and copies the same
//                            share of the data.
// Sums of doubles and int64s and the maximum use reduction_to_one_device's order whatever the op.
// A sum of at most kPostedValues doubles or int64s (batch statistics, counters) crosses one barrier
// instead of three: each replica posts a copy of its values to the group, waits once, and adds
// every replica's copy in replica order itself (the same bits). reduce_sum_to(root) adds
// ((x_root + x_0) + x_1) + ... over the other replicas in ascending order, on root only; each
// replica thread adds its own slice of the elements.
//
// No collective allocates. A replica that fails makes the strategy break barrier(): every
// replica waiting inside a collective then throws BarrierBroken, and the values' contents are
// unspecified. That the replicas' values agree in length (and are not the same memory) is checked
// by every replica at the start of each collective, so all of them throw an InternalError or none.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "distribute/barrier.hpp"
#include "distribute/communicator.hpp"
#include "distribute/replica_group.hpp"
#include "distribute/ring.hpp"

namespace dtrain::distribute {

class ThreadGroup;

// Replica r's endpoint in its thread group; only replica r's thread calls it.
class ThreadCommunicator final : public Communicator, private RingTransport {
 public:
  const char* name() const override;
  int rank() const override { return replica_; }
  int size() const override;
  void all_reduce_sum(std::span<float> values, const char* what) override;
  void all_reduce_sum(std::span<double> values, const char* what) override;
  void all_reduce_sum(std::span<std::int64_t> values, const char* what) override;
  int all_reduce_max(int value, const char* what) override;
  void reduce_sum_to(std::span<float> values, int root, const char* what) override;
  void broadcast(std::span<float> values, int root, const char* what) override;
  void broadcast(std::span<double> values, int root, const char* what) override;
  // Seconds this replica has spent in the group's barriers, waiting for the others to arrive, over
  // every collective so far (dtrain bench tells a layer's own work from waiting for the lanes).
  double waited_seconds() const;

 private:
  friend class ThreadGroup;
  ThreadCommunicator(ThreadGroup& group, int replica) : group_(group), replica_(replica) {}
  RingTransport& ring_transport() override { return *this; }
  // The ring in shared memory: each step reads the left neighbour's published values, then waits
  // at the barrier so that nobody writes what another still reads.
  void open(std::span<float> values, const char* what) override;
  void exchange(std::span<float> values, RingChunk send, RingChunk recv, bool accumulate, const char* what) override;
  template <class T>
  void broadcast_values(std::span<T> values, int root, const char* what);
  template <class T>
  void all_reduce_sum_posted(std::span<T> values, const char* what);

  ThreadGroup& group_;
  int replica_;
  // Posted sums this endpoint made (every replica makes the same ones): which of the group's two
  // posting areas the next one uses.
  std::uint64_t posted_sums_ = 0;
};

class ThreadGroup final : public ReplicaGroup {
 public:
  // The most doubles or int64s a sum copies through the group's own memory (one barrier; longer
  // sums take three, as reduce_then_copy does): 32 KiB per replica and area.
  static constexpr std::size_t kPostedValues = 4096;

  // size >= 1, else InternalError.
  ThreadGroup(int size, CrossDeviceOp op);
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  int size() const override { return size_; }
  CrossDeviceOp op() const { return op_; }
  const char* name() const override { return name_of(op_); }
  ThreadCommunicator& endpoint(int replica) override;
  Barrier& barrier() override { return barrier_; }

 private:
  friend class ThreadCommunicator;
  struct Slot {
    void* data = nullptr;
    std::size_t count = 0;
  };
  // The opening of every collective: publishes replica's values, waits until every replica has,
  // then checks that they agree.
  template <class T>
  void enter(int replica, std::span<T> values, const char* what);
  // What enter() checks once every replica has published into `slots`.
  void check_slots(const std::vector<Slot>& slots, const char* what) const;
  // Replica r's values as published in `slots` (slots_ after enter).
  template <class T>
  static std::span<T> values_in(const std::vector<Slot>& slots, int replica) {
    const Slot& slot = slots[static_cast<std::size_t>(replica)];
    return {static_cast<T*>(slot.data), slot.count};
  }
  template <class T>
  std::span<T> values_of(int replica) const {
    return values_in<T>(slots_, replica);
  }
  template <class T, class Combine>
  void reduce_then_copy(int replica, std::span<T> values, const char* what, Combine combine);
  // reduce_then_copy's phases after its opening, over the values published in `slots`.
  template <class T, class Combine>
  void combine_then_copy(int replica, std::span<T> values, const std::vector<Slot>& slots, Combine combine);
  void hierarchical_copy(int replica, std::span<float> values, const char* what);
  void check_root(int root, const char* what) const;
  // Replica `replica` at the barrier: waits for every replica, and adds the time to its waits_.
  void arrive(int replica);

  int size_;
  CrossDeviceOp op_;
  Barrier barrier_;
  std::vector<Slot> slots_;  // each replica writes only its own
  // The posted sums' two areas, used in turn, so that a replica posting the next sum never writes
  // what another still reads of the last one: between two sums in one area lies the other's
  // barrier, which a replica reaches only after reading. Per area, each replica's slot (what it
  // posted: its own values' address and length, for the checks) and kPostedValues words of copies.
  std::vector<Slot> posted_slots_[2];
  std::vector<std::uint64_t> posted_[2];
  std::vector<std::unique_ptr<ThreadCommunicator>> endpoints_;
  // Per replica, written by its own thread only (a line each: the threads do not share one).
  struct alignas(64) Waited {
    double seconds = 0.0;
  };
  std::unique_ptr<Waited[]> waits_;
};

}  // namespace dtrain::distribute
