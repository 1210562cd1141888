// Communicator: one participant of a group that makes collectives together — the replica
// threads of one process (ThreadCommunicator), the worker processes of a job (MpiCommunicator),
// a group of one (SingleCommunicator), or NCCL's GPUs (nccl_communicator.hpp), which also sum
// device memory on a replica's stream (sums_device_memory).
//
// Every collective is called by every participant of the group, in the same order, each with its
// own values of the same length; `what` names it for errors and the watchdog ("gradients pack 2",
// "step loss", ...). Sums are deterministic: the order in which each element's terms are added is
// fixed by the implementation and the group's size, never by timing, so a seed reproduces a run.
// A group of one leaves every value as it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/error.hpp"
#include "device/context.hpp"

namespace dtrain::distribute {

class RingTransport;

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // What the group's float sums run on: "single", "mpi", or a thread group's cross-device op.
  virtual const char* name() const = 0;
  // This participant, in [0, size()).
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // In place, element-wise: on return every participant holds the sum over the group.
  virtual void all_reduce_sum(std::span<float> values, const char* what) = 0;
  virtual void all_reduce_sum(std::span<double> values, const char* what) = 0;
  virtual void all_reduce_sum(std::span<std::int64_t> values, const char* what) = 0;
  // The maximum over the group (agreeing on a stop request).
  virtual int all_reduce_max(int value, const char* what) = 0;
  // The element-wise sum lands on `root` only; every other participant's values stay unchanged.
  // A root outside the group is an InternalError.
  virtual void reduce_sum_to(std::span<float> values, int root, const char* what) = 0;
  // Every participant's values become root's (a root outside the group is an InternalError).
  virtual void broadcast(std::span<float> values, int root, const char* what) = 0;
  virtual void broadcast(std::span<double> values, int root, const char* what) = 0;
  // Whether this group sums device memory itself (NCCL): a strategy then hands it a replica's
  // gradient arena where backward wrote it, with no staging through the host. The host-memory
  // collectives above stay available (metric counts, losses, agreeing on a stop).
  virtual bool sums_device_memory() const { return false; }
  // A step failed on some replica: a device sum this endpoint queued may wait for peers that
  // will never queue theirs, and everything that waits for its stream (a context's teardown) would
  // wait for ever. Cancels what it queued so that the process can report the error (NCCL: an
  // abort of its communicator). Called once the step's threads have stopped; nothing after it.
  virtual void abandon_device_sums() {}
  // In place over `count` floats at `values`, memory of `ctx`: the sum is queued on ctx's stream
  // after the work queued before it, and the work queued after it waits for it (the optimizer's
  // update); returns once queued. Only where sums_device_memory(); elsewhere an InternalError.
  virtual void all_reduce_sum_on_device(device::Context& ctx, float* values, std::size_t count, const char* what) {
    (void)ctx, (void)values, (void)count;
    throw InternalError(std::string(what) + ": the " + name() +
                        " communicator sums host memory only; stage the values through the host (StagedGradients)");
  }
  // The same sum as all_reduce_sum by the chunked ring of ring.hpp over this group's neighbours:
  // each participant sends and receives 2 (size - 1) / size of the data, and each chunk's terms
  // are added in an order fixed by the ring.
  void ring_all_reduce_sum(std::span<float> values, const char* what);

  // For a watchdog that names the ranks that did not arrive: the global step being computed, and
  // how long a collective may wait before the job is declared stuck. Groups without one ignore
  // these.
  virtual void set_step(std::int64_t /*step*/) {}
  virtual void set_timeout(double /*seconds*/) {}
  // While this participant's cores compute (a collective overlapping backward), a waiting
  // collective gives the core away between polls. May be called from another thread while a
  // collective waits. Groups that do not poll ignore it.
  virtual void set_yield_while_waiting(bool /*yield*/) {}

 protected:
  // The point-to-point steps ring_all_reduce_sum runs on.
  virtual RingTransport& ring_transport() = 0;
};

}  // namespace dtrain::distribute
