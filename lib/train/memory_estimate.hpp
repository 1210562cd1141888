// How much memory a run needs, from the model's declared shapes alone, before anything is
// allocated: a run the machine cannot hold is refused in a second, naming the layer that decides
// it, instead of allocating (and zero-filling, and initializing) for minutes first.
//
// Per process: every replica's lanes each hold a model (variables and their gradients, 4 bytes
// each per element) and the activations of their slice of the batch with their gradients
// (Sequential::activation_bytes); every replica holds its optimizer's slots; and saving a
// checkpoint holds the variables and one replica's slots twice more (the HDF5 image built in memory
// and the copy sealed and written: checkpoint/checkpoint.cpp). Workspaces and the data set are not
// counted: the estimate is a floor.
#pragma once

#include "core/machine.hpp"

#include <cstdint>

#include "config/parse.hpp"
#include "nn/model.hpp"

namespace dtrain::train {

struct RunCopies {
  int replicas = 1;         // this process's replicas
  int lanes = 1;            // models per replica (train.parallelism: batch)
  int optimizer_slots = 0;  // per variable: Adam 2, SGD with momentum 1, ...
  // The largest batch one replica computes in training and in evaluation, and the keys that
  // decide them (for the messages).
  std::int64_t train_batch = 1, eval_batch = 1;
  config::BatchKey train_key, eval_key;
  // The largest batch one lane computes.
  std::int64_t batch_per_lane() const;
};

struct MemoryEstimate {
  std::int64_t models = 0;       // variables and gradients, every lane
  std::int64_t slots = 0;        // optimizer slots, every replica
  std::int64_t activations = 0;  // activations and their gradients, every lane
  std::int64_t checkpoint = 0;   // a checkpoint being saved: variables and slots, twice
  std::int64_t total = 0;        // the sum (the largest int64 when it overflows)
};

MemoryEstimate estimate_memory(const nn::Sequential& declared, const RunCopies& copies);

// ConfigError when the run cannot fit in `memory` (usable_memory(): the machine's, or a cgroup's or
// ulimit's when lower): first a replica's batch alone (Sequential::check_batch_memory, naming the
// batch key and the layer), then the whole estimate, at the deciding layer's place in the
// experiment, with its parts, the memory and what sets it, and what to make smaller.
void check_run_memory(const nn::Sequential& declared, const RunCopies& copies, const MemoryLimit& memory);

}  // namespace dtrain::train
