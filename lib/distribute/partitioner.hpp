// Where ParameterServerStrategy keeps each variable: cut into shards along its first axis by the
// experiment's variable_partitioner (tf.distribute.experimental.partitioners, float32 values), and
// the shards given out to the parameter servers round-robin in variable order, as TensorFlow
// places them.
//
//   none          every variable whole (one shard)
//   fixed_shards  min(num_shards, rows) shards
//   min_size      max(1, min(rows, max_shards, ceil(bytes / min_shard_bytes))) shards: each at least
//                 about min_shard_bytes (max_shards defaults to 1)
//   max_size      ceil(rows / max(1, floor(max_shard_bytes / bytes_per_row))) shards, at most
//                 max_shards when set: each at most max_shard_bytes unless one row is larger
//
// A variable of R rows in n shards: the first R mod n shards get one row more than the others.
// Scalars are never cut.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "config/schema.hpp"
#include "core/tensor.hpp"

namespace dtrain::distribute {

// strategy.variable_partitioner: how each variable is cut into shards along its first axis
// (tf.distribute.experimental.partitioners). none: every variable whole, spread over the servers.
enum class PartitionerKind { none, fixed_shards, min_size, max_size };
inline constexpr config::Named<PartitionerKind> partitioner_kinds[] = {{"none", PartitionerKind::none},
                                                                       {"fixed_shards", PartitionerKind::fixed_shards},
                                                                       {"min_size", PartitionerKind::min_size},
                                                                       {"max_size", PartitionerKind::max_size}};
const char* name_of(PartitionerKind kind);

struct VariablePartitionerConfig {
  PartitionerKind kind = PartitionerKind::none;
  int num_shards = 1;                         // fixed_shards
  std::int64_t min_shard_bytes = 256 << 10;   // min_size
  std::int64_t max_shard_bytes = 0;           // max_size (required there)
  int max_shards = 0;                         // min_size, max_size; 0 = TF's default (1 for min_size, none for max_size)
  bool operator==(const VariablePartitionerConfig&) const = default;
};

// How many shards `partitioner` cuts a float32 variable of `shape` into.
int shard_count(const VariablePartitionerConfig& partitioner, const Shape& shape);

struct Shard {
  std::size_t variable = 0;   // index into the model's variables
  int part = 0, parts = 1;    // this shard among its variable's
  std::int64_t first_row = 0, rows = 0;
  std::int64_t offset = 0, size = 0;  // floats, within the variable's flat storage
  int server = 0;             // index among the parameter servers
  Shape shape;                // rows x the variable's other dimensions
};

// Every shard of every variable in variable order, each with its server.
std::vector<Shard> place_shards(const VariablePartitionerConfig& partitioner, std::span<const Shape> shapes,
                                int servers);

// For the startup header: "conv2d/kernel -> ps 0; dense/kernel [0:800) -> ps 1, [800:1600) -> ps 0; ..."
std::string describe_placement(std::span<const Shard> shards, std::span<const std::string> names);

}  // namespace dtrain::distribute
