#include "config/experiment_template.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <sstream>
#include <string_view>
#include <vector>

#include "config/layers.hpp"
#include "config/parse.hpp"
#include "config/schema.hpp"
#include "config/strategies.hpp"
#include "core/error.hpp"

namespace dtrain::config {

namespace {

// The seed CNN of the tf.distribute tutorial, and a plain MLP for a first try on any flat data.
constexpr std::string_view cnn_layers = R"(
    - conv2d: {filters: 32, kernel_size: 3, activation: relu}
    - max_pool2d: {pool_size: 2}
    - conv2d: {filters: 64, kernel_size: 3, activation: relu}
    - max_pool2d: {pool_size: 2}
    - flatten: {}
    - dense: {units: 64, activation: relu}
    - dense: {units: 10})";
constexpr std::string_view mlp_layers = R"(
    - flatten: {}
    - dense: {units: 128, activation: relu}
    - dense: {units: 10})";

// What the template says about one key: comment lines above it, a comment beside it (the
// parser's choices for the key are appended), and commented-out lines below it (keys that belong
// to another kind, or left out by default).
struct Note {
  std::string path;
  std::string above;
  std::string beside;
  std::string after;
  std::vector<std::string_view> choices = {};  // when the parser's tables (choices_of) do not list them
};

// "a | b | c": the names a key takes, as the comments list them.
std::string joined(const std::vector<std::string_view>& names, std::string_view separator) {
  return fmt::format("{}", fmt::join(names, separator));
}

// One line per registered layer kind: its aliases and option keys.
std::string layer_catalogue() {
  std::vector<const LayerSchema*> schemas;
  for (std::string_view name : layer_kind_names()) {
    const LayerSchema* schema = find_layer_schema(name);
    if (schema && std::find(schemas.begin(), schemas.end(), schema) == schemas.end()) schemas.push_back(schema);
  }
  std::sort(schemas.begin(), schemas.end(), [](const auto* a, const auto* b) { return a->kind < b->kind; });
  std::string out;
  for (const LayerSchema* schema : schemas) {
    std::string line = fmt::format("  {}", schema->kind);
    if (!schema->aliases.empty()) line += fmt::format(" (or {})", joined(schema->aliases, ", "));
    line += ": " + (schema->keys.empty() ? std::string("no options") : joined(schema->keys, ", "));
    out += line + "\n";
  }
  std::vector<std::string_view> activations, paddings;
  for (const auto& a : activation_names) activations.push_back(a.name);
  for (const auto& p : padding_names) paddings.push_back(p.name);
  out += fmt::format("where activation is {}, padding is {}; every layer also takes name: (left out:\n"
                     "Keras' automatic name, conv2d, conv2d_1, ...)",
                     joined(activations, " | "), joined(paddings, " | "));
  return out;
}

// The lines of top-level section `section` of to_yaml's block text, without their indentation
// (every value there is one line: a scalar or a flow collection).
std::vector<std::string> section_lines(const std::string& yaml, std::string_view section) {
  std::vector<std::string> out;
  std::istringstream in(yaml);
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] != ' ') {
      inside = line == std::string(section) + ":";
      continue;
    }
    if (inside && line.compare(0, 2, "  ") == 0) out.push_back(line.substr(2));
  }
  return out;
}

std::string key_of(const std::string& line) { return line.substr(0, line.find(':')); }

// Another kind of something than the template's (data source, schedule, optimizer) as the parser
// reads and to_yaml writes it: the skeleton with `assignment` (a --set) applied, resolved. So the
// keys each kind takes, and their defaults, are the parser's own. An InternalError when the
// parser refuses the example: a kind that needs values this file has no example of.
std::string resolved_with(const std::string& skeleton, const std::string& assignment) {
  try {
    return to_yaml(parse_experiment(skeleton, "dtrain init", {assignment}));
  } catch (const ConfigError& e) {
    throw InternalError(fmt::format("dtrain init has no valid example for --set {}: {}", assignment, e.what()));
  }
}

// Example values for the kinds whose keys are required (the others are written with their
// defaults), and what each kind does, for the comment beside it.
struct Example {
  std::string_view kind;
  std::string_view value;  // the YAML of the whole map
  std::string_view what;
};
constexpr Example source_examples[] = {
    {"idx", "{source: idx, path: my_idx_files}", ""},
    {"hdf5", "{source: hdf5, path: my_data.h5}", ""},
    {"synthetic", "{source: synthetic}", "random images of `classes` classes"},
    {"tensors", "{source: tensors, x: [1.0], y: [1.0], size: 100}",
     "one example (x, y) repeated `size` times, as tf.data.Dataset.from_tensors(...).repeat(size)"},
};
constexpr Example schedule_examples[] = {
    {"exponential_decay",
     "{schedule: exponential_decay, initial_learning_rate: 0.001, decay_steps: 1000, decay_rate: 0.96}",
     "initial_learning_rate * decay_rate ^ (step / decay_steps); staircase: true floors the exponent"},
    {"piecewise_constant", "{schedule: piecewise_constant, boundaries: [1000, 2000], values: [0.001, 0.0005, 0.0001]}",
     "values[0] up to step boundaries[0], then values[1], ...: one more value than boundaries"},
    {"cosine_decay", "{schedule: cosine_decay, initial_learning_rate: 0.001, decay_steps: 10000}",
     "from initial_learning_rate down to alpha times it over decay_steps, along a half cosine"},
};

const Example* example_of(std::span<const Example> examples, std::string_view kind) {
  for (const Example& e : examples)
    if (e.kind == kind) return &e;
  return nullptr;
}

// "   # what it does" beside an example line, or nothing.
std::string comment_of(const Example* example) {
  return example && !example->what.empty() ? "   # " + std::string(example->what) : std::string();
}

// The keys of the data sources other than `chosen`, each source's on one commented line: the keys
// its section has that the chosen source's has not.
std::string other_sources(const std::string& skeleton, const std::string& yaml, std::string_view chosen) {
  std::vector<std::string> known;
  for (const std::string& line : section_lines(yaml, "data")) known.push_back(key_of(line));
  std::string out;
  for (std::string_view kind : choices_of("data.source")) {
    if (kind == chosen) continue;
    const Example* example = example_of(source_examples, kind);
    const std::string value = example ? std::string(example->value) : fmt::format("{{source: {}}}", kind);
    std::vector<std::string> own;
    for (const std::string& line : section_lines(resolved_with(skeleton, "data=" + value), "data"))
      if (std::find(known.begin(), known.end(), key_of(line)) == known.end()) own.push_back(line);
    if (own.empty()) continue;  // a source that only reads another path
    out += fmt::format("{}   # source: {} only{}\n", fmt::join(own, ", "), kind,
                       example && !example->what.empty() ? ": " + std::string(example->what) : "");
  }
  if (!out.empty()) out.pop_back();  // the note's last line ends without a newline
  return out;
}

// One commented line per learning-rate schedule other than a plain number.
std::string schedules(const std::string& skeleton) {
  std::string out;
  for (std::string_view kind : choices_of("optimizer.learning_rate.schedule")) {
    if (kind == name_of(ScheduleKind::constant)) continue;  // the number the template writes
    const Example* example = example_of(schedule_examples, kind);
    const std::string value = example ? std::string(example->value) : fmt::format("{{schedule: {}}}", kind);
    const std::string resolved = resolved_with(skeleton, "optimizer.learning_rate=" + value);
    for (const std::string& line : section_lines(resolved, "optimizer"))
      if (key_of(line) == "learning_rate") out += line + comment_of(example) + "\n";
  }
  if (!out.empty()) out.pop_back();
  return out;
}

// The keys each optimizer kind adds to kind and learning_rate, with their defaults.
std::string optimizer_keys(const std::string& skeleton) {
  std::vector<std::string> kinds;
  for (std::string_view kind : choices_of("optimizer.kind")) {
    std::vector<std::string> own;
    const std::string resolved = resolved_with(skeleton, fmt::format("optimizer={{kind: {}}}", kind));
    for (const std::string& line : section_lines(resolved, "optimizer"))
      if (key_of(line) != "kind" && key_of(line) != "learning_rate") own.push_back(line);
    kinds.push_back(fmt::format("{} takes {}", kind, fmt::join(own, ", ")));
  }
  return fmt::format("{}", fmt::join(kinds, "; "));
}

// The words of `text` in lines of at most `width` columns (a longer word on a line of its own).
std::string wrapped(const std::string& text, std::size_t width) {
  std::string out, line;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  return out + line;
}

// The TODO(strategy) comment: every registered kind, in order, and what it does (kinds listed
// together that do the same share one summary: "a and b: one replica"), wrapped at 93 columns;
// the closing sentence, on `dtrain init --strategy`, ends the last line whole.
std::string strategy_todo() {
  const std::vector<const StrategySchema*> all = strategy_schemas();
  std::vector<std::string> kinds;
  for (std::size_t i = 0; i < all.size();) {
    std::size_t end = i + 1;
    while (end < all.size() && all[end]->summary == all[i]->summary) ++end;
    std::string names(all[i]->kind);
    for (std::size_t k = i + 1; k < end; ++k) names += (k + 1 == end ? " and " : ", ") + std::string(all[k]->kind);
    kinds.push_back(fmt::format("{}: {}", names, all[i]->summary));
    i = end;
  }
  return wrapped(fmt::format("TODO(strategy): how the replicas are laid out, as tf.distribute's strategy. {}.",
                             fmt::join(kinds, "; ")),
                 93) +
         " `dtrain init --strategy KIND` writes another kind's keys.";
}

std::vector<Note> notes(const std::string& skeleton, const Experiment& experiment, const std::string& yaml) {
  std::vector<Note> n;
  n.push_back({"name", "", "names the run directory: runs/<name>", ""});
  n.push_back({"seed", "", "fixes every random draw: initialization, shuffles, dropout", ""});
  n.push_back({"precision", "", "the dtype conv and dense layers compute in; variables stay float32", ""});
  n.push_back({"strategy", strategy_todo(), "", ""});
  n.push_back({"strategy.kind", "", "", ""});
  // The chosen kind's notes on its keys (config/strategies.hpp).
  if (const auto notes_of_kind = strategy_schema(experiment.strategy.kind).notes)
    for (const TemplateNote& note : notes_of_kind())
      n.push_back({"strategy." + std::string(note.key), note.above, note.beside, note.after, note.choices});
  n.push_back({"data",
               "TODO(dataset): your data. fashion_mnist and idx read a directory of MNIST-style IDX files\n"
               "(optionally .gz); hdf5 reads one file with groups /train and /test holding x (images, channels\n"
               "last) and y (labels); synthetic makes random images; tensors repeats one example.",
               "", ""});
  n.push_back({"data.source", "", "", other_sources(skeleton, yaml, name_of(experiment.data.source))});
  n.push_back({"data.path", "", "fashion_mnist, idx: a directory; hdf5: a file",
               "shards: [x-00000-of-00002.h5, x-00001-of-00002.h5]   # hdf5 only, instead of path: the data split "
               "into files (tools/make_shards)"});
  n.push_back({"data.shards", "", "hdf5: the data split into files, one or more per worker", ""});
  n.push_back({"data.batch_size_per_replica", "", "the global batch is this times the replicas in sync",
               "global_batch_size: 128   # instead of batch_size_per_replica: ceil(128 / replicas) to each in "
               "turn"});
  n.push_back({"data.global_batch_size", "", "split as tf.distribute splits it: ceil(G / replicas) to each in turn", ""});
  n.push_back({"data.shuffle_buffer", "", "0 = no shuffle; >= the training set = a full shuffle", ""});
  n.push_back({"data.drop_remainder", "", "drop each epoch's short last batch", ""});
  n.push_back({"data.distribute", "", "per_replica = distribute_datasets_from_function, one pipeline per replica", ""});
  n.push_back({"data.auto_shard", "", "how MPI workers split the input (tf.data's AutoShardPolicy)", ""});
  n.push_back({"data.validation_split", "", "the last fraction of the training set held out as validation, [0, 1)", ""});
  n.push_back({"data.eval_batch_size", "", "0 = the global batch", ""});
  n.push_back({"data.prefetch", "", "prepare the next batch while the step runs", ""});
  n.push_back({"model",
               "TODO(model): your model, a Keras Sequential: the input shape (channels last, no batch axis)\n"
               "and the layers in order. The last layer gives the logits. Layer kinds and their options:\n" +
                   layer_catalogue(),
               "", ""});
  n.push_back({"model.input_shape", "", "channels last, without the batch dimension",
               "initial_weights: model.weights.h5   # start from weights Keras saved (model.save_weights) or dtrain "
               "export --format keras wrote, instead of the seed's initialization"});
  n.push_back({"model.initial_weights", "", "a Keras 3 .weights.h5 file; left out: the seed's initialization", ""});
  n.push_back({"loss", "", "", ""});
  n.push_back({"loss.kind", "", "", ""});
  n.push_back({"loss.from_logits", "", "true: the model ends without a softmax", ""});
  n.push_back({"loss.reduction",
               "TODO(loss reduction): none (or sum) under any strategy: dtrain divides the summed per-example\n"
               "losses by the GLOBAL batch, as tf.nn.compute_average_loss does. auto and sum_over_batch_size\n"
               "average over one replica's share, so they are refused under every strategy but default.",
               "", ""});
  n.push_back({"optimizer", "", "", ""});
  n.push_back({"optimizer.kind", "", "Keras (3) formulas and defaults", optimizer_keys(skeleton)});
  n.push_back({"optimizer.learning_rate", "",
               fmt::format("a number, or {{schedule: {}, ...}}", joined(choices_of("optimizer.learning_rate.schedule"), " | ")),
               schedules(skeleton)});
  n.push_back({"optimizer.beta_1", "", "decay of the gradient's running mean", ""});
  n.push_back({"optimizer.beta_2", "", "decay of the squared gradient's running mean", ""});
  n.push_back({"optimizer.epsilon", "", "added to the denominator for stability", ""});
  n.push_back({"optimizer.momentum", "", "0 = plain gradient descent", ""});
  n.push_back({"optimizer.nesterov", "", "Nesterov momentum", ""});
  n.push_back({"optimizer.rho", "", "decay of the squared gradient's running mean", ""});
  n.push_back({"optimizer.centered", "", "divide by the gradient's variance instead of its second moment", ""});
  n.push_back({"metrics",
               "TODO(metrics): the first metric is printed as Accuracy (train) and Test Accuracy; the loss is\n"
               "always reported.",
               "", ""});
  n.push_back({"train", "", "", ""});
  n.push_back({"train.epochs", "TODO(epochs): how many passes over the training set.", "", ""});
  n.push_back({"train.steps_per_epoch", "", "0 = the whole training set each epoch", ""});
  n.push_back({"train.threads", "", "compute threads; 0 = every core (shared with the other ranks on the node)", ""});
  n.push_back({"train.parallelism", "",
               "batch: each thread computes a slice of the batch; operations: threads share each layer", ""});
  n.push_back({"train.progress", "", "auto: a bar only on a person's terminal, never under mpirun", ""});
  n.push_back({"train.plot", "", "true: redraw <run dir>/curves.png after each epoch (needs gnuplot)", ""});
  n.push_back({"train.tensorboard", "", "true: TensorBoard event files in <run dir>/tensorboard/ (the chief's)", ""});
  n.push_back({"train.log_every_steps", "", "TensorBoard's train/step_loss every N global steps; 0 = none", ""});
  n.push_back({"checkpoint", "", "", ""});
  n.push_back({"checkpoint.every_epochs", "", "save after every N-th epoch; 0 = never by epoch", ""});
  n.push_back({"checkpoint.every_steps", "", "save after every N-th global step; 0 = never by step", ""});
  n.push_back({"checkpoint.max_to_keep", "", "the newest N checkpoints are kept",
               "dir: runs/<name>/checkpoints   # where checkpoints go; left out: <run dir>/checkpoints"});
  n.push_back({"checkpoint.dir", "", "", ""});
  return n;
}

// Writes `text`'s lines as comments at `indent`.
void comment_lines(std::string& out, std::size_t indent, const std::string& text) {
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    out += std::string(indent, ' ') + "# " + text.substr(start, end - start) + "\n";
    start = end + 1;
  }
}

// Adds the notes to to_yaml's block-style text, following each line's key path by indentation.
std::string annotate(const std::string& skeleton, const Experiment& experiment, const std::string& yaml) {
  const std::vector<Note> all = notes(skeleton, experiment, yaml);
  std::vector<std::pair<std::size_t, std::string>> open;  // (indent, key) of the enclosing maps
  std::string out;
  std::size_t start = 0;
  bool first = true;
  bool previous_top_scalar = false;
  while (start < yaml.size()) {
    std::size_t end = yaml.find('\n', start);
    if (end == std::string::npos) end = yaml.size();
    const std::string line = yaml.substr(start, end - start);
    start = end + 1;
    const std::size_t indent = line.find_first_not_of(' ');
    if (indent == std::string::npos || line.compare(indent, 2, "- ") == 0) {
      out += line + "\n";  // a layer of model.layers: its options are all written out already
      continue;
    }
    const std::string key = line.substr(indent, line.find(':', indent) - indent);
    while (!open.empty() && open.back().first >= indent) open.pop_back();
    std::string path;
    for (const auto& [unused, k] : open) path += k + ".";
    path += key;
    if (line.back() == ':') open.emplace_back(indent, key);

    // A blank line before each section; name, seed and precision stay together.
    const bool top_scalar = indent == 0 && line.back() != ':';
    if (indent == 0 && !first && !(top_scalar && previous_top_scalar)) out += "\n";
    first = false;
    previous_top_scalar = top_scalar;
    std::string beside;
    std::string after;
    std::vector<std::string_view> choices = choices_of(path);
    for (const Note& note : all) {
      if (note.path != path) continue;
      comment_lines(out, indent, note.above);
      if (!note.beside.empty()) beside = note.beside;
      if (!note.after.empty()) after += note.after + "\n";
      if (!note.choices.empty()) choices = note.choices;
    }
    if (!choices.empty()) beside = joined(choices, " | ") + (beside.empty() ? "" : "; " + beside);
    if (beside.empty()) {
      out += line + "\n";
    } else {
      constexpr std::size_t comment_column = 34;
      out += line + std::string(line.size() < comment_column ? comment_column - line.size() : 2, ' ') + "# " + beside +
             "\n";
    }
    comment_lines(out, indent, after);
  }
  return out;
}

}  // namespace

std::string launcher_for(std::string_view strategy) {
  const StrategySchema* schema = strategy.empty() ? &default_strategy_schema() : find_strategy_schema(strategy);
  return schema ? std::string(schema->launcher) : std::string();
}

std::string experiment_template(const TemplateOptions& options) {
  std::string_view layers;
  if (options.model == "cnn") layers = cnn_layers;
  if (options.model == "mlp") layers = mlp_layers;
  if (layers.empty()) throw ConfigError(fmt::format("unknown model '{}'; valid: cnn, mlp", options.model));
  const std::vector<std::string_view> kinds = choices_of("strategy.kind");
  const StrategySchema* strategy =
      options.strategy.empty() ? &default_strategy_schema() : find_strategy_schema(options.strategy);
  if (!strategy)
    throw ConfigError(fmt::format("unknown strategy kind '{}'; valid: {}", options.strategy, joined(kinds, ", ")));
  // Only what differs from the defaults; to_yaml writes every other key with its default value. A
  // kind may add options its template needs (a parameter-server job its cluster spelt out).
  const std::string skeleton = fmt::format(
      "name: '{}'\n"
      "strategy: {{kind: {}{}}}\n"
      "data: {{source: fashion_mnist, path: /usr/share/datasets/fashion-mnist}}\n"
      "model:\n  input_shape: [28, 28, 1]\n  layers:{}\n"
      "loss: {{kind: sparse_categorical_crossentropy, from_logits: true, reduction: none}}\n"
      "metrics: [sparse_categorical_accuracy]\n",
      options.name, strategy->kind,
      strategy->template_options.empty() ? std::string() : ", " + std::string(strategy->template_options), layers);
  const Experiment experiment = parse_experiment(skeleton, "dtrain init");
  std::string out = fmt::format(
      "# A dtrain experiment (strategy {}, model {}) written by `dtrain init`: every key with its\n"
      "# default value, the values a key takes beside it, and TODOs where a custom training loop\n"
      "# needs your choices. `dtrain validate FILE` checks it; `{}dtrain run FILE` trains it.\n\n",
      strategy->kind, options.model, strategy->launcher);
  return out + annotate(skeleton, experiment, to_yaml(experiment));
}

}  // namespace dtrain::config
