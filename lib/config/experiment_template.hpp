// What `dtrain init` writes: a complete experiment a new user edits instead of copying one and
// reading docs/experiment.md for its keys.
//
// The keys and their defaults are not kept here: a skeleton (strategy, model) is parsed like any
// experiment and written back with to_yaml, so every key the parser knows appears with the value
// it takes when left out. The choices beside a key come from the parser's own tables
// (choices_of), the layer kinds and their options from the layer registry, what the strategy kinds
// do and the notes on their keys from the strategy registry, and the keys of the
// kinds not chosen (other data sources, learning-rate schedules, optimizers) from the parser and
// to_yaml too: an example of each is parsed and written back. What this file adds
// is prose: a comment per key, and the custom-training-loop template's TODOs where a user fills
// in their own (strategy, dataset, model, loss reduction, metrics, epochs).
#pragma once

#include <string>
#include <string_view>

namespace dtrain::config {

struct TemplateOptions {
  std::string strategy;        // a strategy kind's YAML name; empty: the default kind
  std::string model = "cnn";   // cnn (the seed CNN) or mlp (Flatten, Dense 128, Dense 10)
  std::string name = "my_experiment";
};

// The commented experiment; ConfigError for an unknown strategy or model.
std::string experiment_template(const TemplateOptions& options);

// What starts a template of `strategy` (empty: the default kind) before "dtrain run FILE", as its
// strategy file registered it: "mpirun -n 2 " for a kind that spans processes, or nothing.
std::string launcher_for(std::string_view strategy);

}  // namespace dtrain::config
