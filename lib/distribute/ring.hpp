// The chunked ring all-reduce, written once for every group that can talk to its neighbours:
// replica threads reading their left neighbour's buffer in shared memory, or MPI ranks sending
// point-to-point messages.
//
// The array of T elements is cut into n chunks, chunk c = [c T / n, (c + 1) T / n) (sizes differ
// by at most one; a chunk may be empty when T < n). Participant r, with its neighbours r - 1 on
// the left and r + 1 on the right (mod n):
//   reduce-scatter step s = 0 .. n-2: sends chunk r - s to the right, receives chunk r - s - 1 from
//     the left and adds it into its own: own += left's. Afterwards r holds the full sum of chunk
//     r + 1, added as x_r + (x_{r-1} + (... + (x_{r+2} + x_{r+1}))).
//   all-gather step s = 0 .. n-2: sends the complete chunk r + 1 - s to the right, receives chunk
//     r - s from the left and copies it over its own.
// Every participant adds and copies the same share of the data; the order of each chunk's terms
// depends only on the chunk and n, so every group of n gives the same bits.
#pragma once

#include <cstddef>
#include <span>

namespace dtrain::distribute {

// Elements [begin, end) of the array.
struct RingChunk {
  std::size_t begin = 0, end = 0;
  std::size_t size() const { return end - begin; }
};

// Chunk c of n over `total` elements.
RingChunk ring_chunk(std::size_t c, std::size_t n, std::size_t total);

// What the ring needs from a group: one exchange with its neighbours per step.
class RingTransport {
 public:
  virtual ~RingTransport() = default;
  // Before the first step of one all-reduce over `values` (the same length on every participant).
  virtual void open(std::span<float> values, const char* what) = 0;
  // One step: `send` of this participant's values goes to the right neighbour; the left
  // neighbour's elements `recv` arrive and are added into (accumulate) or copied over this
  // participant's same elements. Returns when both are done, so the next step may read and write
  // anything.
  virtual void exchange(std::span<float> values, RingChunk send, RingChunk recv, bool accumulate,
                        const char* what) = 0;
};

// The ring over `transport` for participant `rank` of `size`; nothing happens with size 1.
void ring_all_reduce(RingTransport& transport, int rank, int size, std::span<float> values, const char* what);

}  // namespace dtrain::distribute
