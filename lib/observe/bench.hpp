// `dtrain bench` (like `caffe time`): an experiment's training steps, timed. The trainer is built
// exactly as `dtrain run` builds it (model, strategy, input pipeline); warm-up steps create the
// primitives and fill the caches, then the timed steps run with a StepProfile attached. Each
// worker measures its own steps, layers, GEMM peak and copy bandwidth (all at the same time);
// every worker then holds every worker's figures, as mean and max.
//
// Each layer's bound is the longer of the time its FLOPs take at the GEMM peak and the time its
// bytes take at the copy bandwidth (a roofline): the bytes a layer must move are its input and
// output once forward; its output's and input's gradients once backward, with the input or the
// output its backward cannot do without (Layer::backward_reads: a kernel's gradient needs the
// input, batch normalization its input, an activation's derivative its output, and a conv2d's or
// dense's own activation its output too, Layer::activation_reads_output), in the compute
// dtype; and its variables once each way (layer_bytes in bench.cpp). A lower bound: a kernel may
// also read what its forward kept (an argmax, a mask), and activations that stay in the caches
// move faster than a copy through memory, so a layer may run below 1x its bound.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "device/gemm_peak.hpp"
#include "nn/layer.hpp"
#include "observe/step_profile.hpp"
#include "train/trainer.hpp"

namespace dtrain::observe {

struct BenchOptions {
  std::int64_t warmup = 10;  // steps before timing
  std::int64_t steps = 50;   // timed steps (an epoch's short last batch is run but not counted)
};

// A per-worker figure over the workers.
struct Spread {
  double mean = 0.0, max = 0.0;
};

struct LayerBench {
  std::string name, kind;
  // The layer below that computes this one with its own output (a max pooling fused into a first
  // convolution): this layer's times are in that one's. Empty otherwise.
  std::string computed_in;
  Spread forward_ms, backward_ms;  // per step
  // Where the kernel marks the end of one of its two gradients (nn::BackwardMarks): backward_ms
  // split into the weights' part and the input's (a fused activation's backward goes with the first).
  bool split = false;
  Spread backward_weights_ms, backward_data_ms;
  // The part of forward_ms and backward_ms the lane spent waiting for the replica's other lanes in
  // the layer's sums (batch statistics): the imbalance of the layers before, which the layer's
  // bound leaves out (nn::LayerTimes).
  Spread forward_wait_ms, backward_wait_ms;
  nn::Flops flops;                 // per sample
  // Whether backward computes the gradient with respect to the input (every layer but the first).
  bool backward_data = true;
  double forward_gflops = 0.0, backward_gflops = 0.0;  // from the mean times
  double forward_bytes = 0.0, backward_bytes = 0.0;    // per sample, what it must move
  // The bound of each direction in ms per step (0 with neither a peak nor a bandwidth), and
  // whether the bytes set it (else the FLOPs).
  double forward_bound_ms = 0.0, backward_bound_ms = 0.0;
  bool forward_memory_bound = false, backward_memory_bound = false;
};

struct BenchReport {
  std::string header;  // the run's header line
  std::string compute_dtype;
  int workers = 1, replicas_in_sync = 1, threads = 1;
  std::int64_t global_batch = 0, replica_batch = 0, warmup_steps = 0, steps = 0, steps_left_out = 0;
  Spread step_ms;
  // The same number of steps again with only whole steps timed: timing the layers waits for the
  // device after each of them, which on a GPU is much of a small step. What training runs at.
  Spread untimed_step_ms;
  double untimed_samples_per_s = 0.0;
  double untimed_gflops = 0.0;
  std::array<Spread, train::kPhases> phase_ms;
  Spread phase_sum_ms;
  std::vector<LayerBench> layers;
  double samples_per_s = 0.0;
  double flops_per_sample = 0.0;  // one training step's, forward and backward
  double gflops = 0.0;            // achieved by the whole job
  device::GemmPeak peak;        // the chief's sweep (what, size; available or why not)
  Spread peak_gflops;             // per worker: the median of its rounds' peaks at peak.size
  double peak_gflops_total = 0.0; // summed over the workers: what the job's cores reach
  int rounds = 0;                 // of whole steps, each followed by the GEMM peak at peak.size
  std::int64_t round_warmup_steps = 0;  // untimed steps before each round's
  struct PeakRound {
    double step_ms = 0.0;      // the round's whole steps, mean
    double peak_gflops = 0.0;  // the peak right after them
    double fraction = 0.0;     // this worker's share of the job's FLOP rate in them against it
  };
  std::vector<PeakRound> peak_rounds;  // this worker's (empty without a peak)
  // What training reaches of the peak, from the steps timed whole (the timed steps carry the
  // layers' clocks: 3 % of a bf16 step on the 2-core EPYC, up to a third on the 16-core Sapphire
  // Rapids): per worker the median over the rounds of its share of the job's FLOP rate against the
  // peak measured right after, then the mean over the workers; < 0 without a peak.
  double peak_fraction = -1.0;
  // Under a computation in another dtype than float32 (bfloat16): float32's sweep on the same
  // threads, right after that dtype's, to say which of the two multiplies faster on this CPU (an
  // Intel Xeon with AVX512-BF16 but no AMX: bfloat16's 152-164 GFLOP/s against float32's
  // 231-318). Not available (why_not empty) under float32.
  device::GemmPeak float32_peak;
  device::CopyBandwidth bandwidth;  // the chief's (what, bytes; available or why not)
  Spread bandwidth_gb_per_s;        // per worker
};

// Runs the warm-up, the timed steps (layers and phases), the same number again timed as whole
// steps only, and measures the GEMM peak. Every worker calls it.
BenchReport run_bench(train::Trainer& trainer, const BenchOptions& options);

// The human table (docs/performance.md, "Benchmarking"); the header line is not in it.
std::string bench_table(const BenchReport& report);
// One JSON object (schema "dtrain.bench/1", docs/performance.md, "Benchmarking"), ending in a newline.
std::string bench_json(const BenchReport& report);

}  // namespace dtrain::observe
