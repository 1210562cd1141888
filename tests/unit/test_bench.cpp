// dtrain bench's pieces: the step profile the trainer fills only while attached, the report and
// its figures, the GEMM peak in each compute dtype, the copy bandwidth and the layers' bounds.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <string>
#include <thread>

#include "device/gemm_peak.hpp"
#include "backends/onednn/context.hpp"
#include "nn/batch_normalization.hpp"
#include "nn/dense.hpp"
#include "nn/reshape.hpp"
#include "nn/kernel.hpp"
#include "nn/model.hpp"
#include "nn/registry.hpp"
#include "test_support.hpp"
#include "observe/bench.hpp"
#include "trainer_support.hpp"

using namespace dtrain;

namespace {

// 10 training samples in global batches of 4: steps of 4, 4 and a short one of 2.
const std::string kExperiment = R"(
name: bench_probe
seed: 3
data: {source: synthetic, shape: [8, 8, 1], classes: 3, train_size: 10, test_size: 4, global_batch_size: 4, shuffle_buffer: 10, prefetch: false}
model:
  input_shape: [8, 8, 1]
  layers:
    - conv2d: {filters: 4, kernel_size: 3, activation: relu}
    - max_pool2d: {pool_size: 2}
    - flatten: {}
    - dense: {units: 3}
loss: {kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}
optimizer: {kind: sgd, learning_rate: 0.1}
metrics: [sparse_categorical_accuracy]
train: {epochs: 1, threads: 1}
)";

// The identity, whose backward takes 2 ms for its "weights" and 1 ms for its input, and marks the
// boundary as a kernel with both gradients does (nn::BackwardMarks): weights first, or with
// input_first_probe the input first, as the CPU convolutions with their own weight loops do.
struct SplitProbeOptions {
  static constexpr std::string_view kind = "split_probe";
  bool operator==(const SplitProbeOptions&) const = default;
};
struct InputFirstProbeOptions {
  static constexpr std::string_view kind = "input_first_probe";
  bool operator==(const InputFirstProbeOptions&) const = default;
};

using SplitProbe = testing::IdentityLayer<SplitProbeOptions>;
using InputFirstProbe = testing::IdentityLayer<InputFirstProbeOptions>;

class SplitProbeKernel final : public nn::LayerKernel {
 public:
  explicit SplitProbeKernel(bool input_first) : input_first_(input_first) {}
  device::LayoutPtr plan(std::int64_t, const device::LayoutPtr& src) override { return src; }
  void bind(std::int64_t, const nn::LayerIO& io) override { io_ = io; }
  void forward(std::int64_t, const nn::StepContext&) override {
    std::memcpy(io_.dst.data, io_.src.data, io_.src.layout->bytes());
  }
  void backward(std::int64_t, const nn::StepContext& step) override {
    if (input_first_) {
      input(step);
      weights(step);
    } else {
      weights(step);
      input(step);
    }
  }

 private:
  void weights(const nn::StepContext& step) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (step.backward_marks && !input_first_) step.backward_marks->weights_done();
  }
  void input(const nn::StepContext& step) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::memcpy(io_.diff_src.data, io_.diff_dst.data, io_.dst.layout->bytes());
    if (step.backward_marks && input_first_) step.backward_marks->input_done();
  }

  bool input_first_;
  nn::LayerIO io_;
};

config::LayerOptions parse_probe(const config::Section&) { return SplitProbeOptions{}; }
config::LayerOptions parse_input_first_probe(const config::Section&) { return InputFirstProbeOptions{}; }
void write_probe(const config::LayerOptions&, config::OptionsWriter&) {}
std::unique_ptr<nn::LayerKernel> make_probe_kernel(nn::Layer&, device::Context&, DType) {
  return std::make_unique<SplitProbeKernel>(false);
}
std::unique_ptr<nn::LayerKernel> make_input_first_probe_kernel(nn::Layer&, device::Context&, DType) {
  return std::make_unique<SplitProbeKernel>(true);
}
const nn::LayerRegistration<SplitProbe> split_probe_layer({.kind = "split_probe", .aliases = {}, .auto_name = "split_probe",
                                                           .keys = {}, .parse = &parse_probe, .write = &write_probe});
const nn::KernelRegistration split_probe_kernel(backends::onednn::kName, "split_probe", &make_probe_kernel);
const nn::LayerRegistration<InputFirstProbe> input_first_probe_layer(
    {.kind = "input_first_probe", .aliases = {}, .auto_name = "input_first_probe", .keys = {},
     .parse = &parse_input_first_probe, .write = &write_probe});
const nn::KernelRegistration input_first_probe_kernel(backends::onednn::kName, "input_first_probe",
                                                      &make_input_first_probe_kernel);

double sum(const std::array<double, train::kPhases>& a) { return std::accumulate(a.begin(), a.end(), 0.0); }

}  // namespace

TEST_CASE("a profile attached is filled by the steps; short batches are left out; detached, nothing is touched") {
  auto trainer = testing::make_trainer(kExperiment);
  observe::StepProfile profile;
  trainer->set_profile(&profile);
  trainer->train_steps(0, 3);  // 4, 4, then the short 2
  CHECK(profile.steps == 2);
  CHECK(profile.steps_left_out == 1);
  CHECK(profile.samples == 8);
  for (auto phase : {train::Phase::forward, train::Phase::loss, train::Phase::backward, train::Phase::optimizer})
    CHECK(profile.seconds[static_cast<std::size_t>(phase)] > 0.0);
  CHECK(sum(profile.seconds) <= profile.step_seconds);
  REQUIRE(profile.layers.forward.size() == 4);
  REQUIRE(profile.layers.backward.size() == 4);
  const double layers_forward = std::accumulate(profile.layers.forward.begin(), profile.layers.forward.end(), 0.0);
  CHECK(layers_forward > 0.0);
  CHECK(layers_forward <= profile.seconds[static_cast<std::size_t>(train::Phase::forward)]);

  trainer->set_profile(nullptr);
  const observe::StepProfile before = profile;
  trainer->train_steps(1, 3);
  CHECK(profile.steps == before.steps);
  CHECK(profile.seconds == before.seconds);
  CHECK(profile.layers.forward == before.layers.forward);
  CHECK(profile.layers.backward == before.layers.backward);
}

TEST_CASE("run_bench: the timed steps, the layers' FLOPs adding up, the phases within the step, the JSON") {
  auto trainer = testing::make_trainer(kExperiment);
  observe::BenchOptions options;
  options.warmup = 1;
  options.steps = 3;  // two epochs: each one's short last batch is left out
  const observe::BenchReport r = observe::run_bench(*trainer, options);
  CHECK(r.steps == 3);
  CHECK(r.steps_left_out >= 1);
  CHECK(r.global_batch == 4);
  CHECK(r.workers == 1);
  REQUIRE(r.layers.size() == 4);
  CHECK(r.layers[0].name == "conv2d");
  CHECK_FALSE(r.layers[0].backward_data);
  CHECK(r.layers[3].backward_data);
  double flops = 0.0;
  for (const auto& l : r.layers) flops += l.flops.forward + l.flops.backward_weights + (l.backward_data ? l.flops.backward_data : 0.0);
  CHECK(r.flops_per_sample == doctest::Approx(flops));
  // conv2d: 6x6x4 outputs of 9 multiply-adds, bias and relu; no input gradient.
  CHECK(r.layers[0].flops.forward == 2.0 * 144 * 9 + 144 + 144);
  double phases = 0.0;
  for (const auto& p : r.phase_ms) phases += p.mean;
  CHECK(phases == doctest::Approx(r.phase_sum_ms.mean));
  CHECK(r.phase_sum_ms.mean <= r.step_ms.mean);
  CHECK(r.samples_per_s == doctest::Approx(4.0 / (r.step_ms.mean * 1e-3)));
  REQUIRE(r.peak.available);
  CHECK(r.peak.gflops > 0.0);
  CHECK(r.untimed_gflops == doctest::Approx(r.flops_per_sample * r.untimed_samples_per_s * 1e-9));
  // Three rounds of one whole step, each followed by the peak at the sweep's size: the fraction is
  // the median of the rounds' ratios, the peak the median of their peaks.
  REQUIRE(r.rounds == 3);
  REQUIRE(r.peak_rounds.size() == 3);
  CHECK(r.round_warmup_steps == 1);  // 3 at most, and no more than --warmup
  std::vector<double> fractions, peaks;
  double round_ms = 0.0;
  for (const auto& round : r.peak_rounds) {
    CHECK(round.peak_gflops > 0.0);
    CHECK(round.fraction == doctest::Approx(r.flops_per_sample * 4.0 / (round.step_ms * 1e-3) * 1e-9 / round.peak_gflops));
    fractions.push_back(round.fraction);
    peaks.push_back(round.peak_gflops);
    round_ms += round.step_ms;
  }
  std::sort(fractions.begin(), fractions.end());
  std::sort(peaks.begin(), peaks.end());
  CHECK(r.peak_fraction == doctest::Approx(fractions[1]));
  CHECK(r.peak_gflops.mean == doctest::Approx(peaks[1]));
  CHECK(r.untimed_step_ms.mean == doctest::Approx(round_ms / 3.0));
  // The bytes each direction must move per sample (f32; variables once per step of 4 samples):
  // conv2d 8x8x1 in, 6x6x4 out, 40 weights, no input gradient, its kernel's gradient reading the
  // input; the pooling 6x6x4 in, 3x3x4 out, and in backward nothing more for the derivative of
  // the convolution's relu, which it applies: forward marked a max not above zero as no winner.
  REQUIRE(trainer->model(0).applies_activation_backward_below(1));
  CHECK(r.layers[0].forward_bytes == doctest::Approx((64 + 144) * 4 + 40 * 4 / 4.0));
  CHECK(r.layers[0].backward_bytes == doctest::Approx((144 + 64) * 4 + 2 * 40 * 4 / 4.0));
  CHECK(r.layers[1].forward_bytes == doctest::Approx((144 + 36) * 4));
  CHECK(r.layers[1].backward_bytes == doctest::Approx((36 + 144) * 4));
  // Each bound is the longer of the FLOPs at the peak and the bytes at the bandwidth, for the
  // 4 samples of the step; a pooling's few compares make it memory-bound.
  REQUIRE(r.bandwidth.available);
  CHECK(r.bandwidth_gb_per_s.mean > 0.0);
  for (const auto& l : r.layers) {
    const double backward = l.flops.backward_weights + (l.backward_data ? l.flops.backward_data : 0.0);
    const auto bound = [&](double flops, double bytes) {
      return std::max(flops * 4 / (r.peak_gflops.mean * 1e6), bytes * 4 / (r.bandwidth_gb_per_s.mean * 1e6));
    };
    CHECK(l.forward_bound_ms == doctest::Approx(bound(l.flops.forward, l.forward_bytes)));
    CHECK(l.backward_bound_ms == doctest::Approx(bound(backward, l.backward_bytes)));
  }
  CHECK(r.layers[1].forward_memory_bound);
  CHECK(r.layers[1].backward_memory_bound);
  const std::string json = observe::bench_json(r);
  CHECK(json.starts_with("{\"schema\": \"dtrain.bench/1\""));
  CHECK(json.find("\"reduction\": {\"mean\": ") != std::string::npos);
  CHECK(json.find("\"bound_by\": {\"forward\": \"memory\", \"backward\": \"memory\"}") != std::string::npos);
  CHECK(json.find("\"copy_bandwidth\": {\"available\": true, \"what\": \"memcpy of ") != std::string::npos);
  CHECK(json.find("\"float32_gemm_peak\": null, ") != std::string::npos);  // float32 computes: nothing to compare
  CHECK(json.ends_with("}}\n"));
  const std::string table = observe::bench_table(r);
  CHECK(table.find("sum of phases") != std::string::npos);
  CHECK(table.find("GEMM peak: oneDNN matmul f32 x f32 -> f32") != std::string::npos);
  CHECK(table.find("copy bandwidth: memcpy of ") != std::string::npos);
  CHECK(table.find("layers against their bounds") != std::string::npos);
  CHECK(table.find("x bound") != std::string::npos);
}

TEST_CASE("the copy bandwidth: a copy larger than the caches, bytes read and written") {
  const device::CopyBandwidth b = device::measure_copy_bandwidth(testing::cpu(), 1);
  REQUIRE(b.available);
  CHECK(b.gb_per_s > 0.0);
  CHECK(b.bytes >= std::int64_t{128} << 20);
  CHECK(b.what.starts_with("memcpy of "));
}

TEST_CASE("the GEMM peak in each compute dtype, or why there is none") {
  device::Context& ctx = testing::cpu();
  const device::GemmPeak bf16 = device::measure_gemm_peak(ctx, DType::bf16, 1);
  if (bf16.available) {
    CHECK(bf16.gflops > 0.0);
    CHECK(bf16.what == "oneDNN matmul bf16 x bf16 -> f32");
  } else {
    CHECK((bf16.why_not.find("no bfloat16 instructions") != std::string::npos ||
           bf16.why_not.find("oneDNN is capped to isa") != std::string::npos));
  }
  if (bf16.available) {
    // Under bfloat16 the bench also sweeps float32 on the same threads, and says which is faster.
    auto trainer = testing::make_trainer(kExperiment, {"precision=mixed_bfloat16", "train.threads=1"});
    observe::BenchOptions options;
    options.warmup = 1;
    options.steps = 1;
    const observe::BenchReport r = observe::run_bench(*trainer, options);
    REQUIRE(r.float32_peak.available);
    CHECK(r.float32_peak.what == "oneDNN matmul f32 x f32 -> f32");
    CHECK(r.float32_peak.gflops > 0.0);
    const std::string table = observe::bench_table(r);
    CHECK(table.find("float32 GEMM peak on the same threads: oneDNN matmul f32 x f32 -> f32 at ") != std::string::npos);
    CHECK((table.find("may train faster here") != std::string::npos) == (r.float32_peak.gflops > r.peak.gflops));
    CHECK(observe::bench_json(r).find("\"float32_gemm_peak\": {\"what\": \"oneDNN matmul f32 x f32 -> f32\"") !=
          std::string::npos);
  }
  const device::GemmPeak i32 = device::measure_gemm_peak(ctx, DType::i32, 1);
  CHECK_FALSE(i32.available);
  CHECK_FALSE(i32.why_not.empty());
}

TEST_CASE("under mirrored replicas replica 0's thread times the phases, read after the step") {
  auto trainer = testing::make_trainer(kExperiment, {"strategy={kind: mirrored, devices: [cpu:0, cpu:1]}", "train.threads=2"});
  observe::StepProfile profile;
  trainer->set_profile(&profile);
  trainer->train_steps(0, 2);
  trainer->set_profile(nullptr);
  CHECK(profile.steps == 2);
  CHECK(profile.samples == 8);
  CHECK(profile.seconds[static_cast<std::size_t>(train::Phase::reduction)] > 0.0);
  CHECK(sum(profile.seconds) <= profile.step_seconds);
  CHECK(profile.layers.backward.size() == 4);
}

TEST_CASE("a kernel that marks the end of one of its two gradients gets its backward split in two") {
  std::string yaml = kExperiment;
  const std::string dense = "    - dense: {units: 3}\n";
  REQUIRE(yaml.find(dense) != std::string::npos);
  yaml.replace(yaml.find(dense), dense.size(),
               "    - dense: {units: 6}\n    - split_probe: {}\n    - input_first_probe: {}\n" + dense);
  auto trainer = testing::make_trainer(yaml);
  observe::BenchOptions options;
  options.warmup = 1;
  options.steps = 2;
  const observe::BenchReport r = observe::run_bench(*trainer, options);
  REQUIRE(r.layers.size() == 7);
  for (std::size_t i : {std::size_t{4}, std::size_t{5}}) {
    const observe::LayerBench& probe = r.layers[i];
    CAPTURE(probe.kind);
    CHECK(probe.kind == (i == 4 ? "split_probe" : "input_first_probe"));
    REQUIRE(probe.split);
    CHECK(probe.backward_weights_ms.mean >= 2.0);
    CHECK(probe.backward_data_ms.mean >= 1.0);
    CHECK(probe.backward_weights_ms.mean + probe.backward_data_ms.mean == doctest::Approx(probe.backward_ms.mean));
  }
  CHECK_FALSE(r.layers[1].split);  // pooling and flatten have no weights' gradients to mark
  CHECK_FALSE(r.layers[2].split);
  const std::string json = observe::bench_json(r);
  CHECK(json.find("\"kind\": \"split_probe\", \"computed_in\": null, \"forward_ms\"") != std::string::npos);
  CHECK(json.find("\"backward_weights_ms\": null") != std::string::npos);
  CHECK(json.find("\"backward_weights_ms\": {\"mean\": ") != std::string::npos);
}

TEST_CASE("a softmax the model computes after the last layer is counted on that layer's row") {
  // The crossentropy reads the softmax's input, so the dense layer is built linear and the model
  // applies the softmax after it, timed with the dense layer: its FLOPs and bytes go there too.
  // The second model has it in an Activation layer of its own, whose row is then the softmax's.
  for (const bool own_layer : {false, true}) {
    CAPTURE(own_layer);
    std::string yaml = kExperiment;
    const std::string dense = "    - dense: {units: 3}\n";
    yaml.replace(yaml.find(dense), dense.size(),
                 own_layer ? dense + "    - activation: {activation: softmax}\n"
                           : std::string("    - dense: {units: 3, activation: softmax}\n"));
    const std::string logits = "from_logits: true";
    yaml.replace(yaml.find(logits), logits.size(), "from_logits: false");
    auto trainer = testing::make_trainer(yaml);
    const nn::Sequential& model = trainer->model(0);
    REQUIRE(model.output_activation() == config::Activation::softmax);
    const std::size_t at = model.output_activation_from();
    CHECK(at == (own_layer ? 4u : 3u));
    observe::BenchOptions options;
    options.warmup = 1;
    options.steps = 2;
    const observe::BenchReport r = observe::run_bench(*trainer, options);
    const observe::LayerBench& row = r.layers[at];
    // 3 outputs: a dense layer of 3x3x4 inputs (2 x 108 multiply-adds and 3 biases), then 3 for the softmax.
    CHECK(row.flops.forward == (own_layer ? 3.0 : 2.0 * 108 + 3 + 3));
    // The dense layer reads 36 inputs and writes 3 outputs, and its 111 variables once per step of
    // 4; the Activation layer, built linear, copies its 3 inputs to its output. Then the softmax
    // reads those 3 and writes 3 probabilities (float32).
    const double softmax_bytes = (3 + 3) * 4;
    CHECK(row.forward_bytes ==
          doctest::Approx((own_layer ? (3 + 3) * 4 : (36 + 3) * 4 + 111 * 4 / 4.0) + softmax_bytes));
    CHECK(row.forward_bound_ms > 0.0);
    double flops = 0.0;
    for (const auto& l : r.layers) flops += l.flops.forward + l.flops.backward_weights + (l.backward_data ? l.flops.backward_data : 0.0);
    CHECK(r.flops_per_sample == doctest::Approx(flops));
  }
}

// Lanes that sum their batch statistics: a lane's sums report how long it waited for the others
// (nn::CrossReplica::waited_seconds). This one is a lane alone (a sum is its own values) whose
// every sum "waits" a quarter of a second, so that the waits the model charges are known exactly.
class QuarterSecondSums final : public nn::CrossReplica {
 public:
  void all_reduce_sum(std::span<double>, const char*) override { waited_ += 0.25; }
  double waited_seconds() const override { return waited_; }

 private:
  double waited_ = 0.0;
};

TEST_CASE("the layers' times: the waits in a layer's lane sums are charged to that layer, apart") {
  config::ModelConfig mc;
  mc.input_shape = {6, 6, 1};
  mc.layers.push_back(nn::layer_config("conv2d", testing::conv_options(2, 3, 1, config::Padding::valid,
                                                                        config::Activation::linear, false)));
  mc.layers.push_back(nn::layer_config("batch_normalization", nn::BatchNormalizationOptions{}));
  mc.layers.push_back(nn::layer_config("flatten", nn::FlattenOptions{}));
  nn::DenseOptions dense;
  dense.units = 3;
  mc.layers.push_back(nn::layer_config("dense", dense));
  nn::Sequential model(mc, 1, testing::cpu());
  nn::LayerTimes times;
  model.time_layers(&times);
  QuarterSecondSums lanes;
  nn::StepContext step = testing::step_of(nn::Mode::training, 4);
  step.lanes = &lanes;
  Tensor x(Shape{4, 6, 6, 1});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>(i % 7) - 3.0f;
  model.forward(x, step);
  Tensor& dy = model.output_gradient();
  for (std::int64_t i = 0; i < dy.numel(); ++i) dy.data<float>()[i] = 0.1f * static_cast<float>(i % 5);
  model.backward(step, {});
  // Forward sums the batch's mean, then its variance; backward the gradient's two sums, in one.
  CHECK(times.forward_waits == std::vector<double>{0.0, 0.5, 0.0, 0.0});
  CHECK(times.backward_waits == std::vector<double>{0.0, 0.25, 0.0, 0.0});
  // The waits were not spent (the sums returned at once): the layers' times are their own work.
  CHECK(times.forward[1] < 0.25);
  model.time_layers(nullptr);
}
