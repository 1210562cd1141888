#include "observe/bench.hpp"

#include <algorithm>
#include <cmath>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"
#include "nn/model.hpp"

namespace dtrain::observe {

using train::kPhases;
using train::Phase;
using train::Trainer;

namespace {

// Rounds of whole steps, each followed by the GEMM peak (fewer where there are fewer steps).
constexpr int kPeakRounds = 5;
// Untimed steps before each round's (no more than --warmup): the first steps after a GEMM peak ran
// slower (the caches full of its matrices, or the cores' state after it: not told apart; OpenMP's
// spinning threads were not the cause there). On a 2-core Intel Xeon with AMX (float32, 50 steps:
// rounds of 10) the rounds' steps took 3.6-4.5 ms against 3.3-3.9 with 3 untimed steps before each,
// and "training reaches" counted that in full; training itself never runs a peak between its steps.
// The peak and the copy bandwidth also end their OpenMP team (release_openmp_team): its threads
// spun for 8-12 ms after them on the lanes' cores, longer than a small model's round.
constexpr std::int64_t kRoundWarmupSteps = 3;

// Runs `steps` training steps from the start of epoch `epoch` on, into the next epochs. With a
// profile attached, goes on until it has kept `steps` (short batches are left out).
void run_steps(Trainer& trainer, std::int64_t& epoch, std::int64_t steps, const StepProfile* profile) {
  std::int64_t done = 0;
  while ((profile ? profile->steps : done) < steps) {
    const std::int64_t kept = profile ? profile->steps : 0;
    const std::int64_t want = steps - (profile ? profile->steps : done);
    const std::size_t ran = trainer.train_steps(epoch++, want).size();
    done += static_cast<std::int64_t>(ran);
    if (ran == 0 || (profile && profile->steps == kept))
      throw ConfigError(fmt::format("{}: an epoch has no step of a full global batch ({}) to time; use a smaller batch",
                                    trainer.experiment().source_file, trainer.global_batch_size()));
  }
}

Spread spread(std::span<const double> per_worker) {
  Spread s;
  for (double v : per_worker) s.mean += v;
  s.mean /= static_cast<double>(per_worker.size());
  s.max = *std::max_element(per_worker.begin(), per_worker.end());
  return s;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const auto middle = values.begin() + static_cast<std::ptrdiff_t>(values.size() / 2);
  std::nth_element(values.begin(), middle, values.end());
  return *middle;
}

double gflops_of(double flops_per_sample, double samples, double milliseconds) {
  return milliseconds > 0.0 ? flops_per_sample * samples / (milliseconds * 1e-3) * 1e-9 : 0.0;
}

// The bytes one sample makes a layer move, each once (see bench.hpp): forward reads the input and
// writes the output, backward reads the output's gradient, what it needs of the forward pass (the
// input or the output, Layer::backward_reads; the output too for the derivative of an activation
// it applies itself, Layer::activation_reads_output) and, where it computes it, writes the input's, in
// the compute dtype. Its variables are read once forward and read, and their gradients written,
// once backward: once per step, so a share of `batch` per sample.
double variable_bytes(const nn::Layer& layer) {
  double bytes = 0.0;
  for (const Variable& v : layer.variables()) bytes += static_cast<double>(v.value.bytes());
  return bytes;
}

// FLOPs per sample of a layer's backward as training runs it.
double backward_flops(const LayerBench& l) {
  return l.flops.backward_weights + (l.backward_data ? l.flops.backward_data : 0.0);
}

// `derivative_above`: the layer above applies this layer's activation's derivative.
std::pair<double, double> layer_bytes(const nn::Layer& layer, bool backward_data, bool derivative_above,
                                      std::size_t activation_bytes, double batch) {
  const double in = static_cast<double>(layer.input_shape().numel() * static_cast<std::int64_t>(activation_bytes));
  const double out = static_cast<double>(layer.output_shape().numel() * static_cast<std::int64_t>(activation_bytes));
  const double variables = variable_bytes(layer);
  const nn::Layer::BackwardReads reads = layer.backward_reads();
  double saved = reads == nn::Layer::BackwardReads::input ? in : reads == nn::Layer::BackwardReads::output ? out : 0.0;
  if (layer.activation_reads_output() && !derivative_above) saved += out;
  return {in + out + variables / batch, out + saved + (backward_data ? in : 0.0) + 2.0 * variables / batch};
}

// What a layer's backward reads to apply the derivative of a relu below it (Layer::
// derivative_below_reads), per sample, where it is not already among layer_bytes' reads.
double derivative_bytes(const nn::Layer& layer, std::size_t activation_bytes) {
  const nn::Layer::BackwardReads reads = layer.derivative_below_reads();
  if (reads == nn::Layer::BackwardReads::nothing || reads == layer.backward_reads()) return 0.0;
  const Shape& shape = reads == nn::Layer::BackwardReads::input ? layer.input_shape() : layer.output_shape();
  return static_cast<double>(shape.numel() * static_cast<std::int64_t>(activation_bytes));
}

// JSON numbers: finite, or null.
std::string num(double v) { return std::isfinite(v) ? fmt::format("{}", v) : "null"; }
std::string json_spread(const Spread& s) { return fmt::format("{{\"mean\": {}, \"max\": {}}}", num(s.mean), num(s.max)); }
std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace

BenchReport run_bench(Trainer& trainer, const BenchOptions& options) {
  if (options.steps < 1) throw ConfigError("dtrain bench: --steps must be at least 1");
  if (options.warmup < 0) throw ConfigError("dtrain bench: --warmup must not be negative");
  distribute::Strategy& strategy = trainer.strategy();
  const config::Experiment& exp = trainer.experiment();
  std::int64_t epoch = 0;
  run_steps(trainer, epoch, options.warmup, nullptr);
  StepProfile profile;
  trainer.set_profile(&profile);
  run_steps(trainer, epoch, options.steps, &profile);
  trainer.set_profile(nullptr);

  // Every worker measures its cores' GEMM peak at the same time, as they trained together: first
  // a sweep that picks the matmul size, then that size again after each round of whole steps.
  BenchReport r;
  r.threads = train::resolve_threads(exp.train.threads);
  const DType dtype = nn::compute_dtype(exp.precision);
  r.compute_dtype = dtype_name(dtype);
  device::Context& ctx = trainer.model(0).context();
  strategy.all_reduce_max(0, "bench: start of the GEMM peak");
  r.peak = device::measure_gemm_peak(ctx, dtype, r.threads);
  if (dtype != DType::f32 && r.peak.available) r.float32_peak = device::measure_gemm_peak(ctx, DType::f32, r.threads);
  r.bandwidth = device::measure_copy_bandwidth(ctx, r.threads);

  // Then whole steps alone: a GPU's step is mostly launches, and timing each layer waits for the
  // device between them (the layers' figures above include those waits). In rounds, each followed
  // by the GEMM peak: the shared machines' speed wanders by 20-30 % within seconds (a register-only
  // FMA loop on the 2-core AVX2 EPYC: 1.9 to 2.8 ms for the same work), and a peak measured once,
  // after the steps, put the same build's "training reaches" anywhere from 57 to 105 %. A round's
  // steps and the peak right after them share the machine's state; the fraction is the median of
  // the rounds' ratios.
  StepProfile whole_steps;
  r.rounds = static_cast<int>(std::min<std::int64_t>(kPeakRounds, options.steps));
  r.round_warmup_steps = std::min(kRoundWarmupSteps, options.warmup);
  std::vector<double> round_step_s, round_peak;
  for (int round = 0; round < r.rounds; ++round) {
    run_steps(trainer, epoch, r.round_warmup_steps, nullptr);
    const double seconds_before = whole_steps.step_seconds;
    const std::int64_t steps_before = whole_steps.steps;
    trainer.set_profile(&whole_steps, false);
    run_steps(trainer, epoch, options.steps * (round + 1) / r.rounds, &whole_steps);
    trainer.set_profile(nullptr);
    round_step_s.push_back((whole_steps.step_seconds - seconds_before) /
                           static_cast<double>(whole_steps.steps - steps_before));
    strategy.all_reduce_max(0, "bench: a round's GEMM peak");  // every worker, with a peak or not
    if (!r.peak.available) continue;
    round_peak.push_back(device::measure_gemm_peak(ctx, dtype, r.threads, r.peak.size).gflops);
  }

  // This worker's figures (per step, in ms), then every worker's.
  nn::Sequential& model = trainer.model(0);
  const std::size_t layers = model.num_layers();
  const double steps = static_cast<double>(profile.steps);
  std::vector<double> mine;
  mine.push_back(1e3 * profile.step_seconds / steps);
  for (double s : profile.seconds) mine.push_back(1e3 * s / steps);
  for (std::size_t i = 0; i < layers; ++i) mine.push_back(1e3 * profile.layers.forward[i] / steps);
  for (std::size_t i = 0; i < layers; ++i) mine.push_back(1e3 * profile.layers.backward[i] / steps);
  for (std::size_t i = 0; i < layers; ++i) mine.push_back(1e3 * profile.layers.backward_weights[i] / steps);
  for (std::size_t i = 0; i < layers; ++i)
    mine.push_back(1e3 * (profile.layers.backward[i] - profile.layers.backward_weights[i]) / steps);
  for (std::size_t i = 0; i < layers; ++i) mine.push_back(1e3 * profile.layers.forward_waits[i] / steps);
  for (std::size_t i = 0; i < layers; ++i) mine.push_back(1e3 * profile.layers.backward_waits[i] / steps);
  mine.push_back(1e3 * whole_steps.step_seconds / static_cast<double>(whole_steps.steps));
  mine.push_back(r.bandwidth.available ? r.bandwidth.gb_per_s : 0.0);
  mine.push_back(median(round_peak));
  const std::size_t k = mine.size();
  const auto workers = static_cast<std::size_t>(strategy.workers());
  std::vector<double> all(k * workers, 0.0);
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(k * static_cast<std::size_t>(strategy.worker_index())));
  strategy.all_reduce_sum(std::span<double>(all), "bench figures");
  auto figure = [&](std::size_t index) {
    std::vector<double> column(workers);
    for (std::size_t w = 0; w < workers; ++w) column[w] = all[w * k + index];
    return spread(column);
  };

  r.header = trainer.header_line();
  r.workers = strategy.workers();
  r.replicas_in_sync = strategy.num_replicas_in_sync();
  r.global_batch = profile.samples / profile.steps;
  r.replica_batch = r.global_batch / r.replicas_in_sync;
  r.warmup_steps = options.warmup;
  r.steps = profile.steps;
  r.steps_left_out = profile.steps_left_out;
  r.step_ms = figure(0);
  std::vector<double> sums(workers, 0.0);
  for (std::size_t p = 0; p < kPhases; ++p) {
    r.phase_ms[p] = figure(1 + p);
    for (std::size_t w = 0; w < workers; ++w) sums[w] += all[w * k + 1 + p];
  }
  r.phase_sum_ms = spread(sums);
  // Per replica: the layers of replica 0 computed its share of the global batch.
  const double replica_samples = static_cast<double>(r.global_batch) / r.replicas_in_sync;
  // While replica 0 ran a layer, the worker's cores (what the peak and the bandwidth measured) ran
  // it for each of the worker's replicas.
  const double worker_samples = replica_samples * r.replicas_in_sync / r.workers;
  r.peak_gflops = figure(k - 1);
  r.bandwidth_gb_per_s = figure(k - 2);
  const double peak_gflops = r.peak.available ? r.peak_gflops.mean : 0.0;
  const double bandwidth = r.bandwidth.available ? r.bandwidth_gb_per_s.mean : 0.0;
  // ms per step at the peak and at the bandwidth; the longer is the bound.
  const auto bound = [&](double flops, double bytes, bool& memory_bound) {
    const double compute = peak_gflops > 0.0 ? flops * worker_samples / (peak_gflops * 1e6) : 0.0;
    const double moving = bandwidth > 0.0 ? bytes * worker_samples / (bandwidth * 1e6) : 0.0;
    memory_bound = moving > compute;
    return std::max(compute, moving);
  };
  for (std::size_t i = 0; i < layers; ++i) {
    const nn::Layer& layer = model.layer(i);
    LayerBench l;
    l.name = layer.name();
    l.kind = std::string(layer.kind());
    // Its time is in the computing layer's figures (and its bound is not).
    const bool computed = model.computed_by_layer_below(i);
    if (computed) l.computed_in = model.layer(model.computing_layer(i)).name();
    l.forward_ms = figure(1 + kPhases + i);
    l.backward_ms = figure(1 + kPhases + layers + i);
    l.split = profile.layers.split[i] != 0;
    if (l.split) {
      l.backward_weights_ms = figure(1 + kPhases + 2 * layers + i);
      l.backward_data_ms = figure(1 + kPhases + 3 * layers + i);
    }
    l.forward_wait_ms = figure(1 + kPhases + 4 * layers + i);
    l.backward_wait_ms = figure(1 + kPhases + 5 * layers + i);
    l.flops = layer.flops_per_sample();
    // The softmax or sigmoid the model computes after the last layer (for a crossentropy that reads
    // its input) is timed with the layer it came from: its FLOPs and bytes go there too. It runs
    // forward only (the loss's gradient is its input's) and in float32.
    const nn::Layer* output_activation =
        i == model.output_activation_from() ? model.output_activation_layer() : nullptr;
    if (output_activation) l.flops.forward += output_activation->flops_per_sample().forward;
    l.backward_data = model.computes_input_gradient(i);  // training never needs d(loss)/d(input)
    const double backward = backward_flops(l);
    l.forward_gflops = gflops_of(l.flops.forward, replica_samples, l.forward_ms.mean);
    l.backward_gflops = gflops_of(backward, replica_samples, l.backward_ms.mean);
    std::tie(l.forward_bytes, l.backward_bytes) =
        layer_bytes(layer, l.backward_data, i + 1 < layers && model.applies_activation_backward_below(i + 1),
                    dtype_size(dtype), static_cast<double>(r.replica_batch));
    // A relu's derivative applied here (by the layer above it) moves its bytes in this backward;
    // a layer whose backward is then the identity (the relu's) moves none and has no bound ('-'),
    // nor one whose forward the layer below applies.
    if (model.applies_activation_backward_below(i)) l.backward_bytes += derivative_bytes(layer, dtype_size(dtype));
    const double activation_bytes =
        output_activation
            ? layer_bytes(*output_activation, false, false, sizeof(float), static_cast<double>(r.replica_batch)).first
            : 0.0;
    l.forward_bytes += activation_bytes;
    l.forward_bound_ms = bound(l.flops.forward, l.forward_bytes, l.forward_memory_bound);
    l.backward_bound_ms = bound(backward, l.backward_bytes, l.backward_memory_bound);
    if (model.forward_moves_nothing(i)) {
      l.forward_bytes = activation_bytes;
      l.forward_bound_ms = activation_bytes > 0.0 ? bound(l.flops.forward, activation_bytes, l.forward_memory_bound) : 0.0;
    }
    if (model.backward_moves_nothing(i) || !model.backward_runs(i)) l.backward_bytes = l.backward_bound_ms = 0.0;
    r.flops_per_sample += l.flops.forward + backward;
    if (computed) {
      // The computing layer moves only its input, this layer's output (and which window position
      // won, a byte per element), the output's gradient, its variables and, where it computes it,
      // its input's gradient: the pair's bound goes on its row, this one's times and bound are in
      // it (and a relu Activation between them moves nothing).
      const std::size_t at = model.computing_layer(i);
      LayerBench& below = r.layers[at];
      const nn::Layer& computing = model.layer(at);
      // What the computing layer reads and writes: its input in the compute dtype, its output
      // (the pooled one) in float32 for batch normalization, which computes in float32.
      const double size = static_cast<double>(dtype_size(dtype));
      const double out_size = computing.kind() == "batch_normalization" ? 4.0 : size;
      const double in = static_cast<double>(computing.input_shape().numel()) * size;
      const double pooled = static_cast<double>(layer.output_shape().numel());
      const double per_sample = variable_bytes(computing) / static_cast<double>(r.replica_batch);
      below.forward_bytes = in + pooled * (out_size + 1.0) + per_sample;
      // Backward: x, the pooled gradient and the winner (which also holds the relu's derivative).
      below.backward_bytes = in + pooled * (out_size + 1.0) + (below.backward_data ? in : 0.0) + 2.0 * per_sample;
      below.forward_bound_ms =
          bound(below.flops.forward + l.flops.forward, below.forward_bytes, below.forward_memory_bound);
      below.backward_bound_ms =
          bound(backward_flops(below) + backward, below.backward_bytes, below.backward_memory_bound);
      l.forward_bytes = l.backward_bytes = l.forward_bound_ms = l.backward_bound_ms = 0.0;
    }
    r.layers.push_back(std::move(l));
  }
  r.samples_per_s = static_cast<double>(r.global_batch) / (r.step_ms.mean * 1e-3);
  r.untimed_step_ms = figure(k - 3);
  r.untimed_samples_per_s = static_cast<double>(r.global_batch) / (r.untimed_step_ms.mean * 1e-3);
  r.gflops = r.flops_per_sample * r.samples_per_s * 1e-9;
  r.untimed_gflops = r.flops_per_sample * r.untimed_samples_per_s * 1e-9;
  if (r.peak.available) {
    r.peak_gflops_total = r.peak_gflops.mean * r.workers;
    // Each worker's rounds: its share of the job's FLOPs per second against its own peak then.
    std::vector<double> ratios;
    for (std::size_t i = 0; i < round_peak.size(); ++i) {
      ratios.push_back(r.flops_per_sample * worker_samples / round_step_s[i] * 1e-9 / round_peak[i]);
      r.peak_rounds.push_back({1e3 * round_step_s[i], round_peak[i], ratios.back()});
    }
    std::vector<double> fractions(workers, 0.0);
    fractions[static_cast<std::size_t>(strategy.worker_index())] = median(ratios);
    strategy.all_reduce_sum(std::span<double>(fractions), "bench: the workers' fractions of their peaks");
    r.peak_fraction = spread(fractions).mean;
  }
  return r;
}

std::string bench_table(const BenchReport& r) {
  const bool many = r.workers > 1;
  // One worker: the figure; several: mean/max over the workers.
  auto ms = [many](const Spread& s) { return many ? fmt::format("{:.3f}/{:.3f}", s.mean, s.max) : fmt::format("{:.3f}", s.mean); };
  std::string out = fmt::format("timed {} steps after {} warm-up steps: global batch {} ({} per replica), compute {}{}{}\n",
                     r.steps, r.warmup_steps, r.global_batch, r.replica_batch, r.compute_dtype,
                     r.steps_left_out ? fmt::format(", {} short last batch(es) run but not timed", r.steps_left_out) : "",
                     many ? fmt::format("; times are mean/max over {} workers", r.workers) : "");
  std::size_t name_width = 12, kind_width = 10;
  const auto kind_of = [](const LayerBench& l) {
    return l.computed_in.empty() ? l.kind : l.kind + " in " + l.computed_in;
  };
  for (const LayerBench& l : r.layers) {
    name_width = std::max(name_width, l.name.size() + 2);
    kind_width = std::max(kind_width, kind_of(l).size() + 2);
  }
  const int w = many ? 17 : 13;
  out += fmt::format("\n{:<{}}{:<{}}{:>{}}{:>{}}{:>{}}{:>{}}{:>12}{:>12}{:>12}{:>12}\n", "layer", name_width, "kind",
                     kind_width, "forward ms", w, "backward ms", w, "weights ms", w, "input ms", w, "fwd MFLOP",
                     "bwd MFLOP", "fwd GFLOP/s", "bwd GFLOP/s");
  Spread fwd_total, bwd_total;
  double fwd_flops = 0.0, bwd_flops = 0.0;
  for (const LayerBench& l : r.layers) {
    const double backward = backward_flops(l);
    out += fmt::format("{:<{}}{:<{}}{:>{}}{:>{}}{:>{}}{:>{}}{:>12.3f}{:>12.3f}{:>12.1f}{:>12.1f}\n", l.name, name_width,
                       kind_of(l), kind_width, ms(l.forward_ms), w, ms(l.backward_ms), w,
                       l.split ? ms(l.backward_weights_ms) : "-", w, l.split ? ms(l.backward_data_ms) : "-", w,
                       l.flops.forward * 1e-6, backward * 1e-6, l.forward_gflops, l.backward_gflops);
    fwd_total.mean += l.forward_ms.mean;
    fwd_total.max += l.forward_ms.max;
    bwd_total.mean += l.backward_ms.mean;
    bwd_total.max += l.backward_ms.max;
    fwd_flops += l.flops.forward;
    bwd_flops += backward;
  }
  out += fmt::format("{:<{}}{:>{}}{:>{}}{:>{}}{:>{}}{:>12.3f}{:>12.3f}\n", "all layers", name_width + kind_width,
                     ms(fwd_total), w, ms(bwd_total), w, "", w, "", w, fwd_flops * 1e-6, bwd_flops * 1e-6);
  out += "(backward = the gradients of the weights and, after the first layer, of the input; split into the two where\n"
         " the kernel marks the boundary, '-' where it computes them as one; MFLOP per sample; 'in <layer>': computed\n"
         " with that layer's output, its times counted there)\n";

  out += fmt::format("\n{:<14}{:>{}}{:>10}\n", "step phase", "ms/step", w, "share");
  auto share = [&](double v) { return fmt::format("{:.1f} %", 100.0 * v / r.step_ms.mean); };
  for (std::size_t p = 0; p < kPhases; ++p)
    out += fmt::format("{:<14}{:>{}}{:>10}\n", phase_name(static_cast<Phase>(p)), ms(r.phase_ms[p]), w,
                       share(r.phase_ms[p].mean));
  out += fmt::format("{:<14}{:>{}}{:>10}\n", "sum of phases", ms(r.phase_sum_ms), w, share(r.phase_sum_ms.mean));
  out += fmt::format("{:<14}{:>{}}{:>10}\n", "step (wall)", ms(r.step_ms), w, share(r.step_ms.mean));

  out += fmt::format("\nthroughput: {:.1f} samples/s x {:.3f} MFLOP/sample = {:.2f} GFLOP/s\n", r.samples_per_s,
                     r.flops_per_sample * 1e-6, r.gflops);
  out += fmt::format("untimed layers: {} ms/step, {:.1f} samples/s = {:.2f} GFLOP/s ({} more steps timed whole, as "
                     "training runs)\n",
                     ms(r.untimed_step_ms), r.untimed_samples_per_s, r.untimed_gflops, r.steps);
  if (!r.peak.available) {
    out += fmt::format("GEMM peak ({}): not available: {}\n", r.compute_dtype, r.peak.why_not);
  } else {
    const std::string per_worker =
        many ? fmt::format("{:.1f} (max {:.1f}) GFLOP/s per worker x {} workers = {:.1f} GFLOP/s", r.peak_gflops.mean,
                           r.peak_gflops.max, r.workers, r.peak_gflops_total)
             : fmt::format("{:.1f} GFLOP/s", r.peak_gflops_total);
    out += fmt::format("GEMM peak: {} at {}^3 on {} thread{} per worker: {}; training reaches {:.1f} % of it\n"
                       "  (the median of {} round{}: {} untimed step{}, whole steps, then the peak at once, so both see the machine alike)\n",
                       r.peak.what, r.peak.size, r.threads, r.threads == 1 ? "" : "s", per_worker,
                       100.0 * r.peak_fraction, r.rounds, r.rounds == 1 ? "" : "s", r.round_warmup_steps,
                       r.round_warmup_steps == 1 ? "" : "s");
    if (r.float32_peak.available) {
      // The two sweeps, one after the other: the rounds' medians above are the compute dtype's alone.
      const double ratio = r.float32_peak.gflops / r.peak.gflops;
      out += fmt::format("float32 GEMM peak on the same threads: {} at {}^3: {:.1f} GFLOP/s, {:.2f}x {}'s sweep "
                         "({:.1f}){}\n",
                         r.float32_peak.what, r.float32_peak.size, r.float32_peak.gflops, ratio, r.compute_dtype,
                         r.peak.gflops,
                         ratio > 1.0 ? fmt::format(": this CPU multiplies float32 faster than {}, so precision: float32 "
                                                   "may train faster here",
                                                   r.compute_dtype)
                                     : "");
    }
  }
  if (!r.bandwidth.available) {
    out += fmt::format("copy bandwidth: not available: {}\n", r.bandwidth.why_not);
  } else {
    out += fmt::format("copy bandwidth: {} on {} thread{} per worker: {} GB/s (bytes read + written)\n",
                       r.bandwidth.what, r.threads, r.threads == 1 ? "" : "s",
                       many ? fmt::format("{:.1f} (max {:.1f})", r.bandwidth_gb_per_s.mean, r.bandwidth_gb_per_s.max)
                            : fmt::format("{:.1f}", r.bandwidth_gb_per_s.mean));
  }
  if (!r.peak.available && !r.bandwidth.available) return out;

  // Each layer against its bound (bench.hpp): how far from what the machine allows it is.
  out += "\nlayers against their bounds: the longer of the FLOPs at the GEMM peak and the bytes at the copy\n"
         "bandwidth (x bound = the time over it; below 1 where the data stayed in the caches)\n";
  // Lanes that wait for each other inside a layer's sums: the layer's own time is what is left.
  double fwd_waits = 0.0, bwd_waits = 0.0;
  for (const LayerBench& l : r.layers) {
    fwd_waits += l.forward_wait_ms.mean;
    bwd_waits += l.backward_wait_ms.mean;
  }
  const bool waits = fwd_waits + bwd_waits > 0.0;
  out += fmt::format("{:<{}}{:>14}{:>8}{:>9}{:>14}{:>8}{:>9}{:>12}{:>12}{}\n", "layer", name_width, "fwd bound ms",
                     "by", "x bound", "bwd bound ms", "by", "x bound", "fwd KB", "bwd KB",
                     waits ? fmt::format("{:>11}{:>11}", "fwd wait", "bwd wait") : "");
  const auto times = [](double ms, double bound) { return bound > 0.0 ? fmt::format("{:.1f}", ms / bound) : "-"; };
  const auto by = [](bool memory) { return memory ? "memory" : "GEMM"; };
  const auto wait_columns = [&](double forward, double backward) {
    return waits ? fmt::format("{:>11.3f}{:>11.3f}", forward, backward) : std::string();
  };
  double fwd_bound = 0.0, bwd_bound = 0.0;
  const LayerBench* most_waited = nullptr;
  for (const LayerBench& l : r.layers) {
    out += fmt::format("{:<{}}{:>14.3f}{:>8}{:>9}{:>14.3f}{:>8}{:>9}{:>12.1f}{:>12.1f}{}\n", l.name, name_width,
                       l.forward_bound_ms, by(l.forward_memory_bound),
                       times(l.forward_ms.mean - l.forward_wait_ms.mean, l.forward_bound_ms), l.backward_bound_ms,
                       by(l.backward_memory_bound), times(l.backward_ms.mean - l.backward_wait_ms.mean, l.backward_bound_ms),
                       l.forward_bytes * 1e-3, l.backward_bytes * 1e-3,
                       wait_columns(l.forward_wait_ms.mean, l.backward_wait_ms.mean));
    fwd_bound += l.forward_bound_ms;
    bwd_bound += l.backward_bound_ms;
    const auto waited = [](const LayerBench* b) { return b->forward_wait_ms.mean + b->backward_wait_ms.mean; };
    if (!most_waited || waited(&l) > waited(most_waited)) most_waited = &l;
  }
  out += fmt::format("{:<{}}{:>14.3f}{:>8}{:>9}{:>14.3f}{:>8}{:>9}{:>12}{:>12}{}\n", "all layers", name_width, fwd_bound,
                     "", times(fwd_total.mean - fwd_waits, fwd_bound), bwd_bound, "",
                     times(bwd_total.mean - bwd_waits, bwd_bound), "", "", wait_columns(fwd_waits, bwd_waits));
  out += "(KB: the bytes per sample each direction must move: input and output, their gradients, what backward needs "
         "of forward, the variables;\n a layer computed in the one below has its FLOPs and bytes on that layer's row; a "
         "relu's derivative applied by the layer above moves its bytes there)\n";
  if (waits)
    out += fmt::format(
        "(wait: ms per step lane 0 spent in the layer's sums waiting for the replica's other lanes, {:.1f} % of the step,\n"
        " most in {}: the lanes' imbalance in the layers before it; x bound is the layer's time without it)\n",
        100.0 * (fwd_waits + bwd_waits) / r.step_ms.mean, most_waited->name);
  return out;
}

std::string bench_json(const BenchReport& r) {
  std::string out = "{\"schema\": \"dtrain.bench/1\"";
  out += fmt::format(", \"header\": {}, \"compute_dtype\": {}", json_string(r.header), json_string(r.compute_dtype));
  out += fmt::format(", \"workers\": {}, \"replicas_in_sync\": {}, \"threads\": {}", r.workers, r.replicas_in_sync, r.threads);
  out += fmt::format(", \"global_batch\": {}, \"replica_batch\": {}, \"warmup_steps\": {}, \"steps\": {}, \"steps_left_out\": {}",
                     r.global_batch, r.replica_batch, r.warmup_steps, r.steps, r.steps_left_out);
  out += fmt::format(", \"step_ms\": {}, \"phases_ms\": {{", json_spread(r.step_ms));
  for (std::size_t p = 0; p < kPhases; ++p)
    out += fmt::format("{}\"{}\": {}", p ? ", " : "", phase_name(static_cast<Phase>(p)), json_spread(r.phase_ms[p]));
  out += fmt::format("}}, \"phase_sum_ms\": {}, \"layers\": [", json_spread(r.phase_sum_ms));
  for (std::size_t i = 0; i < r.layers.size(); ++i) {
    const LayerBench& l = r.layers[i];
    out += fmt::format(
        "{}{{\"name\": {}, \"kind\": {}, \"computed_in\": {}, \"forward_ms\": {}, \"backward_ms\": {}, "
        "\"backward_weights_ms\": {}, "
        "\"backward_data_ms\": {}, \"flops_per_sample\": {{\"forward\": {}, \"backward_data\": {}, \"backward_weights\": {}}}, "
        "\"backward_computes_data\": {}, \"forward_gflops\": {}, \"backward_gflops\": {}, "
        "\"bytes_per_sample\": {{\"forward\": {}, \"backward\": {}}}, "
        "\"bound_ms\": {{\"forward\": {}, \"backward\": {}}}, \"bound_by\": {{\"forward\": \"{}\", \"backward\": \"{}\"}}, "
        "\"lane_wait_ms\": {{\"forward\": {}, \"backward\": {}}}}}",
        i ? ", " : "", json_string(l.name), json_string(l.kind),
        l.computed_in.empty() ? std::string("null") : json_string(l.computed_in), json_spread(l.forward_ms),
        json_spread(l.backward_ms),
        l.split ? json_spread(l.backward_weights_ms) : "null", l.split ? json_spread(l.backward_data_ms) : "null",
        num(l.flops.forward), num(l.flops.backward_data), num(l.flops.backward_weights), l.backward_data ? "true" : "false",
        num(l.forward_gflops), num(l.backward_gflops), num(l.forward_bytes), num(l.backward_bytes),
        num(l.forward_bound_ms), num(l.backward_bound_ms), l.forward_memory_bound ? "memory" : "gemm",
        l.backward_memory_bound ? "memory" : "gemm", json_spread(l.forward_wait_ms), json_spread(l.backward_wait_ms));
  }
  out += fmt::format("], \"samples_per_s\": {}, \"flops_per_sample\": {}, \"gflops\": {}", num(r.samples_per_s),
                     num(r.flops_per_sample), num(r.gflops));
  out += fmt::format(", \"untimed_step_ms\": {}, \"untimed_samples_per_s\": {}, \"untimed_gflops\": {}",
                     json_spread(r.untimed_step_ms), num(r.untimed_samples_per_s), num(r.untimed_gflops));
  out += fmt::format(", \"gemm_peak\": {{\"dtype\": {}, \"available\": {}", json_string(r.compute_dtype),
                     r.peak.available ? "true" : "false");
  if (r.peak.available)
    out += fmt::format(", \"what\": {}, \"size\": {}, \"gflops_per_worker\": {}, \"gflops\": {}, \"rounds\": {}, "
                       "\"round_warmup_steps\": {}, \"fraction\": {}",
                       json_string(r.peak.what), r.peak.size, json_spread(r.peak_gflops), num(r.peak_gflops_total),
                       r.rounds, r.round_warmup_steps, num(r.peak_fraction));
  if (r.peak.available) {
    out += ", \"worker_rounds\": [";
    for (std::size_t i = 0; i < r.peak_rounds.size(); ++i)
      out += fmt::format("{}{{\"step_ms\": {}, \"gflops\": {}, \"fraction\": {}}}", i ? ", " : "",
                         num(r.peak_rounds[i].step_ms), num(r.peak_rounds[i].peak_gflops), num(r.peak_rounds[i].fraction));
    out += "]";
  }
  else
    out += fmt::format(", \"why_not\": {}", json_string(r.peak.why_not));
  out += "}, \"float32_gemm_peak\": ";
  if (r.float32_peak.available)
    out += fmt::format("{{\"what\": {}, \"size\": {}, \"gflops\": {}, \"compute_dtype_sweep_gflops\": {}}}",
                       json_string(r.float32_peak.what), r.float32_peak.size, num(r.float32_peak.gflops),
                       num(r.peak.gflops));
  else
    out += "null";
  out += fmt::format(", \"copy_bandwidth\": {{\"available\": {}", r.bandwidth.available ? "true" : "false");
  if (r.bandwidth.available)
    out += fmt::format(", \"what\": {}, \"bytes\": {}, \"gb_per_s_per_worker\": {}", json_string(r.bandwidth.what),
                       r.bandwidth.bytes, json_spread(r.bandwidth_gb_per_s));
  else
    out += fmt::format(", \"why_not\": {}", json_string(r.bandwidth.why_not));
  return out + "}}\n";
}

}  // namespace dtrain::observe
