#include "config/yaml_tree.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <unordered_map>

#include "core/error.hpp"

namespace dtrain::config::detail {

std::string Origin::text() const {
  if (line > 0) return fmt::format("{}:{}:{}", source, line, column);
  return source;
}

void fail(const Origin& where, const std::string& message) {
  throw ConfigError(fmt::format("{}: {}", where.text(), message));
}

const Node* Node::find(std::string_view key) const {
  for (const Entry& entry : entries)
    if (entry.key == key) return &entry.value;
  return nullptr;
}

namespace {

// Deeper documents are not experiments; the limit also keeps hostile input off the stack.
constexpr int max_depth = 64;

Origin origin_of(const YAML::Mark& mark, const std::string& source, bool from_file) {
  if (!from_file) return {source, 0, 0};
  if (mark.is_null()) return {source, 1, 1};
  return {source, mark.line + 1, mark.column + 1};
}

// Aliases (*a) are copied into the tree, so a few hundred bytes of nested aliases could expand to
// billions of nodes. Without aliases a document has fewer nodes than characters; past that, up to
// this many copied nodes are allowed, ample for any experiment that reuses a block.
constexpr std::size_t alias_budget = 100000;

struct Converter {
  const std::string& source;
  bool from_file;
  std::size_t nodes_left;

  Node convert(const YAML::Node& yaml, int depth);
};

Node Converter::convert(const YAML::Node& yaml, int depth) {
  Node node;
  node.origin = origin_of(yaml.Mark(), source, from_file);
  if (depth > max_depth) fail(node.origin,
                                  fmt::format("YAML nested deeper than {} levels (or an alias that contains itself)", max_depth));
  if (nodes_left == 0)
    fail(node.origin, fmt::format("YAML aliases expand to more than {} copied values; write the values out, or alias "
                                  "fewer levels of lists and maps",
                                  alias_budget));
  --nodes_left;
  switch (yaml.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null:
      node.kind = Node::Kind::null;
      break;
    case YAML::NodeType::Scalar:
      node.kind = Node::Kind::scalar;
      node.scalar = yaml.Scalar();
      break;
    case YAML::NodeType::Sequence:
      node.kind = Node::Kind::sequence;
      for (const YAML::Node& item : yaml) node.items.push_back(convert(item, depth + 1));
      break;
    case YAML::NodeType::Map:
      node.kind = Node::Kind::map;
      {
        // Key -> its entry, so that maps of many keys are checked for duplicates in linear time.
        std::unordered_map<std::string, std::size_t> seen;
        for (auto it = yaml.begin(); it != yaml.end(); ++it) {
          Origin key_origin = origin_of(it->first.Mark(), source, from_file);
          if (!it->first.IsScalar()) fail(key_origin, "map keys must be plain names, not lists or maps");
          std::string key = it->first.Scalar();
          const auto [earlier, fresh] = seen.emplace(key, node.entries.size());
          if (!fresh)
            fail(key_origin, fmt::format("duplicate key '{}' (first given at {}); keep only one", key,
                                         node.entries[earlier->second].key_origin.text()));
          node.entries.push_back({std::move(key), key_origin, convert(it->second, depth + 1)});
        }
      }
      break;
  }
  return node;
}

// yaml-cpp's messages name the grammar rule; add what the user most likely has to fix.
std::string syntax_hint(const std::string& text, const YAML::Exception& e) {
  if (!e.mark.is_null() && e.mark.line >= 0) {
    std::size_t start = 0;
    for (int line = 0; line < e.mark.line && start != std::string::npos; ++line) {
      start = text.find('\n', start);
      if (start != std::string::npos) ++start;
    }
    if (start != std::string::npos) {
      const std::size_t indent_end = text.find_first_not_of(" \t", start);
      const std::string indent = text.substr(start, indent_end == std::string::npos ? std::string::npos
                                                                                     : indent_end - start);
      if (indent.find('\t') != std::string::npos) return " (YAML does not allow tabs for indentation; use spaces)";
    }
  }
  if (e.msg == "illegal map value") return " (check the indentation, and quote values that contain ': ')";
  if (e.msg == "end of map not found" || e.msg == "end of sequence not found")
    return " (check the indentation of this block)";
  if (e.msg == "end of map flow not found") return " (a '{' has no matching '}')";
  if (e.msg == "end of sequence flow not found") return " (a '[' has no matching ']')";
  return "";
}

Node load(const std::string& text, const std::string& source, bool from_file) {
  YAML::Node document;
  try {
    document = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    Origin where = origin_of(e.mark, source, from_file);
    fail(where, fmt::format("invalid YAML: {}{}", e.msg, syntax_hint(text, e)));
  }
  return Converter{source, from_file, text.size() + alias_budget}.convert(document, 0);
}

bool is_index(std::string_view text) {
  return !text.empty() && text.size() < 10 &&
         std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

std::string trim(std::string_view text) {
  auto first = text.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  auto last = text.find_last_not_of(" \t");
  return std::string(text.substr(first, last - first + 1));
}

}  // namespace

Node load_tree(const std::string& yaml_text, const std::string& file_name) {
  return load(yaml_text, file_name, true);
}

void apply_override(Node& root, const std::string& assignment) {
  const Origin where{"--set " + assignment, 0, 0};
  const auto equals = assignment.find('=');
  if (equals == std::string::npos)
    fail(where, "expected key.path=value, for example --set train.epochs=5");
  const std::string path = trim(std::string_view(assignment).substr(0, equals));
  if (path.empty()) fail(where, "missing key path before '='; expected key.path=value");

  std::vector<std::string> parts;
  for (std::size_t start = 0;;) {
    const auto dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (parts.back().empty()) fail(where, fmt::format("empty component in key path '{}'", path));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }

  Node value = load(assignment.substr(equals + 1), where.source, false);
  // key=null (or ~, or nothing) takes the key out, as if the file never had it: its default
  // applies, or the other spelling of the same setting can be given (batch_size_per_replica
  // against global_batch_size). A list item so removed leaves the items after it one index lower.
  const bool remove = value.is_null();

  Node* current = &root;
  std::string walked;  // the path so far, for messages
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::string& part = parts[i];
    const bool last = i + 1 == parts.size();
    if (current->is_null()) {  // "data:" with nothing under it, or an empty document
      current->kind = Node::Kind::map;
      current->origin = where;
    }
    Node* next = nullptr;
    if (remove && last) {
      if (current->is_map())
        std::erase_if(current->entries, [&](const Entry& entry) { return entry.key == part; });
      else if (current->is_sequence() && is_index(part) && std::stoul(part) < current->items.size())
        current->items.erase(current->items.begin() + static_cast<std::ptrdiff_t>(std::stoul(part)));
      else if (current->is_sequence())
        fail(where, fmt::format("'{}' has {} items; there is no item '{}' to remove", walked, current->items.size(),
                                part));
      return;
    }
    if (current->is_map()) {
      for (Entry& entry : current->entries)
        if (entry.key == part) next = &entry.value;
      if (!next) {
        Node fresh;
        fresh.origin = where;
        current->entries.push_back({part, where, fresh});
        next = &current->entries.back().value;
      }
    } else if (current->is_sequence()) {
      const std::size_t size = current->items.size();
      if (!is_index(part))
        fail(where, fmt::format("'{}' is a list of {} items; address an item by its index (0..{}), not '{}'",
                                walked, size, size == 0 ? 0 : size - 1, part));
      const std::size_t index = std::stoul(part);
      if (index > size)
        fail(where, fmt::format("index {} is out of range: '{}' has {} items (use 0..{}, or {} to append)", index,
                                walked, size, size == 0 ? 0 : size - 1, size));
      if (index == size) {
        Node fresh;
        fresh.origin = where;
        current->items.push_back(fresh);
      }
      next = &current->items[index];
    } else {
      fail(where, fmt::format("'{}' is a single value ('{}'), so it has no '{}' inside", walked, current->scalar,
                              part));
    }
    walked += walked.empty() ? part : "." + part;
    current = next;
    if (last) *current = value;
  }
}

}  // namespace dtrain::config::detail
