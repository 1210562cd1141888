// Internal to lib/config: the YAML document as a small owned tree in which every node and every
// key remembers where it came from (file:line:column, or the --set text that produced it).
// yaml-cpp nodes cannot carry that for values spliced in by overrides, and they silently accept
// duplicate keys, so we copy the document once and work on this instead.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "config/experiment.hpp"

namespace dtrain::config::detail {

struct Origin {
  std::string source;  // the YAML file name, or "--set <text>" for values from an override
  int line = 0;        // 1-based; 0 = not from the file (an override)
  int column = 0;      // 1-based

  // "file:line:col" or "--set a.b=c": the prefix of every error message.
  std::string text() const;
  SourceLocation location() const { return {source, line, column}; }
};

[[noreturn]] void fail(const Origin& where, const std::string& message);

struct Entry;

struct Node {
  enum class Kind { null, scalar, sequence, map };
  Kind kind = Kind::null;
  std::string scalar;          // Kind::scalar
  std::vector<Node> items;     // Kind::sequence
  std::vector<Entry> entries;  // Kind::map, in document order
  Origin origin;

  bool is_null() const { return kind == Kind::null; }
  bool is_scalar() const { return kind == Kind::scalar; }
  bool is_sequence() const { return kind == Kind::sequence; }
  bool is_map() const { return kind == Kind::map; }
  const Node* find(std::string_view key) const;
};

struct Entry {
  std::string key;
  Origin key_origin;
  Node value;
};

// Parses YAML text; syntax errors become ConfigError at file:line:col.
Node load_tree(const std::string& yaml_text, const std::string& file_name);

// Applies one "--set a.b.c=value" assignment (value parsed as YAML) to the tree; a null value
// (null, ~ or nothing after '=') removes the key, or the list item, instead.
void apply_override(Node& root, const std::string& assignment);

}  // namespace dtrain::config::detail
