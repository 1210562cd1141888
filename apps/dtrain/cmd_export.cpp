#include <memory>

#include <fmt/format.h>

#include "checkpoint/checkpoint.hpp"
#include "commands.hpp"
#include "config/parse.hpp"
#include "core/atomic_file.hpp"
#include "core/error.hpp"
#include "device/context.hpp"
#include "interop/onnx_export.hpp"
#include "nn/model.hpp"

namespace dtrain::app {

int export_command(const ExportArgs& args) {
  // The model comes from the experiment stored in the checkpoint, unless one is given (as eval).
  const checkpoint::Contents stored = checkpoint::peek(args.checkpoint);
  const std::string source = args.experiment.empty() ? args.checkpoint + ":/experiment" : args.experiment;
  const config::Experiment exp = args.experiment.empty()
                                     ? config::parse_experiment(stored.experiment_yaml, source, args.overrides)
                                     : config::load_experiment(args.experiment, args.overrides);
  // The weights are float32 whatever precision trained them; the graph computes in float32.
  const std::unique_ptr<device::Context> cpu = device::make_context(Device{});
  std::unique_ptr<nn::Sequential> model;
  naming_source(source, [&] {
    model = std::make_unique<nn::Sequential>(exp.model, exp.seed, *cpu);
    return 0;
  });
  checkpoint::restore_model(args.checkpoint, *model);

  interop::OnnxExportOptions options;
  options.softmax = args.softmax;
  options.model_name = exp.name;
  options.doc = fmt::format("experiment {} from {} (epoch {}, step {} of it, global step {}), exported by dtrain {}",
                            exp.name, args.checkpoint, stored.state.epoch, stored.state.step_in_epoch,
                            stored.state.global_step, stored.dtrain_version);
  const std::string bytes = interop::export_onnx(*model, options);
  write_file_atomically(args.output, bytes);
  const auto batched = [](const Shape& per_example) {
    std::string text = "(N";
    for (std::int64_t d : per_example.dims()) text += fmt::format(", {}", d);
    return text + ")";
  };
  fmt::print("Exported {} (global step {}) to {}: input '{}' {} float32 channels last, output '{}' {}, ONNX opset {}\n",
             args.checkpoint, stored.state.global_step, args.output, interop::kOnnxInputName,
             batched(model->input_shape()), args.softmax ? interop::kOnnxProbabilitiesName
                                                                             : interop::kOnnxLogitsName,
             batched(model->output_shape()), interop::kOnnxOpset);
  return static_cast<int>(kOk);
}

}  // namespace dtrain::app
