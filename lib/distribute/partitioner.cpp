#include "distribute/partitioner.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace dtrain::distribute {

const char* name_of(PartitionerKind kind) { return config::name_in(partitioner_kinds, kind); }

int shard_count(const VariablePartitionerConfig& p, const Shape& shape) {
  if (shape.rank() == 0 || shape[0] <= 1) return 1;
  const std::int64_t rows = shape[0];
  const double bytes = static_cast<double>(shape.numel()) * sizeof(float);
  std::int64_t n = 1;
  switch (p.kind) {
    case PartitionerKind::none: n = 1; break;
    case PartitionerKind::fixed_shards: n = std::min<std::int64_t>(p.num_shards, rows); break;
    case PartitionerKind::min_size: {
      const std::int64_t max_shards = p.max_shards > 0 ? p.max_shards : 1;
      const auto wanted = static_cast<std::int64_t>(std::ceil(bytes / static_cast<double>(p.min_shard_bytes)));
      n = std::max<std::int64_t>(1, std::min({rows, max_shards, wanted}));
      break;
    }
    case PartitionerKind::max_size: {
      const double row_bytes = bytes / static_cast<double>(rows);
      const auto rows_per_shard =
          std::max<std::int64_t>(1, static_cast<std::int64_t>(std::floor(static_cast<double>(p.max_shard_bytes) / row_bytes)));
      n = (rows + rows_per_shard - 1) / rows_per_shard;
      if (p.max_shards > 0) n = std::min<std::int64_t>(n, p.max_shards);
      break;
    }
  }
  return static_cast<int>(std::max<std::int64_t>(1, n));
}

std::vector<Shard> place_shards(const VariablePartitionerConfig& partitioner, std::span<const Shape> shapes,
                                int servers) {
  std::vector<Shard> out;
  int next_server = 0;
  for (std::size_t v = 0; v < shapes.size(); ++v) {
    const Shape& shape = shapes[v];
    const int parts = shard_count(partitioner, shape);
    const std::int64_t rows = shape.rank() == 0 ? 1 : shape[0];
    const std::int64_t row_size = rows > 0 ? shape.numel() / rows : 0;
    std::int64_t row = 0;
    for (int part = 0; part < parts; ++part) {
      Shard s;
      s.variable = v;
      s.part = part;
      s.parts = parts;
      s.first_row = row;
      s.rows = rows / parts + (part < rows % parts ? 1 : 0);
      s.offset = row * row_size;
      s.size = s.rows * row_size;
      s.server = next_server;
      next_server = (next_server + 1) % std::max(1, servers);
      s.shape = shape;
      if (shape.rank() > 0) s.shape[0] = s.rows;
      row += s.rows;
      out.push_back(s);
    }
  }
  return out;
}

std::string describe_placement(std::span<const Shard> shards, std::span<const std::string> names) {
  std::string out;
  for (const Shard& s : shards) {
    if (s.part == 0) out += fmt::format("{}{}", out.empty() ? "" : "; ", names[s.variable]);
    if (s.parts == 1) {
      out += fmt::format(" -> ps {}", s.server);
    } else {
      out += fmt::format("{} [{}:{}) -> ps {}", s.part == 0 ? "" : ",", s.first_row, s.first_row + s.rows, s.server);
    }
  }
  return out;
}

}  // namespace dtrain::distribute
