#include "data/dataset.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include <sys/stat.h>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/rng.hpp"
#include "data/hdf5_source.hpp"
#include "data/idx.hpp"

namespace dtrain::data {

void sample_as_f32(const Dataset& ds, std::int64_t i, float* dst) {
  const std::int64_t row = ds.x.shape().tail().numel();
  const float scale = ds.x_scale;
  if (ds.x.dtype() == DType::u8) {
    const std::uint8_t* src = ds.x.data<std::uint8_t>() + i * row;
    for (std::int64_t j = 0; j < row; ++j) dst[j] = static_cast<float>(src[j]) * scale;
  } else {
    const float* src = ds.x.data<float>() + i * row;
    for (std::int64_t j = 0; j < row; ++j) dst[j] = src[j] * scale;
  }
}

void prefetch_sample(const Dataset& ds, std::int64_t i) {
  const std::size_t bytes = static_cast<std::size_t>(ds.x.shape().tail().numel()) * dtype_size(ds.x.dtype());
  const char* row = static_cast<const char*>(ds.x.raw()) + static_cast<std::size_t>(i) * bytes;
  for (std::size_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at);
}

void data_out_of_memory(const std::string& path, const std::string& what, const std::string& why) {
  throw InputError(fmt::format("{}: {}: {}; dtrain holds each split in memory: use less data, raise the memory "
                               "limit, or split it over more workers (data.shards with auto_shard: file: each "
                               "loads only its own files)",
                               path, what, why));
}

Tensor data_tensor(const std::string& path, const std::string& what, const Shape& shape, DType dtype) {
  try {
    return Tensor(shape, dtype);
  } catch (const ConfigError& e) {  // more than the machine or the process's limit holds, refused before allocating
    data_out_of_memory(path, what, e.what());
  } catch (const std::bad_alloc&) {
    data_out_of_memory(path, what,
                       fmt::format("out of memory allocating {} of shape {}", dtype_name(dtype), shape.to_string()));
  }
}

Dataset take_rows(const Dataset& whole, std::int64_t begin, std::int64_t end, std::string description) {
  Dataset part = whole;
  part.x = whole.x.slice_rows(begin, end);
  part.y = whole.y.slice_rows(begin, end);
  part.description = std::move(description);
  part.first_row = whole.first_row + begin;
  return part;
}

void check_finite(const Tensor& x, const std::string& file, const std::string& dataset) {
  if (!x.defined() || x.dtype() != DType::f32 || x.numel() == 0) return;
  const float* v = x.data<float>();
  const std::int64_t n = x.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    if (std::isfinite(v[i])) continue;
    const std::int64_t per_sample = std::max<std::int64_t>(1, n / std::max<std::int64_t>(1, x.shape()[0]));
    throw InputError(fmt::format("{}: {} sample {} holds a non-finite value ({}); dtrain does not train on NaN or "
                                 "infinite inputs: fix or drop that sample",
                                 file, dataset, i / per_sample, v[i]));
  }
}

std::string label_out_of_range(const std::string& where, std::int64_t label, std::int64_t index, std::int64_t classes) {
  if (label < 0)
    return fmt::format("{}: label {} at index {} is negative; class ids count from 0{}", where, label, index,
                       classes > 0 ? fmt::format(" (0..{})", classes - 1) : std::string());
  return fmt::format("{}: label {} at index {} is outside 0..{}, the {} classes declared; check the labels or the "
                     "declared class count",
                     where, label, index, classes - 1, classes);
}

void check_label_range(const DataSplits& splits, std::int64_t classes) {
  const auto check = [classes](const Dataset& ds) {
    if (!ds.has_labels()) return;
    const std::int32_t* y = ds.y.data<std::int32_t>();
    for (std::int64_t i = 0; i < ds.size(); ++i) {
      if (y[i] >= 0 && y[i] < classes) continue;
      throw InputError(fmt::format("{}: label {} of sample {} is outside 0..{}: the model has {} outputs; check the "
                                   "labels or the last layer's units",
                                   ds.labels_source.empty() ? ds.description : ds.labels_source, y[i],
                                   ds.first_row + i, classes - 1, classes));
    }
  };
  check(splits.train);
  if (splits.validation) check(*splits.validation);
  check(splits.test);
}

void check_probability_targets(const DataSplits& splits, std::string_view loss) {
  const auto check = [loss](const Dataset& ds) {
    if (!ds.y.defined() || ds.y.dtype() != DType::f32 || ds.size() == 0) return;
    const float* y = ds.y.data<float>();
    const std::int64_t n = ds.y.numel(), per_sample = std::max<std::int64_t>(1, n / ds.size());
    for (std::int64_t i = 0; i < n; ++i) {
      if (y[i] >= 0.0f && y[i] <= 1.0f) continue;
      throw InputError(fmt::format("{}: target {} of sample {} is outside [0, 1]; loss {} reads float targets as "
                                   "probabilities: scale the targets into [0, 1], or use mean_squared_error for values",
                                   ds.labels_source.empty() ? ds.description : ds.labels_source, y[i],
                                   ds.first_row + i / per_sample, loss));
    }
  };
  check(splits.train);
  if (splits.validation) check(*splits.validation);
  check(splits.test);
}

Dataset make_synthetic(const std::vector<std::int64_t>& shape, int classes, std::int64_t size, std::uint64_t seed,
                       std::uint64_t split_index) {
  if (classes < 1) throw ConfigError(fmt::format("data.classes is {}; synthetic data needs at least 1 class", classes));
  if (size < 0) throw ConfigError(fmt::format("synthetic data size {} is negative", size));
  if (shape.empty()) throw ConfigError("data.shape is empty; give the example shape, e.g. [28, 28, 1]");
  for (auto d : shape)
    if (d < 1) throw ConfigError(fmt::format("data.shape {} has a dimension < 1", Shape(shape).to_string()));

  Shape example(shape);
  const std::int64_t pixels = example.numel();
  Dataset ds;
  ds.x = Tensor(example.with_batch(size), DType::u8);
  ds.y = Tensor(Shape{size}, DType::i32);
  auto* x = ds.x.data<std::uint8_t>();
  auto* y = ds.y.data<std::int32_t>();
  for (std::int64_t i = 0; i < size; ++i) {
    Rng rng(seed, RngStream::synthetic, (split_index << 40) + static_cast<std::uint64_t>(i));
    const auto label = static_cast<std::int32_t>(rng.below(static_cast<std::uint64_t>(classes)));
    y[i] = label;
    std::uint8_t* image = x + i * pixels;
    // Noise in 0..127; the label's band of pixels (one classes-th of the image) is 112 brighter.
    std::uint32_t bits = 0;
    for (std::int64_t p = 0; p < pixels; ++p) {
      if (p % 4 == 0) bits = rng.next_u32();
      const auto noise = static_cast<std::uint8_t>((bits >> (8 * (p % 4))) & 0x7F);
      const bool in_band = p * classes / pixels == label;
      image[p] = static_cast<std::uint8_t>(noise + (in_band ? 112 : 0));
    }
  }
  ds.num_classes = classes;
  ds.x_scale = 1.0f / 255.0f;
  ds.description = fmt::format("synthetic split {}: {} examples, x {} u8, {} classes, seed {}", split_index, size,
                               ds.x.shape().to_string(), classes, seed);
  return ds;
}

Dataset make_repeated(const std::vector<double>& x, const std::vector<double>& y, std::int64_t size) {
  if (x.empty() || y.empty())
    throw ConfigError("data.x and data.y must both be non-empty for source tensors (one example, repeated)");
  if (size < 0) throw ConfigError(fmt::format("tensors size {} is negative", size));
  const auto nx = static_cast<std::int64_t>(x.size());
  const auto ny = static_cast<std::int64_t>(y.size());
  Dataset ds;
  ds.x = Tensor(Shape{size, nx}, DType::f32);
  ds.y = Tensor(Shape{size, ny}, DType::f32);
  for (std::int64_t i = 0; i < size; ++i) {
    for (std::int64_t j = 0; j < nx; ++j) ds.x.data<float>()[i * nx + j] = static_cast<float>(x[static_cast<std::size_t>(j)]);
    for (std::int64_t j = 0; j < ny; ++j) ds.y.data<float>()[i * ny + j] = static_cast<float>(y[static_cast<std::size_t>(j)]);
  }
  ds.num_classes = static_cast<int>(ny);
  ds.x_scale = 1.0f;
  ds.description = fmt::format("tensors: one example repeated {} times, x {} f32, y {} f32", size,
                               ds.x.shape().to_string(), ds.y.shape().to_string());
  return ds;
}

namespace {

// The rows of n that data.validation_split leaves for training: the first floor(n (1 - split)).
std::int64_t kept_rows(std::int64_t n, double validation_split) {
  return static_cast<std::int64_t>(std::floor(static_cast<double>(n) * (1.0 - validation_split)));
}

std::int64_t total_size(const std::vector<Dataset>& parts) {
  std::int64_t n = 0;
  for (const Dataset& part : parts) n += part.size();
  return n;
}

void check_compatible(const Dataset& train, const Dataset& test) {
  if (train.x.shape().tail() != test.x.shape().tail() || train.x.dtype() != test.x.dtype())
    throw InputError(fmt::format("train examples are {} {} but test examples are {} {}; both splits must match ({} / {})",
                                 dtype_name(train.x.dtype()), train.x.shape().tail().to_string(),
                                 dtype_name(test.x.dtype()), test.x.shape().tail().to_string(), train.description,
                                 test.description));
  if (train.y.shape().tail() != test.y.shape().tail() || train.y.dtype() != test.y.dtype())
    throw InputError(fmt::format("train targets are {} {} but test targets are {} {}; both splits must match ({} / {})",
                                 dtype_name(train.y.dtype()), train.y.shape().tail().to_string(),
                                 dtype_name(test.y.dtype()), test.y.shape().tail().to_string(), train.description,
                                 test.description));
}

// InputError when `a` and `b` both declare their classes (num_classes) and declare different
// counts; `which` names what must agree. Float targets' "classes" are their width, which the
// shape checks compare.
void check_declared_classes(const Dataset& a, const Dataset& b, std::string_view which) {
  if (a.has_labels() && b.has_labels() && !a.classes_from_labels && !b.classes_from_labels &&
      a.num_classes != b.num_classes)
    throw InputError(fmt::format("{} declares {} classes but {} declares {}; {} must declare the same num_classes",
                                 a.description, a.num_classes, b.description, b.num_classes, which));
}

// Train and test share one class count: the larger where either counted its labels
// (a split may lack the top class); two that declare theirs (num_classes) must declare the same.
void agree_on_classes(Dataset& a, Dataset& b) {
  check_declared_classes(a, b, "the splits");
  a.num_classes = b.num_classes = std::max(a.num_classes, b.num_classes);
  a.classes_from_labels = b.classes_from_labels = a.classes_from_labels && b.classes_from_labels;
}

}  // namespace

Dataset concatenate(const std::vector<Dataset>& parts, std::string description) {
  DTRAIN_CHECK(!parts.empty(), "concatenate needs at least one dataset");
  if (parts.size() == 1) {
    Dataset only = parts.front();
    only.description = std::move(description);
    return only;
  }
  const Dataset& first = parts.front();
  std::int64_t total = 0;
  int classes = 0;
  for (const Dataset& part : parts) {
    if (part.x.shape().tail() != first.x.shape().tail() || part.x.dtype() != first.x.dtype() ||
        part.y.shape().tail() != first.y.shape().tail() || part.y.dtype() != first.y.dtype() ||
        part.x_scale != first.x_scale)
      throw InputError(fmt::format("{} has examples {} {} and targets {} {}, but {} has {} {} and {} {}; every shard "
                                   "must hold the same kind of examples",
                                   part.description, dtype_name(part.x.dtype()), part.x.shape().tail().to_string(),
                                   dtype_name(part.y.dtype()), part.y.shape().tail().to_string(), first.description,
                                   dtype_name(first.x.dtype()), first.x.shape().tail().to_string(),
                                   dtype_name(first.y.dtype()), first.y.shape().tail().to_string()));
    total += part.size();
    check_declared_classes(part, first, "every shard");
    classes = std::max(classes, part.num_classes);
  }
  Dataset out;
  out.x = data_tensor(description, "the shards' x together", first.x.shape().tail().with_batch(total), first.x.dtype());
  out.y = data_tensor(description, "the shards' y together", first.y.shape().tail().with_batch(total), first.y.dtype());
  std::size_t x_at = 0, y_at = 0;
  for (const Dataset& part : parts) {
    if (part.size() == 0) continue;
    std::memcpy(static_cast<char*>(out.x.raw()) + x_at, part.x.raw(), part.x.bytes());
    std::memcpy(static_cast<char*>(out.y.raw()) + y_at, part.y.raw(), part.y.bytes());
    x_at += part.x.bytes();
    y_at += part.y.bytes();
  }
  out.num_classes = classes;
  // Counted only where no part declared its classes, as agree_on_classes has it.
  out.classes_from_labels = std::all_of(parts.begin(), parts.end(), [](const Dataset& p) { return p.classes_from_labels; });
  out.x_scale = first.x_scale;
  out.description = std::move(description);
  return out;
}

namespace {

// data.shards names each file once: the parser refuses one spelling twice, this two spellings of
// one file ("a.h5" and "./a.h5", or a link to it), which would count its rows twice and, under
// validation_split with auto_shard: file, hold out rows of the wrong copy. Every worker checks the
// whole list, so all of them refuse the same job. A file that does not exist is left to loading.
void check_distinct_files(const std::vector<std::string>& files) {
  std::map<std::pair<dev_t, ino_t>, const std::string*> seen;
  for (const std::string& file : files) {
    struct stat st {};
    if (::stat(file.c_str(), &st) != 0) continue;
    const auto [at, fresh] = seen.emplace(std::pair{st.st_dev, st.st_ino}, &file);
    if (!fresh)
      throw InputError(fmt::format("data.shards: '{}' and '{}' are the same file; list each file once", *at->second,
                                   file));
  }
}

}  // namespace

DataSplits load_splits(const config::DataConfig& config, std::uint64_t seed, const std::vector<std::string>& shard_files) {
  if (!(config.validation_split >= 0.0 && config.validation_split < 1.0))
    throw ConfigError(fmt::format("data.validation_split is {}; it must lie in [0, 1)", config.validation_split));

  DataSplits splits;
  switch (config.source) {
    case config::SourceKind::fashion_mnist: {
      const std::string dir = config.path.empty() ? kDefaultFashionMnistDir : config.path;
      splits.train = load_idx_split(dir, "train", 10);
      splits.test = load_idx_split(dir, "t10k", 10);
      break;
    }
    case config::SourceKind::idx: {
      if (config.path.empty())
        throw ConfigError("data.path is empty; source idx needs the directory that holds the IDX files");
      splits.train = load_idx_split(config.path, "train");
      splits.test = load_idx_split(config.path, "t10k");
      // Both splits must agree on the class count even when the test split lacks the top class.
      const int classes = std::max(splits.train.num_classes, splits.test.num_classes);
      splits.train.num_classes = splits.test.num_classes = classes;
      break;
    }
    case config::SourceKind::hdf5: {
      if (!config.shards.empty()) {
        check_distinct_files(config.shards);
        const std::vector<std::string>& files = shard_files.empty() ? config.shards : shard_files;
        std::vector<Dataset> train, test;
        for (const std::string& file : files) {
          train.push_back(load_hdf5(file, "train"));
          test.push_back(load_hdf5(file, "test"));
        }
        const std::string which = fmt::format("{} of {} shard files ({}{})", files.size(), config.shards.size(),
                                              files.front(), files.size() > 1 ? ", ..." : "");
        if (config.validation_split > 0.0) {
          // The validation set is the last part of every shard file's training rows together, in
          // data.shards order: what one process holds out of them all, and what tools/to_hdf5
          // --shards puts last. A worker that reads some of the files (auto_shard: file) holds out
          // the rows of its files that fall in that part, so the set is the same for any worker
          // count; the sizes of the files it does not read come from their metadata.
          std::vector<std::int64_t> first_row_of_file;  // of each loaded file, in all the files' rows
          std::int64_t n = 0;
          for (std::size_t k = 0; k < config.shards.size(); ++k) {
            const std::size_t mine = first_row_of_file.size();
            const bool loaded = mine < files.size() && files[mine] == config.shards[k];
            if (loaded) first_row_of_file.push_back(n);
            n += loaded ? train[mine].size() : hdf5_rows(config.shards[k], "train");
          }
          DTRAIN_CHECK(first_row_of_file.size() == files.size(), "a worker's shard files are data.shards' in its order");
          const std::int64_t keep = kept_rows(n, config.validation_split);
          if (keep <= 0 || keep >= n)
            throw ValidationSplitError(fmt::format(
                "data.validation_split {} of the {} training examples of the {} shard files leaves {} for training "
                "and {} for validation; both need at least one",
                config.validation_split, n, config.shards.size(), keep, n - keep));
          std::vector<Dataset> kept, held;
          for (std::size_t f = 0; f < files.size(); ++f) {
            const Dataset& part = train[f];
            const std::int64_t stays = std::clamp<std::int64_t>(keep - first_row_of_file[f], 0, part.size());
            kept.push_back(take_rows(part, 0, stays, part.description));
            held.push_back(take_rows(part, stays, part.size(), part.description));
          }
          splits.validation = concatenate(held, fmt::format("validation: {} examples of {}, the last {} of the {} "
                                                            "shard files' /train together",
                                                            total_size(held), which, n - keep, config.shards.size()));
          train = std::move(kept);
        }
        splits.train = concatenate(train, fmt::format("HDF5 /train: {} examples from {}", total_size(train), which));
        splits.test = concatenate(test, fmt::format("HDF5 /test: {} examples from {}", total_size(test), which));
        agree_on_classes(splits.train, splits.test);
        break;
      }
      if (config.path.empty()) throw ConfigError("data.path is empty; source hdf5 needs the path of an HDF5 file");
      splits.train = load_hdf5(config.path, "train");
      splits.test = load_hdf5(config.path, "test");
      agree_on_classes(splits.train, splits.test);
      break;
    }
    case config::SourceKind::synthetic:
      splits.train = make_synthetic(config.shape, config.classes, config.train_size, seed, 0);
      splits.test = make_synthetic(config.shape, config.classes, config.test_size, seed, 1);
      break;
    case config::SourceKind::tensors:
      splits.train = make_repeated(config.x, config.y, config.train_size);
      splits.test = splits.train;
      break;
  }
  check_compatible(splits.train, splits.test);
  if (splits.train.size() == 0)
    throw InputError(fmt::format("the training split is empty ({}), so there is nothing to train on; give the data "
                                 "training examples",
                                 splits.train.description));

  if (config.validation_split > 0.0 && !splits.validation) {
    const std::int64_t n = splits.train.size();
    const std::int64_t keep = kept_rows(n, config.validation_split);
    if (keep <= 0 || keep >= n)
      throw ValidationSplitError(fmt::format(
          "data.validation_split {} of {} training examples leaves {} for training and {} for validation; both need "
          "at least one",
          config.validation_split, n, keep, n - keep));
    Dataset whole = splits.train;
    splits.validation = take_rows(whole, keep, n, fmt::format("validation: last {} of {}", n - keep, whole.description));
    splits.train = take_rows(whole, 0, keep, fmt::format("train: first {} of {}", keep, whole.description));
  }
  return splits;
}

}  // namespace dtrain::data
