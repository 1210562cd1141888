// The resolved experiment as YAML: what checkpoints store and `dtrain run` can print. Only the
// settings that apply to the chosen kinds are written, because the parser rejects the others.
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <type_traits>

#include "config/layers.hpp"
#include "config/parse.hpp"
#include "config/schema.hpp"
#include "config/strategies.hpp"
#include "core/error.hpp"

namespace dtrain::config {

namespace {

std::string number(double value) { return yaml_number(value); }

// A flow list; with a null key, the value of a key already written.
template <class T>
void list(YAML::Emitter& out, const char* key, const std::vector<T>& values) {
  if (key) out << YAML::Key << key << YAML::Value;
  out << YAML::Flow << YAML::BeginSeq;
  for (const T& value : values) {
    if constexpr (std::is_floating_point_v<T>)
      out << number(value);
    else
      out << value;
  }
  out << YAML::EndSeq;
}

void learning_rate(YAML::Emitter& out, const LearningRateConfig& lr) {
  out << YAML::Key << "learning_rate" << YAML::Value;
  if (lr.kind == ScheduleKind::constant) {
    out << number(lr.initial_learning_rate);
    return;
  }
  out << YAML::Flow << YAML::BeginMap << YAML::Key << "schedule" << YAML::Value << name_of(lr.kind);
  switch (lr.kind) {
    case ScheduleKind::constant: break;
    case ScheduleKind::exponential_decay:
      out << YAML::Key << "initial_learning_rate" << YAML::Value << number(lr.initial_learning_rate);
      out << YAML::Key << "decay_steps" << YAML::Value << lr.decay_steps;
      out << YAML::Key << "decay_rate" << YAML::Value << number(lr.decay_rate);
      out << YAML::Key << "staircase" << YAML::Value << lr.staircase;
      break;
    case ScheduleKind::piecewise_constant:
      list(out, "boundaries", lr.boundaries);
      list(out, "values", lr.values);
      break;
    case ScheduleKind::cosine_decay:
      out << YAML::Key << "initial_learning_rate" << YAML::Value << number(lr.initial_learning_rate);
      out << YAML::Key << "decay_steps" << YAML::Value << lr.decay_steps;
      out << YAML::Key << "alpha" << YAML::Value << number(lr.alpha);
      break;
  }
  out << YAML::EndMap;
}

void strategy(YAML::Emitter& out, const StrategyConfig& s) {
  const StrategySchema* schema = find_strategy_schema(s.kind);
  if (!schema) throw InternalError(fmt::format("strategy kind '{}', which no strategy file registered", s.kind));
  out << YAML::Key << "strategy" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "kind" << YAML::Value << std::string(schema->kind);
  OptionsWriter writer(out);
  schema->write(s.options, writer);
  out << YAML::EndMap;
}

}  // namespace

std::string to_yaml(const Experiment& e) {
  YAML::Emitter out;
  out.SetBoolFormat(YAML::TrueFalseBool);
  out << YAML::BeginMap;
  out << YAML::Key << "name" << YAML::Value << e.name;
  out << YAML::Key << "seed" << YAML::Value << e.seed;
  out << YAML::Key << "precision" << YAML::Value << name_of(e.precision);
  strategy(out, e.strategy);

  const DataConfig& d = e.data;
  out << YAML::Key << "data" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "source" << YAML::Value << name_of(d.source);
  switch (d.source) {
    case SourceKind::fashion_mnist:
    case SourceKind::idx:
    case SourceKind::hdf5:
      if (!d.path.empty()) out << YAML::Key << "path" << YAML::Value << d.path;  // empty: the source's default
      if (!d.shards.empty()) list(out, "shards", d.shards);  // hdf5 split into files (instead of path)
      break;
    case SourceKind::synthetic:
      list(out, "shape", d.shape);
      out << YAML::Key << "classes" << YAML::Value << d.classes;
      out << YAML::Key << "train_size" << YAML::Value << d.train_size;
      out << YAML::Key << "test_size" << YAML::Value << d.test_size;
      break;
    case SourceKind::tensors:
      list(out, "x", d.x);
      list(out, "y", d.y);
      out << YAML::Key << "size" << YAML::Value << d.train_size;
      break;
  }
  if (d.global_batch_size > 0) {
    out << YAML::Key << "global_batch_size" << YAML::Value << d.global_batch_size;
  } else {
    out << YAML::Key << "batch_size_per_replica" << YAML::Value << d.batch_size_per_replica;
  }
  out << YAML::Key << "shuffle_buffer" << YAML::Value << d.shuffle_buffer;
  out << YAML::Key << "drop_remainder" << YAML::Value << d.drop_remainder;
  out << YAML::Key << "distribute" << YAML::Value << name_of(d.distribute);
  out << YAML::Key << "auto_shard" << YAML::Value << name_of(d.auto_shard);
  out << YAML::Key << "validation_split" << YAML::Value << number(d.validation_split);
  out << YAML::Key << "eval_batch_size" << YAML::Value << d.eval_batch_size;
  out << YAML::Key << "prefetch" << YAML::Value << d.prefetch;
  out << YAML::EndMap;

  out << YAML::Key << "model" << YAML::Value << YAML::BeginMap;
  list(out, "input_shape", e.model.input_shape);
  out << YAML::Key << "layers" << YAML::Value << YAML::BeginSeq;
  for (const LayerConfig& layer : e.model.layers) {
    const LayerSchema* schema = find_layer_schema(layer.kind);
    if (!schema) throw InternalError(fmt::format("layer {} has kind '{}', which no layer file registered", layer.name, layer.kind));
    out << YAML::BeginMap << YAML::Key << std::string(schema->kind) << YAML::Value << YAML::Flow << YAML::BeginMap
        << YAML::Key << "name" << YAML::Value << layer.name;
    OptionsWriter writer(out);
    schema->write(layer.options, writer);
    out << YAML::EndMap << YAML::EndMap;
  }
  out << YAML::EndSeq;
  if (!e.model.initial_weights.empty())
    out << YAML::Key << "initial_weights" << YAML::Value << e.model.initial_weights;
  out << YAML::EndMap;

  out << YAML::Key << "loss" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "kind" << YAML::Value << name_of(e.loss.kind);
  if (e.loss.kind != LossKind::mean_squared_error)
    out << YAML::Key << "from_logits" << YAML::Value << e.loss.from_logits;
  out << YAML::Key << "reduction" << YAML::Value << name_of(e.loss.reduction);
  out << YAML::EndMap;

  const OptimizerConfig& o = e.optimizer;
  out << YAML::Key << "optimizer" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "kind" << YAML::Value << name_of(o.kind);
  learning_rate(out, o.learning_rate);
  switch (o.kind) {
    case OptimizerKind::sgd:
      out << YAML::Key << "momentum" << YAML::Value << number(o.momentum);
      out << YAML::Key << "nesterov" << YAML::Value << o.nesterov;
      break;
    case OptimizerKind::adam:
      out << YAML::Key << "beta_1" << YAML::Value << number(o.beta_1);
      out << YAML::Key << "beta_2" << YAML::Value << number(o.beta_2);
      out << YAML::Key << "epsilon" << YAML::Value << number(o.epsilon);
      break;
    case OptimizerKind::rmsprop:
      out << YAML::Key << "rho" << YAML::Value << number(o.rho);
      out << YAML::Key << "momentum" << YAML::Value << number(o.momentum);
      out << YAML::Key << "epsilon" << YAML::Value << number(o.epsilon);
      out << YAML::Key << "centered" << YAML::Value << o.centered;
      break;
  }
  out << YAML::EndMap;

  out << YAML::Key << "metrics" << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (MetricKind metric : e.metrics) out << name_of(metric);
  out << YAML::EndSeq;

  out << YAML::Key << "train" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "epochs" << YAML::Value << e.train.epochs;
  out << YAML::Key << "steps_per_epoch" << YAML::Value << e.train.steps_per_epoch;
  out << YAML::Key << "threads" << YAML::Value << e.train.threads;
  out << YAML::Key << "parallelism" << YAML::Value << name_of(e.train.parallelism);
  out << YAML::Key << "progress" << YAML::Value << name_of(e.train.progress);
  out << YAML::Key << "tensorboard" << YAML::Value << e.train.tensorboard;
  out << YAML::Key << "log_every_steps" << YAML::Value << e.train.log_every_steps;
  out << YAML::Key << "plot" << YAML::Value << e.train.plot;
  out << YAML::EndMap;

  out << YAML::Key << "checkpoint" << YAML::Value << YAML::BeginMap;
  out << YAML::Key << "every_epochs" << YAML::Value << e.checkpoint.every_epochs;
  out << YAML::Key << "every_steps" << YAML::Value << e.checkpoint.every_steps;
  out << YAML::Key << "max_to_keep" << YAML::Value << e.checkpoint.max_to_keep;
  if (!e.checkpoint.dir.empty()) out << YAML::Key << "dir" << YAML::Value << e.checkpoint.dir;
  out << YAML::EndMap;

  // Written only when not the default, so that the resolved experiments of fast runs read as before.
  if (e.reproducibility.invariant() || e.reproducibility.isa != IsaCap::native) {
    out << YAML::Key << "reproducibility" << YAML::Value << YAML::BeginMap;
    out << YAML::Key << "mode" << YAML::Value << name_of(e.reproducibility.mode);
    if (e.reproducibility.invariant())
      out << YAML::Key << "micro_batch_size" << YAML::Value << e.reproducibility.micro_batch_size;
    out << YAML::Key << "isa" << YAML::Value << name_of(e.reproducibility.isa);
    out << YAML::EndMap;
  }

  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace dtrain::config
