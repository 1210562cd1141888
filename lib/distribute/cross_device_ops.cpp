#include "distribute/cross_device_ops.hpp"

#include <algorithm>
#include <string>

#include "core/error.hpp"

namespace dtrain::distribute {
namespace {

int checked_replica_count(int num_replicas) {
  DTRAIN_CHECK(num_replicas >= 1,
               "cross-device ops need at least one replica, got " + std::to_string(num_replicas));
  return num_replicas;
}

void check_replica(int replica, int num_replicas, const char* what) {
  DTRAIN_CHECK(replica >= 0 && replica < num_replicas,
               std::string(what) + " " + std::to_string(replica) + " is outside [0, " +
                   std::to_string(num_replicas) + ")");
}

// dst[b][i] += src[b][i] for every buffer b and element i.
void add_into(const BufferList& dst, const BufferList& src) {
  for (std::size_t b = 0; b < dst.data.size(); ++b) {
    float* d = dst.data[b];
    const float* s = src.data[b];
    for (std::size_t i = 0; i < dst.sizes[b]; ++i) d[i] += s[i];
  }
}

void copy_from(const BufferList& dst, const BufferList& src) {
  for (std::size_t b = 0; b < dst.data.size(); ++b)
    std::copy(src.data[b], src.data[b] + src.sizes[b], dst.data[b]);
}

// Calls fn(buffer, offset, count) for each piece of the logical range [begin, end) of the
// concatenated buffer list; a range may span several buffers (and skip empty ones).
template <typename Fn>
void for_each_piece(const std::vector<std::size_t>& sizes, std::size_t begin, std::size_t end,
                    Fn&& fn) {
  std::size_t buffer_start = 0;
  for (std::size_t b = 0; b < sizes.size() && buffer_start < end; ++b) {
    const std::size_t buffer_end = buffer_start + sizes[b];
    const std::size_t lo = std::max(begin, buffer_start);
    const std::size_t hi = std::min(end, buffer_end);
    if (lo < hi) fn(b, lo - buffer_start, hi - lo);
    buffer_start = buffer_end;
  }
}

}  // namespace

std::size_t BufferList::total() const {
  std::size_t sum = 0;
  for (std::size_t n : sizes) sum += n;
  return sum;
}

CrossDeviceOps::CrossDeviceOps(int num_replicas)
    : num_replicas_(checked_replica_count(num_replicas)),
      lists_(static_cast<std::size_t>(num_replicas)),
      barrier_(num_replicas) {}

void CrossDeviceOps::bind(int replica, const BufferList& buffers) {
  check_replica(replica, num_replicas_, "bind: replica");
  DTRAIN_CHECK(buffers.data.size() == buffers.sizes.size(),
               "bind: replica " + std::to_string(replica) + " gives " +
                   std::to_string(buffers.data.size()) + " buffer pointers but " +
                   std::to_string(buffers.sizes.size()) + " sizes");
  for (std::size_t b = 0; b < buffers.data.size(); ++b)
    DTRAIN_CHECK(buffers.data[b] != nullptr || buffers.sizes[b] == 0,
                 "bind: replica " + std::to_string(replica) + " buffer " + std::to_string(b) +
                     " is null but has " + std::to_string(buffers.sizes[b]) + " elements");
  // Each replica writes only its own slot, so concurrent binds from replica threads do not race.
  lists_[static_cast<std::size_t>(replica)] = buffers;
}

void CrossDeviceOps::reduce_to(int replica, int destination) {
  check_replica(destination, num_replicas_, "reduce_to: destination");
  all_reduce(replica);
}

void CrossDeviceOps::enter_collective(int replica) {
  check_replica(replica, num_replicas_, "collective: replica");
  barrier_.arrive_and_wait();
  const BufferList& first = lists_[0];
  for (int r = 1; r < num_replicas_; ++r) {
    const BufferList& other = lists_[static_cast<std::size_t>(r)];
    DTRAIN_CHECK(other.sizes == first.sizes,
                 std::string(name()) + ": replica " + std::to_string(r) +
                     "'s buffer list differs in count or sizes from replica 0's; every replica "
                     "must bind the same gradient layout");
    // The algorithms read one replica's buffer while writing another's; shared memory would
    // make that a data race and a wrong sum.
    for (std::size_t b = 0; b < first.data.size(); ++b)
      DTRAIN_CHECK(first.sizes[b] == 0 || other.data[b] != first.data[b],
                   std::string(name()) + ": replica " + std::to_string(r) + " buffer " +
                       std::to_string(b) + " is the same memory as replica 0's");
  }
}

// Phases (a barrier after each): replica 0 accumulates; the others copy from it. The last
// barrier keeps replica 0 from returning (and overwriting its buffers) while others still copy.
void ReductionToOneDevice::all_reduce(int replica) {
  if (num_replicas_ == 1) return;
  enter_collective(replica);
  if (replica == 0)
    for (int r = 1; r < num_replicas_; ++r) add_into(buffers(0), buffers(r));
  barrier_.arrive_and_wait();
  if (replica != 0) copy_from(buffers(replica), buffers(0));
  barrier_.arrive_and_wait();
}

void ReductionToOneDevice::reduce_to(int replica, int destination) {
  check_replica(destination, num_replicas_, "reduce_to: destination");
  if (num_replicas_ == 1) return;
  enter_collective(replica);
  if (replica == destination)
    for (int r = 0; r < num_replicas_; ++r)
      if (r != destination) add_into(buffers(destination), buffers(r));
  // The sources must stay untouched until the destination has read them.
  barrier_.arrive_and_wait();
}

// Phases, each ended by a barrier (skipped where the phase is empty for every replica):
//   1. each leader (0 and h) adds its group's members into itself; the groups are disjoint;
//   2. leader 0 adds leader h;
//   3. leader h and the members of group 0 copy from leader 0;
//   4. the members of group 1 copy from leader h (the last barrier also keeps the leaders from
//      returning while a member still copies).
void HierarchicalCopy::all_reduce(int replica) {
  if (num_replicas_ == 1) return;
  const int second_leader = (num_replicas_ + 1) / 2;
  const bool in_first_group = replica < second_leader;
  const int leader = in_first_group ? 0 : second_leader;
  const int group_end = in_first_group ? second_leader : num_replicas_;
  enter_collective(replica);

  if (replica == leader)
    for (int r = leader + 1; r < group_end; ++r) add_into(buffers(leader), buffers(r));
  // Phases with nothing to do for any replica skip their barrier; the choice depends on N only,
  // so every replica makes the same one.
  const bool groups_have_members = num_replicas_ > 2;
  const bool second_group_has_members = num_replicas_ - second_leader > 1;
  if (groups_have_members) barrier_.arrive_and_wait();

  if (replica == 0) add_into(buffers(0), buffers(second_leader));
  barrier_.arrive_and_wait();

  if (replica != 0 && (in_first_group || replica == second_leader))
    copy_from(buffers(replica), buffers(0));
  barrier_.arrive_and_wait();

  if (!second_group_has_members) return;
  if (!in_first_group && replica != second_leader)
    copy_from(buffers(replica), buffers(second_leader));
  barrier_.arrive_and_wait();
}

// Chunk c of the logical array is [c*T/N, (c+1)*T/N); sizes differ by at most one and a chunk
// may be empty when T < N.
//
// Why no step reads memory another thread writes in that same step (N >= 2, indices mod N):
//   reduce-scatter step s: replica r writes its own chunk r-s-1 and reads chunk r-s-1 of its left
//     neighbour r-1. That neighbour writes its own chunk (r-1)-s-1 = r-s-2 != r-s-1, and r's own
//     chunk r-s-1 is read by its right neighbour r+1 as chunk (r+1)-s-1 = r-s != r-s-1.
//   all-gather step s: replica r writes its own chunk r-s and reads chunk r-s of r-1, which
//     writes its own chunk r-1-s != r-s; r+1 reads r's chunk r+1-s != r-s.
// Across steps a barrier separates every step (including the switch between the phases, where
// for N == 2 the chunks would collide), and the final barrier keeps a replica from returning and
// overwriting its buffers while its right neighbour still reads them.
//
// After reduce-scatter step s, replica r's chunk r-s-1 holds x_r + (x_{r-1} + (... + x_{r-s-1})),
// so after step N-2 replica r holds the full sum of chunk r+1; all-gather step s then hands
// chunk r-s, which r-1 completed one step earlier (or owned from the start), to r.
void Ring::all_reduce(int replica) {
  if (num_replicas_ == 1) return;
  enter_collective(replica);
  const std::size_t n = static_cast<std::size_t>(num_replicas_);
  const std::size_t r = static_cast<std::size_t>(replica);
  const std::size_t left = (r + n - 1) % n;
  const BufferList& mine = buffers(replica);
  const BufferList& theirs = buffers(static_cast<int>(left));
  const std::size_t total = mine.total();
  auto chunk_begin = [&](std::size_t c) { return c * total / n; };

  for (std::size_t s = 0; s + 1 < n; ++s) {
    const std::size_t c = (r + 2 * n - s - 1) % n;
    for_each_piece(mine.sizes, chunk_begin(c), chunk_begin(c + 1),
                   [&](std::size_t b, std::size_t offset, std::size_t count) {
                     float* d = mine.data[b] + offset;
                     const float* src = theirs.data[b] + offset;
                     for (std::size_t i = 0; i < count; ++i) d[i] += src[i];
                   });
    barrier_.arrive_and_wait();
  }
  for (std::size_t s = 0; s + 1 < n; ++s) {
    const std::size_t c = (r + n - s) % n;
    for_each_piece(mine.sizes, chunk_begin(c), chunk_begin(c + 1),
                   [&](std::size_t b, std::size_t offset, std::size_t count) {
                     std::copy(theirs.data[b] + offset, theirs.data[b] + offset + count,
                               mine.data[b] + offset);
                   });
    barrier_.arrive_and_wait();
  }
}

std::unique_ptr<CrossDeviceOps> make_cross_device_ops(const std::string& name, int num_replicas) {
  if (name == "reduction_to_one_device") return std::make_unique<ReductionToOneDevice>(num_replicas);
  if (name == "hierarchical_copy") return std::make_unique<HierarchicalCopy>(num_replicas);
  if (name == "ring") return std::make_unique<Ring>(num_replicas);
  throw InternalError("make_cross_device_ops: unknown cross_device_ops '" + name +
                      "'; expected reduction_to_one_device, hierarchical_copy or ring (the "
                      "strategy must resolve 'auto' and reject 'nccl' on CPU before this)");
}

}  // namespace dtrain::distribute
