// The vocabulary every part of an experiment is read and written with: typed readers of YAML
// nodes whose errors name file:line:column (or the --set text) and suggest the nearest valid
// spelling, a Section that refuses unknown keys, and a writer for the resolved YAML.
//
// The experiment's own sections use it (parse.cpp, to_yaml.cpp), and so does every layer file in
// nn/ and every strategy file in distribute/, which read and write their own options with it
// (config/layers.hpp, config/strategies.hpp): the schema of a layer or a strategy lives with it,
// the error messages stay the same everywhere.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config/experiment.hpp"
#include "config/yaml_tree.hpp"
#include "core/error.hpp"

namespace YAML {
class Emitter;
}

namespace dtrain::config {

using detail::fail;
using detail::Node;
using detail::Origin;

// A YAML spelling of an enum value.
template <class E>
struct Named {
  std::string_view name;
  E value;
};

inline constexpr Named<Activation> activation_names[] = {{"linear", Activation::linear},
                                                         {"relu", Activation::relu},
                                                         {"sigmoid", Activation::sigmoid},
                                                         {"tanh", Activation::tanh},
                                                         {"softmax", Activation::softmax}};
inline constexpr Named<Padding> padding_names[] = {{"valid", Padding::valid}, {"same", Padding::same}};

// ---------------------------------------------------------------- suggestions

// The closest candidate when `word` is plausibly a typo of it (case-insensitive edit distance).
std::optional<std::string_view> nearest(std::string_view word, std::span<const std::string_view> candidates);
// "; did you mean 'x'?" or nothing.
std::string did_you_mean(std::string_view word, std::span<const std::string_view> candidates);
std::string join(std::span<const std::string_view> names);

// ---------------------------------------------------------------- typed reading of nodes
// `path` is the dotted key path ("model.layers.0.conv2d.filters") that messages name.

std::string child(const std::string& path, std::string_view key);
// How a node reads in a message: 'text', a list, a map, nothing.
std::string describe(const Node& node);
[[noreturn]] void type_error(const Node& node, const std::string& path, std::string_view expected);
[[noreturn]] void range_error(const Node& node, const std::string& path, std::string_view rule);

std::int64_t read_int(const Node& node, const std::string& path);
int read_int32(const Node& node, const std::string& path);
std::uint64_t read_uint64(const Node& node, const std::string& path);
double read_number(const Node& node, const std::string& path);
bool read_bool(const Node& node, const std::string& path);
std::string read_string(const Node& node, const std::string& path);
const Node& expect_list(const Node& node, const std::string& path, std::string_view of_what);
std::vector<std::int64_t> read_int_list(const Node& node, const std::string& path);
std::vector<double> read_number_list(const Node& node, const std::string& path);
// A shape without the batch dimension: non-empty, every entry >= 1, one example fits in memory.
std::vector<std::int64_t> read_shape(const Node& node, const std::string& path);
// Refuses (at `node`, naming `path`) a value whose `what` needs `bytes` (nullopt: more than 64
// bits count) when that is more than the machine's physical memory.
void check_memory(const Node& node, const std::string& path, std::optional<std::int64_t> bytes, std::string_view what);
// Keras' int-or-pair arguments (kernel_size, strides, pool_size); every entry >= 1.
std::array<int, 2> read_pair(const Node& node, const std::string& path);
// {l2: x}, x >= 0.
Regularizer read_regularizer(const Node& node, const std::string& path);

// One of `names` (a kind of something: `what`), as the index of the one written.
std::size_t read_name(const Node& node, const std::string& path, std::string_view what,
                      std::span<const std::string_view> names);

template <class E, std::size_t N>
E read_enum(const Node& node, const std::string& path, std::string_view what, const Named<E> (&table)[N]) {
  std::vector<std::string_view> names;
  for (const auto& entry : table) names.push_back(entry.name);
  return table[read_name(node, path, what, names)].value;
}

template <class E, std::size_t N>
const char* name_in(const Named<E> (&table)[N], E value) {
  for (const auto& entry : table)
    if (entry.value == value) return entry.name.data();
  throw InternalError("an enum value without a YAML name");
}

bool positive(double v);
bool non_negative(double v);
bool unit_interval_open(double v);    // [0, 1)
bool unit_interval_closed(double v);  // [0, 1]

// A map of settings. Unknown keys are reported first (with the nearest valid key), so that a
// typo in a required key reads "did you mean" rather than "missing".
class Section {
 public:
  Section(const Node& node, std::string path, std::span<const std::string_view> keys);

  const Node* find(std::string_view key) const { return node_.find(key); }
  // Where the key is written, or the section itself when the key is left out.
  Origin key_origin(std::string_view key) const;
  const Node& require(std::string_view key) const;
  std::string path(std::string_view key) const { return child(path_, key); }
  const std::string& path() const { return path_; }
  const Node& node() const { return node_; }

  // A key that only some kinds (of optimizer, data source, ...) accept.
  void only_for(std::string_view key, bool applies, std::string_view kinds, std::string_view chosen) const;

  template <class T, class Read>
  void get(std::string_view key, T& out, Read read) const {
    if (const Node* value = find(key)) out = read(*value, path(key));
  }
  void get_int(std::string_view key, std::int64_t& out, std::int64_t minimum) const;
  void get_int(std::string_view key, int& out, int minimum) const;
  void get_bool(std::string_view key, bool& out) const { get(key, out, read_bool); }
  // A number that `ok` accepts; `rule` is how the accepted range reads in messages.
  void get_number(std::string_view key, double& out, bool (*ok)(double), std::string_view rule) const;
  template <class E, std::size_t N>
  void get_enum(std::string_view key, E& out, std::string_view what, const Named<E> (&table)[N]) const {
    if (const Node* value = find(key)) out = read_enum(*value, path(key), what, table);
  }
  // A required integer >= minimum.
  int require_int(std::string_view key, int minimum) const;

 private:
  const Node& node_;
  std::string path_;
};

// ---------------------------------------------------------------- writing

// Shortest text that reads back to the same double, always with a '.' so that other YAML readers
// (PyYAML's 1.1 rules) also see a float: 1.0, 0.001, 1.0e-05.
std::string yaml_number(double value);

// The options of one layer or strategy (or any map) as resolved YAML, key by key.
class OptionsWriter {
 public:
  explicit OptionsWriter(YAML::Emitter& out) : out_(out) {}
  void integer(std::string_view key, std::int64_t value);
  void boolean(std::string_view key, bool value);
  void number(std::string_view key, double value);
  void text(std::string_view key, std::string_view value);
  void pair(std::string_view key, const std::array<int, 2>& value);
  void integers(std::string_view key, const std::vector<std::int64_t>& values);
  void regularizer(std::string_view key, const Regularizer& value);
  void texts(std::string_view key, const std::vector<std::string>& values);  // a flow list
  // A flow map under `key`: the keys written until end_map() are its.
  void begin_map(std::string_view key);
  void end_map();
  template <class E, std::size_t N>
  void enumeration(std::string_view key, const Named<E> (&table)[N], E value) {
    text(key, name_in(table, value));
  }

 private:
  YAML::Emitter& out_;
};

}  // namespace dtrain::config
