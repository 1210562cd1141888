// The Reducer of MultiWorkerMirroredStrategy: one worker's gradients summed with every other worker's,
// in packs (communication.bytes_per_pack).
//
// The gradient variables are grouped into packs of whole variables, last variable first: the
// order backward produces them. Every worker plans the same packs and sums them in the same
// order, each pack with one collective (the group's all_reduce_sum, MPI_Allreduce, or the ring)
// in place: a pack of consecutive variables is one contiguous range of the gradient arena.
//
// With overlap, backward hands each layer's finished gradients over (ready()); a pack whose
// variables are all finished is summed at once by the communication thread while backward goes
// on with earlier layers, and finish() only waits for what is left. Without overlap, finish() sums
// every pack on the calling thread. Both give the same bits: same packs, same collectives, same
// order.
//
// MPI is initialized MPI_THREAD_SERIALIZED: between the first ready() of a step and the return of
// finish(), the communication thread is the only one calling MPI, and the hand-over through the
// mutex orders its calls after the caller's earlier ones and before its later ones.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "distribute/communicator.hpp"
#include "distribute/reducer.hpp"

namespace dtrain::distribute {

// Variables [first, last) of the gradient list, `floats` values in all.
struct GradientPack {
  std::size_t first = 0, last = 0;
  std::size_t floats = 0;
  bool operator==(const GradientPack&) const = default;
};

// Packs of at most bytes_per_pack bytes of whole variables, starting from the last variable; a
// variable larger than the limit is a pack of its own. bytes_per_pack 0: one pack of everything.
// sizes: floats per variable.
std::vector<GradientPack> plan_packs(std::span<const std::size_t> sizes, std::int64_t bytes_per_pack);

class PackedAllReduce final : public Reducer {
 public:
  // gradients: the arena summed in place (it must outlive this object), partitioned into
  // variables of `sizes` floats. ring: the group's chunked ring instead of its all_reduce_sum.
  // overlap: start each pack as soon as it is ready (with at least two packs; one is only
  // complete when backward is).
  PackedAllReduce(Communicator& workers, std::span<float> gradients, std::span<const std::size_t> sizes,
                  std::int64_t bytes_per_pack, bool ring, bool overlap);
  ~PackedAllReduce() override;
  PackedAllReduce(const PackedAllReduce&) = delete;
  PackedAllReduce& operator=(const PackedAllReduce&) = delete;

  const std::vector<GradientPack>& packs() const { return packs_; }
  bool overlaps() const override { return thread_.joinable(); }
  // Without overlap ready() does nothing.
  void ready(std::size_t first, std::size_t count) override;
  void finish() override;
  bool in_flight() override;
  double take_collective_seconds() override;
  double take_wait_seconds() override;

 private:
  void sum_pack(std::size_t index);
  void communicate();

  Communicator& workers_;
  std::span<float> gradients_;
  std::vector<GradientPack> packs_;
  std::vector<std::size_t> pack_offset_;  // where each pack starts in the arena
  std::vector<std::size_t> pack_of_variable_;
  bool ring_;
  char what_[48] = {};  // the collective's name for the watchdog
  double collective_seconds_ = 0.0, wait_seconds_ = 0.0;

  // Overlap: the step's progress, guarded by mutex_.
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable ready_cv_, done_cv_;
  std::vector<std::size_t> unfinished_variables_;  // per pack, this step: 0 = ready to sum
  std::vector<char> variable_ready_;                 // per variable, this step
  std::size_t packs_summed_ = 0;
  bool step_started_ = false;
  bool stopping_ = false;
  std::exception_ptr error_;
};

}  // namespace dtrain::distribute
