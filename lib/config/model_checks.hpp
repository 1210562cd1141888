// Checks of an experiment that need the built model's output shape: whether the loss can use
// what the last layer gives for the data's labels. `dtrain validate` and the trainer run them
// once the model is built (the shape comes from nn/, which config/ does not know), so that a
// mismatch is refused at start with the loss's and the last layer's file:line:column instead of
// failing in the first training step.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "config/experiment.hpp"

namespace dtrain::config {

// What the loaded data's labels are: integer class ids (and how many classes), or float targets.
struct LabelKind {
  bool class_ids = true;
  std::int64_t classes = 0;  // 0 = unknown
  std::int64_t targets = 0;  // float targets per example (their shape past the batch, flat); 0 = unknown
};

// Throws ConfigError when the loss cannot use outputs of `output_shape` (per example) for the
// labels the data gives: `labels` once the data is loaded, else what the source is known to give
// before loading (hdf5's labels may be either kind, so they are checked only once loaded).
void check_loss_fits_model(const Experiment& experiment, std::span<const std::int64_t> output_shape,
                           std::optional<LabelKind> labels = std::nullopt);

}  // namespace dtrain::config
