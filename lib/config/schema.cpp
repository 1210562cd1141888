#include "config/schema.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

#include "core/checked.hpp"
#include "core/machine.hpp"
#include "core/tensor.hpp"

namespace dtrain::config {

// ---------------------------------------------------------------- suggestions

namespace {

// Optimal string alignment distance (Levenshtein plus adjacent swaps), case-insensitive, so that
// "epoch", "Adam" and "sdg" all find their intended spelling.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  auto lower = [](char c) { return static_cast<char>(std::tolower(static_cast<unsigned char>(c))); };
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = lower(a[i - 1]) == lower(b[j - 1]) ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && lower(a[i - 1]) == lower(b[j - 2]) && lower(a[i - 2]) == lower(b[j - 1]))
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

}  // namespace

// The closest candidate when it is plausibly a typo: a third of the word may be wrong (at least
// two edits for short words), but never the whole candidate.
std::optional<std::string_view> nearest(std::string_view word, std::span<const std::string_view> candidates) {
  std::optional<std::string_view> best;
  std::size_t best_distance = std::numeric_limits<std::size_t>::max();
  for (std::string_view candidate : candidates) {
    const std::size_t distance = edit_distance(word, candidate);
    const std::size_t allowed = std::max<std::size_t>(2, candidate.size() / 3);
    if (distance <= allowed && distance < candidate.size() && distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

std::string join(std::span<const std::string_view> names) {
  std::string out;
  for (std::string_view name : names) {
    if (!out.empty()) out += ", ";
    out += name;
  }
  return out;
}

std::string did_you_mean(std::string_view word, std::span<const std::string_view> candidates) {
  if (auto best = nearest(word, candidates)) return fmt::format("; did you mean '{}'?", *best);
  return {};
}

// ---------------------------------------------------------------- typed reading of nodes

std::size_t read_name(const Node& node, const std::string& path, std::string_view what,
                      std::span<const std::string_view> names) {
  if (!node.is_scalar()) type_error(node, path, "a " + std::string(what) + " (" + join(names) + ")");
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == node.scalar) return i;
  fail(node.origin, "unknown " + std::string(what) + " '" + node.scalar + "'; valid: " + join(names) +
                        did_you_mean(node.scalar, names));
}

std::string child(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : fmt::format("{}.{}", path, key);
}

std::string describe(const Node& node) {
  // An error is one line a person reads: a long value is cut (at a UTF-8 character boundary)
  // and its length given instead of the rest.
  constexpr std::size_t kShown = 60;
  switch (node.kind) {
    case Node::Kind::null: return "nothing";
    case Node::Kind::scalar: {
      if (node.scalar.size() <= kShown + 20) return fmt::format("'{}'", node.scalar);
      std::size_t cut = kShown;
      while (cut > 0 && (static_cast<unsigned char>(node.scalar[cut]) & 0xC0) == 0x80) --cut;
      return fmt::format("'{}...' ({} bytes)", node.scalar.substr(0, cut), node.scalar.size());
    }
    case Node::Kind::sequence: return "a list";
    case Node::Kind::map: return "a map";
  }
  return "?";
}

void type_error(const Node& node, const std::string& path, std::string_view expected) {
  fail(node.origin, fmt::format("{}: expected {}, got {}", path, expected, describe(node)));
}

void range_error(const Node& node, const std::string& path, std::string_view rule) {
  fail(node.origin, fmt::format("{}: must be {}, got {}", path, rule, describe(node)));
}

std::int64_t read_int(const Node& node, const std::string& path) {
  if (!node.is_scalar()) type_error(node, path, "an integer");
  std::string_view text = node.scalar;
  if (text.size() > 1 && text.front() == '+') text.remove_prefix(1);
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error == std::errc::result_out_of_range) range_error(node, path, "a 64-bit integer");
  if (error != std::errc() || end != text.data() + text.size()) type_error(node, path, "an integer");
  return value;
}

int read_int32(const Node& node, const std::string& path) {
  const std::int64_t value = read_int(node, path);
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max())
    range_error(node, path, "a 32-bit integer");
  return static_cast<int>(value);
}

std::uint64_t read_uint64(const Node& node, const std::string& path) {
  if (!node.is_scalar()) type_error(node, path, "a non-negative integer");
  std::string_view text = node.scalar;
  if (text.size() > 1 && text.front() == '+') text.remove_prefix(1);
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error == std::errc::result_out_of_range) range_error(node, path, "at most 18446744073709551615");
  if (error != std::errc() || end != text.data() + text.size()) type_error(node, path, "a non-negative integer");
  return value;
}

double read_number(const Node& node, const std::string& path) {
  if (!node.is_scalar()) type_error(node, path, "a number");
  std::string_view text = node.scalar;
  if (text.size() > 1 && text.front() == '+') text.remove_prefix(1);
  double value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error == std::errc::result_out_of_range) range_error(node, path, "a finite double-precision number");
  if (error != std::errc() || end != text.data() + text.size() || !std::isfinite(value))
    type_error(node, path, "a number");
  return value;
}

bool read_bool(const Node& node, const std::string& path) {
  if (node.is_scalar()) {
    const std::string& t = node.scalar;
    if (t == "true" || t == "True" || t == "TRUE") return true;
    if (t == "false" || t == "False" || t == "FALSE") return false;
  }
  type_error(node, path, "true or false");
}

std::string read_string(const Node& node, const std::string& path) {
  if (!node.is_scalar()) type_error(node, path, "a string");
  return node.scalar;
}

const Node& expect_list(const Node& node, const std::string& path, std::string_view of_what) {
  if (!node.is_sequence()) type_error(node, path, fmt::format("a list of {}", of_what));
  return node;
}

std::vector<std::int64_t> read_int_list(const Node& node, const std::string& path) {
  std::vector<std::int64_t> out;
  for (std::size_t i = 0; const Node& item : expect_list(node, path, "integers").items)
    out.push_back(read_int(item, child(path, std::to_string(i++))));
  return out;
}

std::vector<double> read_number_list(const Node& node, const std::string& path) {
  std::vector<double> out;
  for (std::size_t i = 0; const Node& item : expect_list(node, path, "numbers").items)
    out.push_back(read_number(item, child(path, std::to_string(i++))));
  return out;
}

// A shape without the batch dimension: non-empty, every entry >= 1.
std::vector<std::int64_t> read_shape(const Node& node, const std::string& path) {
  std::vector<std::int64_t> shape = read_int_list(node, path);
  if (shape.empty()) range_error(node, path, "a non-empty list of dimensions");
  // A batch dimension is added in front, and tensors have at most Shape::kMaxRank dimensions.
  if (shape.size() > Shape::kMaxRank - 1)
    range_error(node, path, fmt::format("at most {} dimensions (the batch dimension makes {})", Shape::kMaxRank - 1,
                                        Shape::kMaxRank));
  for (std::size_t i = 0; i < shape.size(); ++i)
    if (shape[i] < 1) range_error(node.items[i], child(path, std::to_string(i)), ">= 1");
  const auto elements = checked_product(shape);
  check_memory(node, path, elements ? checked_mul(*elements, 4) : std::nullopt, "one example of this shape");
  return shape;
}

void check_memory(const Node& node, const std::string& path, std::optional<std::int64_t> bytes, std::string_view what) {
  const MemoryLimit memory = usable_memory();
  if (bytes && *bytes <= memory.bytes) return;
  fail(node.origin, fmt::format("{}: {} needs {}, more than {}; choose a smaller value", path,
                                what, bytes ? format_bytes(*bytes) : "more than 8 EB", describe(memory)));
}

// Keras' int-or-pair arguments (kernel_size, strides, pool_size); every entry >= 1.
std::array<int, 2> read_pair(const Node& node, const std::string& path) {
  constexpr std::string_view expected = "an integer or a list of two integers";
  if (node.is_scalar()) {
    const int value = read_int32(node, path);
    if (value < 1) range_error(node, path, ">= 1");
    return {value, value};
  }
  if (!node.is_sequence() || node.items.size() != 2) type_error(node, path, expected);
  std::array<int, 2> out{};
  for (std::size_t i = 0; i < 2; ++i) {
    const std::string item_path = child(path, std::to_string(i));
    out[i] = read_int32(node.items[i], item_path);
    if (out[i] < 1) range_error(node.items[i], item_path, ">= 1");
  }
  return out;
}


Section::Section(const Node& node, std::string path, std::span<const std::string_view> keys)
    : node_(node), path_(std::move(path)) {
  if (node.is_null()) return;  // "train:" with nothing under it: all defaults
  if (!node.is_map()) type_error(node, path_.empty() ? "the experiment" : path_, "a map of settings");
  for (const auto& entry : node.entries) {
    if (std::find(keys.begin(), keys.end(), entry.key) != keys.end()) continue;
    const std::string where = path_.empty() ? "at top level" : "in " + path_;
    if (auto best = nearest(entry.key, keys))
      fail(entry.key_origin, fmt::format("unknown key '{}' {}; did you mean '{}'?", entry.key, where, *best));
    fail(entry.key_origin, fmt::format("unknown key '{}' {}; valid keys: {}", entry.key, where, join(keys)));
  }
}

Origin Section::key_origin(std::string_view key) const {
  for (const auto& entry : node_.entries)
    if (entry.key == key) return entry.key_origin;
  return node_.origin;
}

const Node& Section::require(std::string_view key) const {
  if (const Node* value = find(key)) return *value;
  const std::string prefix = path_.empty() ? "" : path_ + ": ";
  fail(node_.origin, fmt::format("{}missing required key '{}'", prefix, key));
}

void Section::only_for(std::string_view key, bool applies, std::string_view kinds, std::string_view chosen) const {
  if (applies) return;
  for (const auto& entry : node_.entries)
    if (entry.key == key)
      fail(entry.key_origin,
           fmt::format("{}: applies only to {}, not to {}; remove it or change the kind", path(key), kinds, chosen));
}

void Section::get_int(std::string_view key, std::int64_t& out, std::int64_t minimum) const {
  if (const Node* value = find(key)) {
    out = read_int(*value, path(key));
    if (out < minimum) range_error(*value, path(key), fmt::format(">= {}", minimum));
  }
}

void Section::get_int(std::string_view key, int& out, int minimum) const {
  if (const Node* value = find(key)) {
    out = read_int32(*value, path(key));
    if (out < minimum) range_error(*value, path(key), fmt::format(">= {}", minimum));
  }
}

int Section::require_int(std::string_view key, int minimum) const {
  const Node& value = require(key);
  const int out = read_int32(value, path(key));
  if (out < minimum) range_error(value, path(key), fmt::format(">= {}", minimum));
  return out;
}

void Section::get_number(std::string_view key, double& out, bool (*ok)(double), std::string_view rule) const {
  if (const Node* value = find(key)) {
    out = read_number(*value, path(key));
    if (!ok(out)) range_error(*value, path(key), rule);
  }
}

bool positive(double v) { return v > 0; }
bool non_negative(double v) { return v >= 0; }
bool unit_interval_open(double v) { return v >= 0 && v < 1; }
bool unit_interval_closed(double v) { return v >= 0 && v <= 1; }

Regularizer read_regularizer(const Node& node, const std::string& path) {
  static constexpr std::string_view keys[] = {"l2"};
  Section s(node, path, keys);
  Regularizer out;
  s.get_number("l2", out.l2, non_negative, ">= 0");
  return out;
}

// ---------------------------------------------------------------- writing

std::string yaml_number(double value) {
  std::string text = fmt::format("{}", value);
  if (text.find_first_of(".ein") != std::string::npos) {
    const auto e = text.find('e');
    if (e != std::string::npos && text.find('.') == std::string::npos) text.insert(e, ".0");
    return text;
  }
  return text + ".0";
}

void OptionsWriter::integer(std::string_view key, std::int64_t value) {
  out_ << YAML::Key << std::string(key) << YAML::Value << value;
}
void OptionsWriter::boolean(std::string_view key, bool value) {
  out_ << YAML::Key << std::string(key) << YAML::Value << value;
}
void OptionsWriter::number(std::string_view key, double value) {
  out_ << YAML::Key << std::string(key) << YAML::Value << yaml_number(value);
}
void OptionsWriter::text(std::string_view key, std::string_view value) {
  out_ << YAML::Key << std::string(key) << YAML::Value << std::string(value);
}
void OptionsWriter::pair(std::string_view key, const std::array<int, 2>& value) {
  out_ << YAML::Key << std::string(key) << YAML::Value << YAML::Flow << YAML::BeginSeq << value[0] << value[1]
       << YAML::EndSeq;
}
void OptionsWriter::integers(std::string_view key, const std::vector<std::int64_t>& values) {
  out_ << YAML::Key << std::string(key) << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (std::int64_t v : values) out_ << v;
  out_ << YAML::EndSeq;
}
void OptionsWriter::texts(std::string_view key, const std::vector<std::string>& values) {
  out_ << YAML::Key << std::string(key) << YAML::Value << YAML::Flow << YAML::BeginSeq;
  for (const std::string& v : values) out_ << v;
  out_ << YAML::EndSeq;
}
void OptionsWriter::begin_map(std::string_view key) {
  out_ << YAML::Key << std::string(key) << YAML::Value << YAML::Flow << YAML::BeginMap;
}
void OptionsWriter::end_map() { out_ << YAML::EndMap; }
void OptionsWriter::regularizer(std::string_view key, const Regularizer& value) {
  out_ << YAML::Key << std::string(key) << YAML::Value << YAML::Flow << YAML::BeginMap << YAML::Key << "l2"
       << YAML::Value << yaml_number(value.l2) << YAML::EndMap;
}

}  // namespace dtrain::config
