#include "distribute/packed_all_reduce.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <utility>

#include <fmt/format.h>

#include "core/compute_thread.hpp"
#include "core/error.hpp"

namespace dtrain::distribute {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
}  // namespace

std::vector<GradientPack> plan_packs(std::span<const std::size_t> sizes, std::int64_t bytes_per_pack) {
  std::size_t total = 0;
  for (std::size_t s : sizes) total += s;
  const std::size_t limit = bytes_per_pack > 0 ? static_cast<std::size_t>(bytes_per_pack) / sizeof(float) : total;
  std::vector<GradientPack> packs;
  std::size_t v = sizes.size();
  while (v > 0) {
    GradientPack pack;
    pack.last = v;
    pack.first = v;
    while (pack.first > 0 && (pack.floats == 0 || pack.floats + sizes[pack.first - 1] <= limit))
      pack.floats += sizes[--pack.first];
    packs.push_back(pack);
    v = pack.first;
  }
  return packs;
}

PackedAllReduce::PackedAllReduce(Communicator& workers, std::span<float> gradients, std::span<const std::size_t> sizes,
                                 std::int64_t bytes_per_pack, bool ring, bool overlap)
    : workers_(workers), gradients_(gradients), ring_(ring) {
  packs_ = plan_packs(sizes, bytes_per_pack);
  pack_of_variable_.resize(sizes.size());
  std::vector<std::size_t> variable_offset(sizes.size() + 1, 0);
  for (std::size_t v = 0; v < sizes.size(); ++v) variable_offset[v + 1] = variable_offset[v] + sizes[v];
  DTRAIN_CHECK(variable_offset.back() == gradients_.size(),
               fmt::format("the gradient arena has {} floats but its variables {}", gradients_.size(), variable_offset.back()));
  for (std::size_t p = 0; p < packs_.size(); ++p) {
    for (std::size_t v = packs_[p].first; v < packs_[p].last; ++v) pack_of_variable_[v] = p;
    pack_offset_.push_back(variable_offset[packs_[p].first]);
  }
  // One pack is only complete when backward is: nothing to overlap, no thread to hand it to.
  if (!overlap || packs_.size() < 2) return;
  variable_ready_.assign(sizes.size(), 0);
  for (const GradientPack& p : packs_) unfinished_variables_.push_back(p.last - p.first);
  thread_ = std::thread(&PackedAllReduce::communicate, this);
}

PackedAllReduce::~PackedAllReduce() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_cv_.notify_all();
  thread_.join();
}

void PackedAllReduce::sum_pack(std::size_t index) {
  const GradientPack& pack = packs_[index];
  std::snprintf(what_, sizeof what_, "gradients pack %zu", index);
  const auto t0 = Clock::now();
  const std::span<float> values = gradients_.subspan(pack_offset_[index], pack.floats);
  if (ring_) {
    workers_.ring_all_reduce_sum(values, what_);
  } else {
    workers_.all_reduce_sum(values, what_);
  }
  collective_seconds_ += seconds_since(t0);
}

void PackedAllReduce::communicate() {
  flush_denormals();  // the ring adds the packs here
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    // Packs go out strictly in plan order: every worker must enter the same collectives in the
    // same order.
    ready_cv_.wait(lock, [&] { return stopping_ || (packs_summed_ < packs_.size() && unfinished_variables_[packs_summed_] == 0); });
    if (stopping_) return;
    const std::size_t index = packs_summed_;
    lock.unlock();
    std::exception_ptr error;
    try {
      sum_pack(index);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error) {
      // finish() reports it; the step's remaining packs are not sent.
      error_ = error;
      packs_summed_ = packs_.size();
    } else {
      ++packs_summed_;
    }
    if (packs_summed_ == packs_.size()) done_cv_.notify_all();
  }
}

void PackedAllReduce::ready(std::size_t first, std::size_t count) {
  if (!overlaps()) return;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!step_started_) {
      step_started_ = true;
      // Backward is computing on this worker's cores: the collectives leave them to it.
      workers_.set_yield_while_waiting(true);
    }
    for (std::size_t v = first; v < first + count; ++v) {
      DTRAIN_CHECK(v < pack_of_variable_.size(), "gradients_ready: no such variable");
      DTRAIN_CHECK(!variable_ready_[v], "gradients_ready: a variable was handed over twice in one step");
      variable_ready_[v] = 1;
      const std::size_t p = pack_of_variable_[v];
      if (--unfinished_variables_[p] == 0) wake = true;
    }
  }
  if (wake) ready_cv_.notify_one();
}

void PackedAllReduce::finish() {
  const auto t0 = Clock::now();
  if (!overlaps()) {
    for (std::size_t p = 0; p < packs_.size(); ++p) sum_pack(p);
    wait_seconds_ += seconds_since(t0);
    return;
  }
  // Backward is done: what is left of the sums is all this worker waits for.
  workers_.set_yield_while_waiting(false);
  std::unique_lock<std::mutex> lock(mutex_);
  for (std::size_t p = 0; p < packs_.size(); ++p)
    DTRAIN_CHECK(unfinished_variables_[p] == 0 || error_, "finish(): backward did not hand over every gradient this step");
  done_cv_.wait(lock, [&] { return packs_summed_ == packs_.size(); });
  // Ready for the next step.
  packs_summed_ = 0;
  step_started_ = false;
  std::fill(variable_ready_.begin(), variable_ready_.end(), 0);
  for (std::size_t p = 0; p < packs_.size(); ++p) unfinished_variables_[p] = packs_[p].last - packs_[p].first;
  wait_seconds_ += seconds_since(t0);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

bool PackedAllReduce::in_flight() {
  if (!overlaps()) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return step_started_;
}

double PackedAllReduce::take_collective_seconds() { return std::exchange(collective_seconds_, 0.0); }

double PackedAllReduce::take_wait_seconds() { return std::exchange(wait_seconds_, 0.0); }

}  // namespace dtrain::distribute
