#include "core/compute_thread.hpp"

#include <omp.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace dtrain {

namespace {
#if defined(__SSE__)
constexpr unsigned kFlushToZero = 0x8000;      // MXCSR bit 15
constexpr unsigned kDenormalsAreZero = 0x0040;  // MXCSR bit 6
#endif
}  // namespace

void flush_denormals() {
#if defined(__SSE__)
  _mm_setcsr(_mm_getcsr() | kFlushToZero | kDenormalsAreZero);
#endif
}

bool denormals_flushed() {
#if defined(__SSE__)
  const unsigned both = kFlushToZero | kDenormalsAreZero;
  return (_mm_getcsr() & both) == both;
#else
  return false;
#endif
}

void prepare_compute_thread(int openmp_threads) {
  flush_denormals();
  omp_set_num_threads(openmp_threads);
  // OpenMP's pool threads inherit the environment when they are created, but a team made earlier
  // keeps its own: each of its threads sets the bits itself.
#pragma omp parallel num_threads(openmp_threads)
  flush_denormals();
}

void release_openmp_team() {
  // Nonzero where the runtime cannot (inside a parallel region): the threads then sleep on their own.
  (void)omp_pause_resource_all(omp_pause_soft);
}

}  // namespace dtrain
