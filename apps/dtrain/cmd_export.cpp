#include <memory>
#include <optional>

#include <fmt/format.h>

#include "checkpoint/checkpoint.hpp"
#include "commands.hpp"
#include "config/parse.hpp"
#include "core/atomic_file.hpp"
#include "core/error.hpp"
#include "device/context.hpp"
#include "interop/keras_weights.hpp"
#include "interop/onnx_export.hpp"
#include "nn/model.hpp"

namespace dtrain::app {

namespace {

// --softmax turns a softmax crossentropy's logits into its probabilities; on any other model the
// Softmax it appends would give numbers that are not (a one-output model's are all 1).
void check_softmax_fits(const config::Experiment& exp, const nn::Sequential& model, const std::string& source) {
  using config::LossKind;
  if (exp.loss.kind != LossKind::sparse_categorical_crossentropy && exp.loss.kind != LossKind::categorical_crossentropy)
    throw ConfigError(fmt::format(
        "{}: --softmax appends the Softmax that turns a softmax crossentropy's logits into probabilities, and this "
        "model's loss is {}{}; leave out --softmax",
        source, config::name_of(exp.loss.kind),
        exp.loss.kind == LossKind::binary_crossentropy
            ? " (its probabilities are the sigmoid of each output, not a softmax across them)"
            : ""));
  const std::int64_t outputs = model.output_shape()[model.output_shape().rank() - 1];
  if (outputs == 1)
    throw ConfigError(fmt::format("{}: --softmax over the model's one output would give 1 for every sample; leave out "
                                  "--softmax",
                                  source));
  // The last layer that does not return its input as it is (a linear activation, dropout).
  std::size_t last = model.num_layers() - 1;
  while (last > 0 && model.layer(last).returns_its_input()) --last;
  const config::Activation ends_in = model.layer(last).final_activation();
  if (ends_in == config::Activation::softmax || ends_in == config::Activation::sigmoid)
    throw ConfigError(fmt::format("{}: the model's outputs are already probabilities (the {} of layer '{}'), and "
                                  "--softmax would apply a softmax to them; leave out --softmax",
                                  source, config::name_of(ends_in), model.layer(last).name()));
}

}  // namespace

int export_command(const ExportArgs& args) {
  const bool keras = args.format == "keras";
  if (args.checkpoint.empty() && args.experiment.empty())
    throw ConfigError("dtrain export needs a CHECKPOINT to export, or --experiment EXP alone for the model as that "
                      "experiment initializes it");
  if (keras && args.softmax)
    throw ConfigError("--softmax appends a node to an ONNX graph; a Keras weights file holds weights only (build the "
                      "Keras model with a softmax if you need one): leave out --softmax or --format keras");
  // The model comes from the experiment stored in the checkpoint, unless one is given (as eval).
  const std::optional<checkpoint::Contents> stored =
      args.checkpoint.empty() ? std::nullopt : std::optional(checkpoint::peek(args.checkpoint));
  const std::string source = args.experiment.empty() ? args.checkpoint + ":/experiment" : args.experiment;
  const config::Experiment exp = args.experiment.empty()
                                     ? config::parse_experiment(stored->experiment_yaml, source, args.overrides)
                                     : config::load_experiment(args.experiment, args.overrides);
  refuse_writing_onto(args.output, "-o", {args.checkpoint, args.experiment, exp.model.initial_weights}, exp);
  // The weights are float32 whatever precision trained them; the graph computes in float32.
  const std::unique_ptr<device::Context> cpu = device::make_context(Device{});
  std::unique_ptr<nn::Sequential> model;
  naming_source(source, [&] {
    model = std::make_unique<nn::Sequential>(exp.model, exp.seed, *cpu);
    return 0;
  });
  // Where the weights came from: for the message, and in more detail for the ONNX doc string.
  std::string what, origin;
  if (stored) {
    checkpoint::restore_model(args.checkpoint, *model);
    what = fmt::format("{} (global step {})", args.checkpoint, stored->state.global_step);
    origin = fmt::format("{} ({}, global step {}), exported by dtrain {}", args.checkpoint,
                         checkpoint::position_in_training(stored->state), stored->state.global_step,
                         stored->dtrain_version);
  } else {
    // What a run of the experiment starts its first step from.
    const std::vector<std::vector<float>> values = read_initial_weights(exp, *model);
    for (std::size_t v = 0; v < values.size(); ++v)
      model->context().copy_from_host(values[v].data(), model->variables()[v]->value);
    what = fmt::format("the initial model of {} ({})", args.experiment,
                       values.empty() ? fmt::format("seed {}", exp.seed) : exp.model.initial_weights);
    origin = what + ", untrained";
  }

  if (keras) {
    // Keras 3's load_weights reads its own format only from a name ending in .weights.h5 (a plain
    // .h5 it reads as Keras 2's legacy layout, and fails).
    if (!args.output.ends_with(".weights.h5"))
      fmt::print(stderr, "dtrain: warning: -o {}: Keras 3's model.load_weights reads this format only from a file "
                 "named *.weights.h5\n",
                 args.output);
    write_file_atomically(args.output, interop::keras_weights_image(*model, exp.name));
    fmt::print("Exported {} to {}: Keras 3 weights of {} layers ({} variables) for model.load_weights\n", what,
               args.output, model->num_layers(), model->variables().size());
    return static_cast<int>(kOk);
  }
  if (args.softmax) check_softmax_fits(exp, *model, source);
  interop::OnnxExportOptions options;
  options.softmax = args.softmax;
  options.model_name = exp.name;
  options.doc = fmt::format("experiment {} from {}", exp.name, origin);
  const std::string bytes = interop::export_onnx(*model, options);
  write_file_atomically(args.output, bytes);
  const auto batched = [](const Shape& per_example) {
    std::string text = "(N";
    for (std::int64_t d : per_example.dims()) text += fmt::format(", {}", d);
    return text + ")";
  };
  fmt::print("Exported {} to {}: input '{}' {} float32 channels last, output '{}' {}, ONNX opset {}\n", what,
             args.output, interop::kOnnxInputName, batched(model->input_shape()),
             args.softmax ? interop::kOnnxProbabilitiesName : interop::kOnnxLogitsName,
             batched(model->output_shape()), interop::kOnnxOpset);
  return static_cast<int>(kOk);
}

}  // namespace dtrain::app
