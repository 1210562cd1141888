// The floating-point environment of every thread that computes.
//
// Each sets the x86 MXCSR's FTZ (flush results that would be subnormal to zero) and DAZ (read
// subnormal inputs as zero) bits before its first float operation, as TensorFlow does on its CPU
// threads. Subnormal floats (|x| < 1.2e-38) appear in late training (tiny gradients, Adam's second
// moments) and cost a microcode assist of about a hundred cycles per operation: they made epochs
// 2-10 of the seed CNN a third slower, and hold nothing training needs. The bits are per thread,
// so every kind of thread sets them: the main thread and the replica threads (with their OpenMP
// teams, which run oneDNN's primitives and dtrain's loops), the communication thread summing
// gradient packs, and the input pipeline's thread. On CPUs without SSE these do nothing.
#pragma once

namespace dtrain {

// Sets FTZ and DAZ on the calling thread.
void flush_denormals();
// Whether the calling thread's MXCSR has both bits set.
bool denormals_flushed();

// A replica's compute thread: flush_denormals(), its OpenMP thread count (the cores the strategy
// gave it), and FTZ and DAZ in every thread of the OpenMP team it will run on.
void prepare_compute_thread(int openmp_threads);

// Ends the calling thread's OpenMP pool (OpenMP 5's soft pause); its next parallel region starts
// new threads, which inherit the caller's FTZ and DAZ. Why: after a parallel region libgomp's
// threads spin for the next one (GOMP_SPINCOUNT turns) before they sleep, 8-12 ms on the 2-core
// AVX2 EPYC, on the cores a replica's lanes compute on. Each of dtrain bench's GEMM peaks left a
// tiny model's steps after it at 0.5-0.8 ms instead of training's 0.4 (784 -> 128 -> 10, batch
// 64, 2 lanes), so "training reaches" read half of what it was. For code that ran a team of
// several threads and hands the cores to other threads next; not inside a parallel region.
void release_openmp_team();

}  // namespace dtrain
