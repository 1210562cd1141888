#include "distribute/ring.hpp"

#include "distribute/communicator.hpp"

namespace dtrain::distribute {

RingChunk ring_chunk(std::size_t c, std::size_t n, std::size_t total) { return {c * total / n, (c + 1) * total / n}; }

void ring_all_reduce(RingTransport& transport, int rank, int size, std::span<float> values, const char* what) {
  if (size <= 1) return;
  const std::size_t n = static_cast<std::size_t>(size), r = static_cast<std::size_t>(rank), total = values.size();
  transport.open(values, what);
  for (std::size_t s = 0; s + 1 < n; ++s)
    transport.exchange(values, ring_chunk((r + n - s) % n, n, total), ring_chunk((r + 2 * n - s - 1) % n, n, total),
                       true, what);
  for (std::size_t s = 0; s + 1 < n; ++s)
    transport.exchange(values, ring_chunk((r + 1 + n - s) % n, n, total), ring_chunk((r + n - s) % n, n, total), false,
                       what);
}

void Communicator::ring_all_reduce_sum(std::span<float> values, const char* what) {
  ring_all_reduce(ring_transport(), rank(), size(), values, what);
}

}  // namespace dtrain::distribute
