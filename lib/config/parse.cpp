#include "config/parse.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <sstream>
#include <string_view>

#include "config/layers.hpp"
#include "config/schema.hpp"
#include "config/strategies.hpp"
#include "config/yaml_tree.hpp"
#include "core/checked.hpp"
#include "core/error.hpp"
#include "core/machine.hpp"

namespace dtrain::config {

namespace {

// ---------------------------------------------------------------- names of enum values

constexpr Named<SourceKind> source_kinds[] = {{"fashion_mnist", SourceKind::fashion_mnist},
                                              {"idx", SourceKind::idx},
                                              {"hdf5", SourceKind::hdf5},
                                              {"synthetic", SourceKind::synthetic},
                                              {"tensors", SourceKind::tensors}};
constexpr Named<AutoShardPolicy> auto_shard_policies[] = {{"auto", AutoShardPolicy::auto_select},
                                                          {"file", AutoShardPolicy::file},
                                                          {"data", AutoShardPolicy::data},
                                                          {"off", AutoShardPolicy::off}};
constexpr Named<DistributeMode> distribute_modes[] = {{"split_global_batch", DistributeMode::split_global_batch},
                                                      {"per_replica", DistributeMode::per_replica}};
constexpr Named<LossKind> loss_kinds[] = {
    {"sparse_categorical_crossentropy", LossKind::sparse_categorical_crossentropy},
    {"categorical_crossentropy", LossKind::categorical_crossentropy},
    {"binary_crossentropy", LossKind::binary_crossentropy},
    {"mean_squared_error", LossKind::mean_squared_error}};
constexpr Named<Reduction> reductions[] = {{"none", Reduction::none},
                                           {"sum", Reduction::sum},
                                           {"sum_over_batch_size", Reduction::sum_over_batch_size},
                                           {"auto", Reduction::auto_reduction}};
constexpr Named<ScheduleKind> schedule_kinds[] = {{"constant", ScheduleKind::constant},
                                                  {"exponential_decay", ScheduleKind::exponential_decay},
                                                  {"piecewise_constant", ScheduleKind::piecewise_constant},
                                                  {"cosine_decay", ScheduleKind::cosine_decay}};
constexpr Named<OptimizerKind> optimizer_kinds[] = {
    {"sgd", OptimizerKind::sgd}, {"adam", OptimizerKind::adam}, {"rmsprop", OptimizerKind::rmsprop}};
constexpr Named<MetricKind> metric_kinds[] = {{"sparse_categorical_accuracy", MetricKind::sparse_categorical_accuracy},
                                              {"accuracy", MetricKind::accuracy},
                                              {"categorical_accuracy", MetricKind::categorical_accuracy}};
constexpr Named<Parallelism> parallelisms[] = {{"batch", Parallelism::batch}, {"operations", Parallelism::operations}};
constexpr Named<ProgressMode> progress_modes[] = {{"auto", ProgressMode::auto_detect},
                                                  {"bar", ProgressMode::bar},
                                                  {"lines", ProgressMode::lines},
                                                  {"none", ProgressMode::none}};

// tf.distribute strategies that later versions add; naming one gets "not available", not "unknown".
constexpr std::string_view planned_strategies[] = {"tpu"};

constexpr Named<ReproducibilityMode> reproducibility_modes[] = {
    {"fast", ReproducibilityMode::fast}, {"replica_invariant", ReproducibilityMode::replica_invariant}};
constexpr Named<IsaCap> isa_caps[] = {{"native", IsaCap::native},
                                      {"avx2", IsaCap::avx2},
                                      {"avx512_core", IsaCap::avx512_core},
                                      {"avx512_core_bf16", IsaCap::avx512_core_bf16},
                                      {"avx512_core_amx", IsaCap::avx512_core_amx}};
constexpr Named<Precision> precisions[] = {{"float32", Precision::float32},
                                           {"mixed_bfloat16", Precision::mixed_bfloat16}};




// ---------------------------------------------------------------- sections

// The kinds that take `key`, as "strategy kind a" or "strategy kinds a, b".
std::string kinds_taking(std::string_view key) {
  std::vector<std::string_view> kinds;
  for (const StrategySchema* schema : strategy_schemas())
    if (std::find(schema->keys.begin(), schema->keys.end(), key) != schema->keys.end()) kinds.push_back(schema->kind);
  return fmt::format("strategy kind{} {}", kinds.size() == 1 ? "" : "s", join(kinds));
}

// The strategy section: the kind, then the kind's own options as its file reads them
// (config/strategies.hpp); keys of other kinds are refused naming the kinds that take them.
StrategyConfig parse_strategy(const Node& node, const Origin& key_origin) {
  const std::vector<std::string_view> keys = strategy_keys();
  Section s(node, "strategy", keys);
  StrategyConfig out;
  out.where = key_origin.location();
  const StrategySchema* schema = &default_strategy_schema();
  if (const Node* kind = s.find("kind")) {
    const std::vector<std::string_view> available = strategy_kind_names();
    if (kind->is_scalar() && std::find(std::begin(planned_strategies), std::end(planned_strategies),
                                       kind->scalar) != std::end(planned_strategies))
      fail(kind->origin, fmt::format("strategy kind '{}' is not available in this version of dtrain (available: {})",
                                     kind->scalar, join(available)));
    schema = &strategy_schema(available[read_name(*kind, s.path("kind"), "strategy kind", available)]);
    out.where = kind->origin.location();
  }
  out.kind = std::string(schema->kind);
  for (std::string_view key : keys)
    if (key != "kind")
      s.only_for(key, std::find(schema->keys.begin(), schema->keys.end(), key) != schema->keys.end(),
                 kinds_taking(key), schema->kind);
  schema->parse(s, out);
  return out;
}

// tf.distribute's rule, checked once both sections are known because either may come from --set.
// `reduction_origin` is the reduction value, or the loss section / file when it was left out.
void check_reduction_under_strategy(const StrategyConfig& strategy, const LossConfig& loss, bool reduction_given,
                                    const Origin& reduction_origin) {
  const StrategySchema& schema = strategy_schema(strategy.kind);
  if (schema.allows_mean_reductions) return;
  if (loss.reduction != Reduction::auto_reduction && loss.reduction != Reduction::sum_over_batch_size) return;
  const std::string why =
      !schema.mean_reductions_refused.empty()
          ? std::string(schema.mean_reductions_refused)
          : "each replica would average over its own part of the batch, and summing the replicas' gradients then "
            "comes out num_replicas times too large";
  fail(reduction_origin,
       fmt::format("loss.reduction '{}'{} is refused under strategy '{}': {}; write reduction: none (dtrain divides "
                   "the summed per-example losses by the GLOBAL batch, like tf.nn.compute_average_loss) or "
                   "reduction: sum",
                   name_of(loss.reduction), reduction_given ? "" : " (the default when left out)", strategy.kind, why));
}

// auto_shard: file's list of files: non-empty, each named once.
std::vector<std::string> read_shards(const Node& node, const std::string& path) {
  std::vector<std::string> out;
  for (std::size_t i = 0; const Node& item : expect_list(node, path, "HDF5 file paths").items) {
    const std::string item_path = child(path, std::to_string(i++));
    std::string file = read_string(item, item_path);
    if (file.empty()) range_error(item, item_path, "a non-empty path");
    const auto previous = std::find(out.begin(), out.end(), file);
    if (previous != out.end())
      fail(item.origin, fmt::format("{}: shard '{}' is listed twice (also at {}); list each file once", item_path,
                                    file, node.items[static_cast<std::size_t>(previous - out.begin())].origin.text()));
    out.push_back(std::move(file));
  }
  if (out.empty()) range_error(node, path, "a non-empty list of HDF5 files");
  return out;
}

// A file or directory path read from `node`: not empty, not only blanks, no '~' (leaving the key
// out gives `default_meaning`).
void check_path(const Node& node, const std::string& path, const std::string& value, std::string_view default_meaning) {
  if (value.empty())
    range_error(node, path, fmt::format("a non-empty path (leave the key out for {})", default_meaning));
  if (std::all_of(value.begin(), value.end(), [](unsigned char c) { return std::isspace(c) != 0; }))
    range_error(node, path, fmt::format("a path, not only blanks (leave the key out for {})", default_meaning));
  // The shell expands ~, unquoted on its command line; nothing expands it in a YAML file.
  if (value == "~" || value.starts_with("~/"))
    range_error(node, path,
                "a path dtrain can open: it does not expand '~' (a shell does, on its command line); write the "
                "home directory out, or the path relative to the working directory");
}

// `batch_where`, `eval_batch_where` and `data_where` (Experiment) are set too.
DataConfig parse_data(const Node& node, SourceLocation& batch_where, SourceLocation& eval_batch_where,
                      SourceLocation& data_where, SourceLocation& validation_split_where) {
  static constexpr std::string_view keys[] = {
      "source",   "path",     "shape",          "classes",       "train_size",      "test_size",
      "x",        "y",        "size",           "batch_size_per_replica", "global_batch_size", "shuffle_buffer", "drop_remainder",
      "distribute", "validation_split", "eval_batch_size", "prefetch", "auto_shard", "shards"};
  Section s(node, "data", keys);
  DataConfig out;
  s.get_enum("source", out.source, "data source", source_kinds);
  const char* source = name_of(out.source);

  const bool files = out.source == SourceKind::fashion_mnist || out.source == SourceKind::idx ||
                     out.source == SourceKind::hdf5;
  const bool synthetic = out.source == SourceKind::synthetic;
  const bool tensors = out.source == SourceKind::tensors;
  s.only_for("path", files, "data sources fashion_mnist, idx, hdf5", source);
  s.only_for("shards", out.source == SourceKind::hdf5, "data source hdf5", source);
  for (std::string_view key : {"shape", "classes", "train_size", "test_size"})
    s.only_for(key, synthetic, "data source synthetic", source);
  for (std::string_view key : {"x", "y", "size"}) s.only_for(key, tensors, "data source tensors", source);

  s.get_enum("auto_shard", out.auto_shard, "auto_shard policy", auto_shard_policies);
  const bool by_file = out.auto_shard == AutoShardPolicy::file;
  if (by_file && out.source != SourceKind::hdf5)
    fail(s.find("auto_shard")->origin,
         fmt::format("data.auto_shard 'file' needs data source hdf5 with one file per shard in data.shards, not "
                     "{}; write auto_shard: data (every worker keeps every workers-th example) or auto",
                     source));
  if (const Node* shards = s.find("shards")) {
    if (const Node* path = s.find("path"); path && out.source == SourceKind::hdf5)
      fail(s.key_origin("shards"),
           fmt::format("data.shards: give either data.path (one HDF5 file) or data.shards (the data split into "
                       "files), not both; data.path is at {}",
                       path->origin.text()));
    out.shards = read_shards(*shards, s.path("shards"));
  } else if (by_file) {
    fail(node.origin, "data: missing required key 'shards' (auto_shard: file reads one HDF5 file per shard, for "
                      "example shards: [part0.h5, part1.h5])");
  }

  if (out.source == SourceKind::idx || (out.source == SourceKind::hdf5 && out.shards.empty())) {
    out.path = read_string(s.require("path"), s.path("path"));
  } else {
    s.get("path", out.path, read_string);
  }
  if (const Node* path = s.find("path")) check_path(*path, s.path("path"), out.path, "the source's default");
  const Node* data_file = s.find("path") ? s.find("path") : s.find("shards");
  data_where = (data_file ? data_file->origin : node.origin).location();

  s.get("shape", out.shape, read_shape);
  s.get_int("classes", out.classes, 1);
  s.get_int("train_size", out.train_size, 1);
  s.get_int("test_size", out.test_size, 1);  // evaluating nothing would report a meaningless 0
  if (synthetic) {
    // Generated in memory as bytes, plus a 4-byte label each.
    const auto pixels = checked_product(out.shape);
    const auto example = pixels ? checked_add(*pixels, 4) : std::nullopt;
    const auto examples = checked_add(out.train_size, out.test_size);
    const auto bytes = example && examples ? checked_mul(*example, *examples) : std::nullopt;
    const char* key = s.find("train_size") || !s.find("test_size") ? "train_size" : "test_size";
    check_memory(s.find(key) ? *s.find(key) : node, s.path(key), bytes,
                 fmt::format("a synthetic dataset of {} + {} examples", out.train_size, out.test_size));
  }
  if (tensors) {
    out.x = read_number_list(s.require("x"), s.path("x"));
    out.y = read_number_list(s.require("y"), s.path("y"));
    if (out.x.empty()) range_error(*s.find("x"), s.path("x"), "a non-empty list of numbers");
    if (out.y.empty()) range_error(*s.find("y"), s.path("y"), "a non-empty list of numbers");
    s.get_int("size", out.train_size, 1);
    // Repeated into a training and a test split of f32 rows.
    const auto row = checked_mul(static_cast<std::int64_t>(out.x.size() + out.y.size()), 2 * 4);
    check_memory(s.find("size") ? *s.find("size") : node, s.path("size"),
                 row ? checked_mul(*row, out.train_size) : std::nullopt,
                 fmt::format("{} repeated examples", out.train_size));
  }

  s.get_int("batch_size_per_replica", out.batch_size_per_replica, 1);
  s.get_int("global_batch_size", out.global_batch_size, 1);
  if (const Node* global = s.find("global_batch_size"); global && s.find("batch_size_per_replica"))
    range_error(*global, s.path("global_batch_size"),
                "only one of batch_size_per_replica and global_batch_size (they say the same thing two ways)");
  s.get_int("shuffle_buffer", out.shuffle_buffer, 0);
  s.get_bool("drop_remainder", out.drop_remainder);
  s.get_enum("distribute", out.distribute, "distribute mode", distribute_modes);
  s.get_number("validation_split", out.validation_split, unit_interval_open, "in [0, 1)");
  if (const Node* split = s.find("validation_split")) validation_split_where = split->origin.location();
  s.get_int("eval_batch_size", out.eval_batch_size, 0);
  s.get_bool("prefetch", out.prefetch);
  const Node* batch = s.find("global_batch_size") ? s.find("global_batch_size") : s.find("batch_size_per_replica");
  batch_where = (batch ? batch->origin : node.origin).location();
  eval_batch_where = s.find("eval_batch_size") ? s.find("eval_batch_size")->origin.location() : batch_where;
  return out;
}

bool portable_name(std::string_view name) {
  // Layer names become parts of checkpoint dataset paths, so keep them to a portable alphabet.
  return !name.empty() && std::all_of(name.begin(), name.end(), [](unsigned char c) {
    return std::isalnum(c) != 0 || c == '_' || c == '-' || c == '.';
  });
}

std::vector<LayerConfig> parse_layers(const Node& node, const std::string& path) {
  if (!node.is_sequence()) type_error(node, path, "a list of layers, each '- kind: {options}'");
  if (node.items.empty()) range_error(node, path, "a non-empty list of layers");
  const std::vector<std::string_view> kind_names = layer_kind_names();

  std::vector<LayerConfig> layers;
  std::map<std::string, Origin> explicit_names;
  std::vector<bool> named;
  for (std::size_t i = 0; i < node.items.size(); ++i) {
    const Node& item = node.items[i];
    const std::string item_path = child(path, std::to_string(i));
    if (!item.is_map() || item.entries.empty())
      type_error(item, item_path, "a map with one key, the layer kind (for example '- dense: {units: 10}')");
    if (item.entries.size() > 1) {
      const auto& extra = item.entries[1];
      fail(extra.key_origin,
           fmt::format("{}: a layer has one key, its kind, but '{}' follows '{}'; put options inside the kind's "
                       "map (for example '- dense: {{units: 10}}')",
                       item_path, extra.key, item.entries[0].key));
    }
    const auto& [kind_name, key_origin, options] = item.entries[0];
    const LayerSchema* schema = find_layer_schema(kind_name);
    if (!schema)
      fail(key_origin, fmt::format("unknown layer kind '{}' in {}; known: {}{}", kind_name, item_path,
                                   join(kind_names), did_you_mean(kind_name, kind_names)));
    const std::string options_path = child(item_path, kind_name);

    LayerConfig layer;
    layer.kind = std::string(schema->kind);
    std::vector<std::string_view> keys = schema->keys;
    keys.push_back("name");
    layer.options = schema->parse(Section(options, options_path, keys));
    layer.where = key_origin.location();
    if (const Node* name = options.find("name")) {
      layer.name = read_string(*name, child(options_path, "name"));
      if (!portable_name(layer.name))
        range_error(*name, child(options_path, "name"), "made of letters, digits, '_', '-' and '.'");
      const auto [previous, inserted] = explicit_names.emplace(layer.name, name->origin);
      if (!inserted)
        fail(name->origin, fmt::format("{}: duplicate layer name '{}' (also used at {}); layer names must be unique",
                                       child(options_path, "name"), layer.name, previous->second.text()));
    }
    named.push_back(!layer.name.empty());
    layers.push_back(std::move(layer));
  }

  // Keras numbering per kind, skipping names the user already took explicitly.
  std::map<std::string_view, int> next_index;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    if (named[i]) continue;
    const std::string_view prefix = find_layer_schema(layers[i].kind)->auto_name;
    std::string candidate;
    do {
      const int index = next_index[prefix]++;
      candidate = index == 0 ? std::string(prefix) : fmt::format("{}_{}", prefix, index);
    } while (explicit_names.count(candidate) != 0);
    layers[i].name = candidate;
  }
  return layers;
}

// `initial_weights_where` (Experiment) is set too.
ModelConfig parse_model(const Node& node, SourceLocation& initial_weights_where, SourceLocation& input_shape_where) {
  static constexpr std::string_view keys[] = {"input_shape", "layers", "initial_weights"};
  Section s(node, "model", keys);
  ModelConfig out;
  out.input_shape = read_shape(s.require("input_shape"), s.path("input_shape"));
  input_shape_where = s.require("input_shape").origin.location();
  out.layers = parse_layers(s.require("layers"), s.path("layers"));
  if (const Node* weights = s.find("initial_weights")) {
    out.initial_weights = read_string(*weights, s.path("initial_weights"));
    check_path(*weights, s.path("initial_weights"), out.initial_weights, "the seed's initialization");
    initial_weights_where = weights->origin.location();
  }
  return out;
}

LossConfig parse_loss(const Node& node, const Origin& key_origin) {
  static constexpr std::string_view keys[] = {"kind", "from_logits", "reduction"};
  Section s(node, "loss", keys);
  LossConfig out;
  s.get_enum("kind", out.kind, "loss kind", loss_kinds);
  s.only_for("from_logits", out.kind != LossKind::mean_squared_error, "the crossentropy losses",
             name_of(out.kind));
  s.get_bool("from_logits", out.from_logits);
  s.get_enum("reduction", out.reduction, "loss reduction", reductions);
  out.where = key_origin.location();
  return out;
}

LearningRateConfig parse_learning_rate(const Node& node, const std::string& path) {
  LearningRateConfig out;
  if (node.is_scalar()) {
    out.initial_learning_rate = read_number(node, path);
    if (out.initial_learning_rate <= 0) range_error(node, path, "> 0");
    return out;
  }
  if (!node.is_map()) type_error(node, path, "a number or a schedule map ({schedule: exponential_decay, ...})");
  static constexpr std::string_view keys[] = {"schedule",   "initial_learning_rate", "decay_steps", "decay_rate",
                                              "staircase",  "boundaries",            "values",      "alpha"};
  Section s(node, path, keys);
  out.kind = read_enum(s.require("schedule"), s.path("schedule"), "learning rate schedule", schedule_kinds);
  const char* chosen = name_of(out.kind);
  using K = ScheduleKind;
  const bool exponential = out.kind == K::exponential_decay, piecewise = out.kind == K::piecewise_constant,
             cosine = out.kind == K::cosine_decay;
  s.only_for("initial_learning_rate", !piecewise, "schedules constant, exponential_decay, cosine_decay", chosen);
  s.only_for("decay_steps", exponential || cosine, "schedules exponential_decay, cosine_decay", chosen);
  s.only_for("decay_rate", exponential, "schedule exponential_decay", chosen);
  s.only_for("staircase", exponential, "schedule exponential_decay", chosen);
  s.only_for("boundaries", piecewise, "schedule piecewise_constant", chosen);
  s.only_for("values", piecewise, "schedule piecewise_constant", chosen);
  s.only_for("alpha", cosine, "schedule cosine_decay", chosen);

  auto required_positive = [&](std::string_view key) {
    const Node& value = s.require(key);
    const double v = read_number(value, s.path(key));
    if (v <= 0) range_error(value, s.path(key), "> 0");
    return v;
  };
  if (piecewise) {
    const Node& boundaries = s.require("boundaries");
    const Node& values = s.require("values");
    out.boundaries = read_int_list(boundaries, s.path("boundaries"));
    out.values = read_number_list(values, s.path("values"));
    for (std::size_t i = 1; i < out.boundaries.size(); ++i)
      if (out.boundaries[i] <= out.boundaries[i - 1])
        range_error(boundaries.items[i], child(s.path("boundaries"), std::to_string(i)),
                    fmt::format("greater than the previous boundary ({}); boundaries must increase",
                                out.boundaries[i - 1]));
    if (out.values.size() != out.boundaries.size() + 1)
      fail(values.origin, fmt::format("{}: needs one more entry than boundaries ({} boundaries -> {} values), got {}",
                                      s.path("values"), out.boundaries.size(), out.boundaries.size() + 1,
                                      out.values.size()));
    for (std::size_t i = 0; i < out.values.size(); ++i)
      if (out.values[i] <= 0) range_error(values.items[i], child(s.path("values"), std::to_string(i)), "> 0");
    out.initial_learning_rate = out.values.front();  // what the schedule gives at step 0
    return out;
  }
  out.initial_learning_rate = required_positive("initial_learning_rate");
  if (exponential || cosine) {
    const Node& steps = s.require("decay_steps");
    out.decay_steps = read_int(steps, s.path("decay_steps"));
    if (out.decay_steps < 1) range_error(steps, s.path("decay_steps"), ">= 1");
  }
  if (exponential) {
    out.decay_rate = required_positive("decay_rate");
    s.get_bool("staircase", out.staircase);
  }
  if (cosine) s.get_number("alpha", out.alpha, unit_interval_closed, "in [0, 1]");
  return out;
}

OptimizerConfig parse_optimizer(const Node& node) {
  static constexpr std::string_view keys[] = {"kind",   "learning_rate", "momentum", "nesterov", "beta_1",
                                              "beta_2", "epsilon",       "rho",      "centered"};
  Section s(node, "optimizer", keys);
  OptimizerConfig out;
  s.get_enum("kind", out.kind, "optimizer kind", optimizer_kinds);
  const char* chosen = name_of(out.kind);
  const bool sgd = out.kind == OptimizerKind::sgd, adam = out.kind == OptimizerKind::adam,
             rmsprop = out.kind == OptimizerKind::rmsprop;
  s.only_for("momentum", sgd || rmsprop, "optimizer kinds sgd, rmsprop", chosen);
  s.only_for("nesterov", sgd, "optimizer kind sgd", chosen);
  s.only_for("beta_1", adam, "optimizer kind adam", chosen);
  s.only_for("beta_2", adam, "optimizer kind adam", chosen);
  s.only_for("epsilon", adam || rmsprop, "optimizer kinds adam, rmsprop", chosen);
  s.only_for("rho", rmsprop, "optimizer kind rmsprop", chosen);
  s.only_for("centered", rmsprop, "optimizer kind rmsprop", chosen);

  out.learning_rate.initial_learning_rate = sgd ? 0.01 : 0.001;  // Keras' defaults
  s.get("learning_rate", out.learning_rate, parse_learning_rate);
  s.get_number("momentum", out.momentum, unit_interval_open, "in [0, 1)");
  s.get_bool("nesterov", out.nesterov);
  s.get_number("beta_1", out.beta_1, unit_interval_open, "in [0, 1)");
  s.get_number("beta_2", out.beta_2, unit_interval_open, "in [0, 1)");
  s.get_number("epsilon", out.epsilon, positive, "> 0");
  s.get_number("rho", out.rho, unit_interval_open, "in [0, 1)");
  s.get_bool("centered", out.centered);
  return out;
}

std::vector<MetricKind> parse_metrics(const Node& node) {
  std::vector<MetricKind> out;
  if (node.is_null()) return out;
  for (std::size_t i = 0; const Node& item : expect_list(node, "metrics", "metric names").items) {
    const std::string path = child("metrics", std::to_string(i++));
    const MetricKind kind = read_enum(item, path, "metric", metric_kinds);
    if (std::find(out.begin(), out.end(), kind) != out.end())
      fail(item.origin, fmt::format("{}: metric '{}' is listed twice", path, item.scalar));
    out.push_back(kind);
  }
  return out;
}

TrainConfig parse_train(const Node& node, SourceLocation& steps_per_epoch_where) {
  static constexpr std::string_view keys[] = {"epochs",      "steps_per_epoch", "threads", "parallelism",
                                              "progress",    "tensorboard",     "log_every_steps", "plot"};
  Section s(node, "train", keys);
  TrainConfig out;
  s.get_int("epochs", out.epochs, 1);
  s.get_int("steps_per_epoch", out.steps_per_epoch, 0);
  if (const Node* steps = s.find("steps_per_epoch")) steps_per_epoch_where = steps->origin.location();
  s.get_int("threads", out.threads, 0);
  if (out.threads > max_compute_threads())
    range_error(*s.find("threads"), s.path("threads"),
                fmt::format("at most {} (4 per hardware thread of this machine, at least 64), or 0 for all cores",
                            max_compute_threads()));
  s.get_enum("parallelism", out.parallelism, "parallelism", parallelisms);
  s.get_enum("progress", out.progress, "progress mode", progress_modes);
  s.get_bool("tensorboard", out.tensorboard);
  s.get_int("log_every_steps", out.log_every_steps, 0);
  s.get_bool("plot", out.plot);
  return out;
}

CheckpointConfig parse_checkpoint(const Node& node) {
  static constexpr std::string_view keys[] = {"every_epochs", "every_steps", "max_to_keep", "dir"};
  Section s(node, "checkpoint", keys);
  CheckpointConfig out;
  s.get_int("every_epochs", out.every_epochs, 0);
  s.get_int("every_steps", out.every_steps, 0);
  s.get_int("max_to_keep", out.max_to_keep, 1);
  s.get("dir", out.dir, read_string);
  return out;
}

ReproducibilityConfig parse_reproducibility(const Node& node) {
  static constexpr std::string_view keys[] = {"mode", "micro_batch_size", "isa"};
  Section s(node, "reproducibility", keys);
  ReproducibilityConfig out;
  s.get_enum("mode", out.mode, "reproducibility mode", reproducibility_modes);
  const Node* mode = s.find("mode");
  out.where = (mode ? mode->origin : s.key_origin("mode")).location();
  s.get_int("micro_batch_size", out.micro_batch_size, 1);
  if (const Node* isa = s.find("isa")) {
    out.isa = read_enum(*isa, s.path("isa"), "instruction set", isa_caps);
    out.isa_where = isa->origin.location();
  }
  if (out.mode == ReproducibilityMode::fast && s.find("micro_batch_size"))
    fail(s.find("micro_batch_size")->origin,
         "reproducibility.micro_batch_size applies to mode replica_invariant only; set reproducibility.mode: "
         "replica_invariant or leave the key out");
  return out;
}

Experiment parse_tree(const Node& root, const std::string& file_name) {
  static constexpr std::string_view keys[] = {"name",      "seed",    "precision", "strategy",
                                              "data",      "model",   "loss",      "optimizer",
                                              "metrics",   "train",   "checkpoint", "reproducibility"};
  Section s(root, "", keys);
  Experiment out;
  out.source_file = file_name;
  if (const Node* name = s.find("name")) {
    out.name = read_string(*name, "name");
    // The name is the default run directory (runs/<name>): a path in it would write elsewhere.
    const bool one_component = !out.name.empty() && out.name != "." && out.name != ".." &&
                               std::none_of(out.name.begin(), out.name.end(), [](unsigned char c) {
                                 return c == '/' || c == '\\' || std::iscntrl(c) != 0;
                               });
    if (!one_component)
      range_error(*name, "name", "a name, not a path: no '/', not '.' or '..' (it names the run directory "
                                 "runs/<name>; choose the directory itself with --run-dir)");
    // A directory name holds at most 255 bytes (NAME_MAX), and a second run of the name adds "-2".
    if (out.name.size() > kMaxExperimentNameBytes)
      range_error(*name, "name", fmt::format("at most {} bytes (it names the run directory runs/<name>; choose the "
                                             "directory itself with --run-dir)",
                                             kMaxExperimentNameBytes));
  }
  s.get("seed", out.seed, read_uint64);
  if (const Node* precision = s.find("precision")) {
    out.precision = read_enum(*precision, "precision", "precision policy", precisions);
    out.precision_where = precision->origin.location();
  }
  Node empty;  // an absent section reads as one with every key left out
  empty.origin = Origin{file_name, 0, 0};
  auto section = [&](std::string_view key) -> const Node& {
    const Node* node = s.find(key);
    return node ? *node : empty;
  };
  out.strategy = parse_strategy(section("strategy"), s.find("strategy") ? s.key_origin("strategy") : empty.origin);
  out.data = parse_data(section("data"), out.batch_where, out.eval_batch_where, out.data_where,
                        out.validation_split_where);
  out.model = parse_model(s.require("model"), out.initial_weights_where, out.input_shape_where);
  out.loss = parse_loss(section("loss"), s.find("loss") ? s.key_origin("loss") : empty.origin);
  out.optimizer = parse_optimizer(section("optimizer"));
  out.metrics = parse_metrics(section("metrics"));
  if (s.find("metrics")) out.metrics_where = section("metrics").origin.location();
  out.train = parse_train(section("train"), out.steps_per_epoch_where);
  out.checkpoint = parse_checkpoint(section("checkpoint"));
  out.reproducibility = parse_reproducibility(section("reproducibility"));

  const Node* reduction = section("loss").find("reduction");
  check_reduction_under_strategy(out.strategy, out.loss, reduction != nullptr,
                                 reduction ? reduction->origin : Origin{out.loss.where.file, out.loss.where.line,
                                                                        out.loss.where.column});
  return out;
}

}  // namespace

const char* name_of(SourceKind kind) { return name_in(source_kinds, kind); }
const char* name_of(DistributeMode mode) { return name_in(distribute_modes, mode); }
const char* name_of(CommunicationImplementation implementation) {
  return name_in(communication_implementations, implementation);
}
const char* name_of(AutoShardPolicy policy) { return name_in(auto_shard_policies, policy); }
const char* name_of(Activation activation) { return name_in(activation_names, activation); }
const char* name_of(Padding padding) { return name_in(padding_names, padding); }
const char* name_of(LossKind kind) { return name_in(loss_kinds, kind); }
const char* name_of(Reduction reduction) { return name_in(reductions, reduction); }
const char* name_of(ScheduleKind kind) { return name_in(schedule_kinds, kind); }
const char* name_of(OptimizerKind kind) { return name_in(optimizer_kinds, kind); }
const char* name_of(MetricKind kind) { return name_in(metric_kinds, kind); }
const char* name_of(ProgressMode mode) { return name_in(progress_modes, mode); }
const char* name_of(Parallelism parallelism) { return name_in(parallelisms, parallelism); }
const char* name_of(Precision precision) { return name_in(precisions, precision); }
const char* name_of(ReproducibilityMode mode) { return name_in(reproducibility_modes, mode); }
const char* name_of(IsaCap isa) { return name_in(isa_caps, isa); }

std::string location_prefix(const SourceLocation& given, const SourceLocation& fallback) {
  const SourceLocation& loc = given.line > 0 ? given : fallback;
  if (loc.line > 0) return fmt::format("{}:{}:{}: ", loc.file, loc.line, loc.column);
  return loc.file.empty() ? std::string() : loc.file + ": ";
}

std::string given_prefix(const SourceLocation& given, const SourceLocation& fallback) {
  if (given.line == 0 && given.file.starts_with("--set ")) return given.file + ": ";
  return location_prefix(given, fallback);
}

BatchKey batch_key(const Experiment& e, bool eval) {
  const SourceLocation file{e.source_file, 0, 0};
  if (eval && e.data.eval_batch_size > 0)
    return {given_prefix(e.eval_batch_where, file), "data.eval_batch_size", e.data.eval_batch_size};
  if (e.data.global_batch_size > 0)
    return {given_prefix(e.batch_where, file), "data.global_batch_size", e.data.global_batch_size};
  return {given_prefix(e.batch_where, file), "data.batch_size_per_replica", e.data.batch_size_per_replica};
}

Experiment parse_experiment(const std::string& yaml_text, const std::string& file_name,
                            const std::vector<std::string>& overrides) {
  Node root = detail::load_tree(yaml_text, file_name);
  // The file's own top level first: a list or a scalar there is the file's fault, not that of a
  // --set that cannot find its key in it.
  if (!root.is_null() && !root.is_map())
    fail(root.origin, fmt::format("expected a map of settings at the top level (name, data, model, ...), got {}",
                                  describe(root)));
  // The document is the file's even when it is empty and the overrides fill it, so that what is
  // missing is reported against the file, not against the --set that happened to create the map.
  const Origin document = root.origin;
  for (const std::string& assignment : overrides) detail::apply_override(root, assignment);
  root.origin = document;
  if (root.is_null()) root.kind = Node::Kind::map;  // an empty file: report what is missing
  if (!root.is_map())
    fail(root.origin, fmt::format("expected a map of settings at the top level (name, data, model, ...), got {}",
                                  describe(root)));
  return parse_tree(root, file_name);
}

StrategyConfig parse_strategy_section(const std::string& yaml_text, const std::string& file_name) {
  const Node root = detail::load_tree(yaml_text, file_name);
  return parse_strategy(root, root.origin);
}

Experiment load_experiment(const std::string& path, const std::vector<std::string>& overrides) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error))
    throw ConfigError(fmt::format("{}: is a directory, expected an experiment YAML file", path));
  std::ifstream file(path, std::ios::binary);
  if (!file)
    throw ConfigError(fmt::format("{}: cannot open experiment file ({}); check the path", path,
                                  std::strerror(errno)));
  std::ostringstream text;
  text << file.rdbuf();
  if (file.bad()) throw ConfigError(fmt::format("{}: cannot read experiment file; check the path", path));
  return parse_experiment(text.str(), path, overrides);
}

// The tables above, by the key they name: what `dtrain init` lists beside each key.
std::vector<std::string_view> choices_of(std::string_view key_path) {
  std::vector<std::string_view> names;
  auto from = [&](const auto& table) {
    for (const auto& entry : table) names.push_back(entry.name);
  };
  if (key_path == "precision") from(precisions);
  if (key_path == "strategy.kind") names = strategy_kind_names();
  if (key_path == "strategy.communication.implementation") from(communication_implementations);
  if (key_path == "data.source") from(source_kinds);
  if (key_path == "data.auto_shard") from(auto_shard_policies);
  if (key_path == "data.distribute") from(distribute_modes);
  if (key_path == "loss.kind") from(loss_kinds);
  if (key_path == "loss.reduction") from(reductions);
  if (key_path == "optimizer.kind") from(optimizer_kinds);
  if (key_path == "optimizer.learning_rate.schedule") from(schedule_kinds);
  if (key_path == "metrics") from(metric_kinds);
  if (key_path == "train.progress") from(progress_modes);
  if (key_path == "train.parallelism") from(parallelisms);
  if (key_path == "reproducibility.mode") from(reproducibility_modes);
  if (key_path == "reproducibility.isa") from(isa_caps);
  return names;
}

}  // namespace dtrain::config
