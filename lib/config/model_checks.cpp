#include "config/model_checks.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "config/parse.hpp"
#include "core/error.hpp"

namespace dtrain::config {

void check_loss_fits_model(const Experiment& e, std::span<const std::int64_t> output_shape,
                           std::optional<LabelKind> labels) {
  if (e.model.layers.empty()) return;
  const LayerConfig& last = e.model.layers.back();
  const SourceLocation file{e.source_file, 0, 0};
  // The loss as written: in the file, or in the --set that replaced it.
  const std::string at_loss = given_prefix(e.loss.where, file);
  const std::string last_layer = fmt::format("the last layer '{}'{}", last.name,
                                             last.where.line > 0 ? fmt::format(" (at {}:{}:{})", last.where.file,
                                                                               last.where.line, last.where.column)
                                                                 : "");
  std::string shape;
  for (std::size_t i = 0; i < output_shape.size(); ++i) shape += fmt::format("{}{}", i ? ", " : "", output_shape[i]);
  if (output_shape.size() != 1)
    throw ConfigError(fmt::format("{}loss {} needs one vector of outputs per example, but {} gives shape ({}); end "
                                  "the model with a dense layer (after reshape or global_average_pooling2d)",
                                  location_prefix(last.where, file), name_of(e.loss.kind), last_layer, shape));
  const std::int64_t outputs = output_shape[0];
  const LossKind kind = e.loss.kind;
  if (!labels) {
    if (e.data.source == SourceKind::fashion_mnist) labels = LabelKind{true, 10};
    if (e.data.source == SourceKind::synthetic) labels = LabelKind{true, e.data.classes};
    if (e.data.source == SourceKind::idx) labels = LabelKind{true, 0};
    if (e.data.source == SourceKind::tensors) labels = LabelKind{false, 0};
  }
  const bool class_ids = labels && labels->class_ids;
  const bool one_output = kind == LossKind::binary_crossentropy || kind == LossKind::mean_squared_error;
  if (class_ids && one_output && outputs != 1)
    throw ConfigError(fmt::format("{}loss {} reads each integer label of data source {} as the target of a single "
                                  "output, but {} gives {}; use units: 1, or loss sparse_categorical_crossentropy "
                                  "for classes",
                                  at_loss, name_of(kind), name_of(e.data.source), last_layer, outputs));
  const std::int64_t classes = class_ids ? labels->classes : 0;
  if (!one_output && classes > 0 && outputs < classes)
    throw ConfigError(fmt::format("{}loss {} needs one output per class: data source {} has {} classes, but {} gives "
                                  "{}; set its units to {}",
                                  at_loss, name_of(kind), name_of(e.data.source), classes, last_layer, outputs,
                                  classes));
  if (labels && !labels->class_ids && kind == LossKind::sparse_categorical_crossentropy)
    throw ConfigError(fmt::format("{}loss sparse_categorical_crossentropy needs integer class ids, but data source {} "
                                  "gives float targets; use categorical_crossentropy or mean_squared_error",
                                  at_loss, name_of(e.data.source)));
  if (labels && !labels->class_ids && labels->targets > 0 && labels->targets != outputs)
    throw ConfigError(fmt::format("{}loss {} compares {} output{} per example with the {} float target{} of each "
                                  "example of data source {}; make {} give {}, or give the data {} target{} per example",
                                  at_loss, name_of(kind), outputs, outputs == 1 ? "" : "s", labels->targets,
                                  labels->targets == 1 ? "" : "s", name_of(e.data.source), last_layer, labels->targets,
                                  outputs, outputs == 1 ? "" : "s"));
  if (labels && !labels->class_ids &&
      std::find(e.metrics.begin(), e.metrics.end(), MetricKind::sparse_categorical_accuracy) != e.metrics.end())
    throw ConfigError(fmt::format("{}metric sparse_categorical_accuracy needs integer class ids, but data source {} "
                                  "gives float targets; use categorical_accuracy, or accuracy",
                                  location_prefix(e.metrics_where, file), name_of(e.data.source)));
  if (e.data.source == SourceKind::tensors) {
    // data.y is the targets of the one example the source repeats.
    const auto targets = static_cast<std::int64_t>(e.data.y.size());
    if (targets != outputs)
      throw ConfigError(fmt::format("{}loss {} compares {} outputs per example with the {} targets of data.y; make "
                                    "{} give {}",
                                    at_loss, name_of(kind), outputs, targets, last_layer, targets));
    if (kind == LossKind::binary_crossentropy || kind == LossKind::categorical_crossentropy)
      for (const double t : e.data.y)
        if (!(t >= 0.0 && t <= 1.0))
          throw ConfigError(fmt::format("{}data.y holds {}, outside [0, 1]; loss {} reads float targets as "
                                        "probabilities: scale the targets into [0, 1], or use mean_squared_error for "
                                        "values",
                                        location_prefix(e.data_where, file), t, name_of(kind)));
  }
}

}  // namespace dtrain::config
