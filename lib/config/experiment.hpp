// The experiment, as typed structs. YAML becomes these once (config/parse.hpp) and nothing
// downstream looks anything up by string. These are plain data: every module may read them,
// and this header depends on nothing else in dtrain.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "config/options.hpp"

namespace dtrain::config {

// Where a value came from, for error messages raised after parsing.
// Every struct has defaulted ==, so a resolved config can be compared (round trips, resume checks).
struct SourceLocation {
  std::string file;
  int line = 0;    // 1-based; 0 = not from a file (default or --set)
  int column = 0;  // 1-based
  bool operator==(const SourceLocation&) const = default;
};

// The options of a layer and of a strategy, as their kind's own type (config/options.hpp).
using LayerOptions = Options;
using StrategyOptions = Options;

// ---------------------------------------------------------------- strategy
// Vocabulary several strategy kinds share. Each kind's own options live in its file
// (distribute/<kind>.hpp), which registered how they are read and written (config/strategies.hpp).

// The replicas' devices, in replica order, no duplicates. Device names are normalised to "cpu:N" /
// "gpu:N" whatever TensorFlow spelling the YAML used (/cpu:0, /device:GPU:1, GPU:0, ...). When
// `automatic` is set (the YAML spelling is `devices: auto`) the list is empty and the strategy
// decides: one CPU replica per core, or per worker process for a strategy that spans processes.
struct DeviceList {
  std::vector<std::string> names;
  bool automatic = true;
  bool operator==(const DeviceList&) const = default;
};

// How the collectives of a strategy that spans processes travel between workers
// (tf.distribute.experimental.CommunicationImplementation).
enum class CommunicationImplementation {
  auto_select,  // "auto": let the strategy pick for the devices and the launcher it has
  ring,         // ring all-reduce over the workers' point-to-point links
  mpi,          // the MPI library's own collectives (MPI_Allreduce, ...)
  nccl,         // NCCL; GPUs only, which is checked once the devices are known
};

// tf.distribute.experimental.CommunicationOptions, for the strategies that span processes.
struct CommunicationConfig {
  CommunicationImplementation implementation = CommunicationImplementation::auto_select;
  // Gradients are packed into all-reduces of about this many bytes each; 0 = all in one pack.
  std::int64_t bytes_per_pack = 0;
  // Each pack's all-reduce starts as soon as backward has produced its gradients, on a
  // communication thread, while backward goes on with earlier layers. Only with one replica per
  // worker (several local replicas must first sum among themselves).
  bool overlap = true;
  // A collective (or, between a coordinator, its workers and parameter servers, a message) that
  // has not completed after this long fails the step instead of hanging on a lost process.
  double timeout_seconds = 300.0;
  // The `implementation` value (line 0 when left to its default), for errors raised once the
  // devices are known (nccl on CPU).
  SourceLocation implementation_where;
  bool operator==(const CommunicationConfig&) const = default;
};

// What each MPI rank of a strategy that spans processes does, as TF_CONFIG's task types. Ranks are
// given out in order: the chief (rank 0), then the workers, then the parameter servers (for a kind
// that has them), then the evaluator. The chief and the workers train together; the evaluator
// takes no part in training and evaluates each new checkpoint.
struct RolesConfig {
  int chief = 1;      // 0 or 1; without one, worker 0 does the chief's duties (as in TensorFlow)
  int worker = -1;    // -1: every rank the chief, the servers and the evaluator leave
  int evaluator = 0;  // 0 or 1
  int ps = 0;         // the parameter-server ranks (after the workers in rank order)
  // Set by the parser (not written): whether the kind has parameter servers (TF_CONFIG may then
  // name "ps" tasks, and there must be at least one), and the kind, which messages name.
  bool parameter_servers = false;
  std::string kind;
  SourceLocation where;  // the roles section (line 0 when left out)
  bool operator==(const RolesConfig&) const = default;
};

struct StrategyConfig {
  // The registered YAML kind (config/strategies.hpp); the parser gives an experiment that leaves
  // the strategy out the default kind's. Empty only in a config built in code and not set.
  std::string kind;
  // The kind's own options, as its file's type (the kind's `options_as`).
  StrategyOptions options;
  // For errors raised after parsing (a device the machine lacks, a reduction the devices cannot
  // do): the `kind` value (or the section, or the file when absent), and where the replicas'
  // devices were given (the kind's device or devices key; line 0 when left to their default).
  SourceLocation where;
  SourceLocation devices_where;
  bool operator==(const StrategyConfig&) const = default;
};

// ---------------------------------------------------------------- data
enum class SourceKind {
  fashion_mnist,  // IDX files of Fashion-MNIST (default directory /usr/share/datasets/fashion-mnist)
  idx,            // any MNIST-style IDX directory: {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]
  hdf5,           // one HDF5 file with groups /train and /test, each holding datasets x and y
  synthetic,      // random images and labels of a given shape (benchmarks)
  tensors,        // one example (x, y) repeated `size` times (tf.data.Dataset.from_tensors(...).repeat)
};
enum class DistributeMode { split_global_batch, per_replica };
// tf.data.experimental.AutoShardPolicy: how the workers of a strategy that spans processes split the
// input.
// It matters only with several workers; with one it reads as off.
enum class AutoShardPolicy {
  auto_select,  // "auto": TensorFlow's rule, by file when that is possible, else by data
  file,         // worker i reads the files shards[i], shards[i + workers], ... whole
  data,         // every worker reads everything and keeps every workers-th element
  off,          // no sharding: every worker sees the whole dataset
};

struct DataConfig {
  SourceKind source = SourceKind::fashion_mnist;
  std::string path;  // idx/fashion_mnist: directory; hdf5: file. Empty = the source's default.
  AutoShardPolicy auto_shard = AutoShardPolicy::auto_select;
  // hdf5 with auto_shard: file only: one HDF5 file per shard (each laid out like `path`), in
  // order; non-empty then, and `path` may be left out.
  std::vector<std::string> shards;
  // synthetic
  std::vector<std::int64_t> shape{28, 28, 1};
  int classes = 10;
  std::int64_t train_size = 60000;  // synthetic train examples; tensors: `size`
  std::int64_t test_size = 10000;   // synthetic test examples
  // tensors
  std::vector<double> x;
  std::vector<double> y;
  // pipeline
  std::int64_t batch_size_per_replica = 64;
  // Instead of batch_size_per_replica: the global batch itself, split over the replicas as
  // tf.distribute splits it, ceil(G / R) rows each in turn (data/pipeline.hpp's replica_offset; it
  // need not divide, except with distribute: per_replica). 0 = not given.
  std::int64_t global_batch_size = 0;
  std::int64_t shuffle_buffer = 60000;  // 0 = no shuffle; >= dataset size = full uniform shuffle
  bool drop_remainder = false;
  DistributeMode distribute = DistributeMode::split_global_batch;
  double validation_split = 0.0;  // fraction of the training set held out, in [0, 1)
  std::int64_t eval_batch_size = 0;  // 0 = the global batch
  bool prefetch = true;             // prepare the next batch in the background
  bool operator==(const DataConfig&) const = default;
};

// ---------------------------------------------------------------- model
// Vocabulary several layer kinds share; each layer's own options live in its file (nn/<kind>.hpp).
enum class Activation { linear, relu, sigmoid, tanh, softmax };
enum class Padding { valid, same };

struct Regularizer {
  double l2 = 0.0;  // loss += l2 * sum(w^2), Keras' L2
  bool operator==(const Regularizer&) const = default;
};

// Keras' mixed-precision policy names. The variables are float32 whatever the policy; the policy
// is the dtype the layers compute in. mixed_bfloat16: convolutions and dense layers compute in
// bfloat16 (float32 master weights, gradients, loss, softmax, metrics and optimizer).
enum class Precision { float32, mixed_bfloat16 };

// One entry of model.layers. The options' type belongs to the layer file of `kind` (nn/<kind>.hpp),
// which also registered how they are read and written (config/layers.hpp).
struct LayerConfig {
  std::string kind;  // the registered YAML key: conv2d, dense, batch_normalization, ...
  std::string name;  // Keras-style automatic name when not given: conv2d, conv2d_1, dense, ...
  LayerOptions options;
  SourceLocation where;
  bool operator==(const LayerConfig&) const = default;
};

struct ModelConfig {
  std::vector<std::int64_t> input_shape;  // without the batch dimension, channels last
  std::vector<LayerConfig> layers;
  // model.initial_weights: a Keras 3 weights file (model.save_weights("x.weights.h5"), or dtrain
  // export --format keras) whose values replace the seed's initialization before the first step;
  // empty = the seed's. A checkpoint (resume, eval) overrides it, so it is read only by a new run.
  std::string initial_weights;
  bool operator==(const ModelConfig&) const = default;
};

// ---------------------------------------------------------------- loss
enum class LossKind { sparse_categorical_crossentropy, categorical_crossentropy, binary_crossentropy, mean_squared_error };
enum class Reduction { none, sum, sum_over_batch_size, auto_reduction };

struct LossConfig {
  LossKind kind = LossKind::sparse_categorical_crossentropy;
  bool from_logits = false;
  Reduction reduction = Reduction::auto_reduction;
  SourceLocation where;
  bool operator==(const LossConfig&) const = default;
};

// ---------------------------------------------------------------- optimizer
enum class ScheduleKind { constant, exponential_decay, piecewise_constant, cosine_decay };

struct LearningRateConfig {
  ScheduleKind kind = ScheduleKind::constant;
  double initial_learning_rate = 0.001;  // constant: the learning rate
  // exponential_decay: lr0 * decay_rate ^ (step / decay_steps), floored when staircase
  std::int64_t decay_steps = 1;
  double decay_rate = 1.0;
  bool staircase = false;
  // piecewise_constant: values[i] while step <= boundaries[i] (values has one more entry)
  std::vector<std::int64_t> boundaries;
  std::vector<double> values;
  // cosine_decay: lr0 * ((1 - alpha) * 0.5 * (1 + cos(pi * min(step, decay_steps) / decay_steps)) + alpha)
  double alpha = 0.0;
  bool operator==(const LearningRateConfig&) const = default;
};

enum class OptimizerKind { sgd, adam, rmsprop };

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::adam;
  LearningRateConfig learning_rate;
  // sgd, rmsprop
  double momentum = 0.0;
  bool nesterov = false;  // sgd
  // adam
  double beta_1 = 0.9;
  double beta_2 = 0.999;
  // adam, rmsprop
  double epsilon = 1e-7;
  // rmsprop
  double rho = 0.9;
  bool centered = false;
  bool operator==(const OptimizerConfig&) const = default;
};

// ---------------------------------------------------------------- metrics, training
enum class MetricKind { sparse_categorical_accuracy, accuracy, categorical_accuracy };

enum class ProgressMode { auto_detect, bar, lines, none };

// How a replica uses its compute threads (train.parallelism):
//   batch       each thread is a lane computing a slice of the replica's batch with one OpenMP
//               thread (the way two ranks use two cores); a lane's gradients are summed into the
//               replica's, and the lanes' batch statistics are combined, so together they compute
//               what one thread computes on the whole batch
//   operations  the threads share each layer's work (OpenMP inside oneDNN's primitives)
enum class Parallelism { batch, operations };

struct TrainConfig {
  int epochs = 10;
  std::int64_t steps_per_epoch = 0;  // 0 = the whole training set each epoch
  int threads = 0;                   // compute threads; 0 = all cores
  Parallelism parallelism = Parallelism::batch;
  ProgressMode progress = ProgressMode::auto_detect;
  bool tensorboard = false;              // event files in <run dir>/tensorboard/ (the chief's)
  std::int64_t log_every_steps = 100;    // TensorBoard's step loss every N global steps; 0 = none
  bool plot = false;                 // the chief redraws <run dir>/curves.png after each epoch (gnuplot)
  bool operator==(const TrainConfig&) const = default;
};

// tf.train.CheckpointManager: when to save, how many to keep, where.
struct CheckpointConfig {
  int every_epochs = 1;              // save after every N-th epoch; 0 = never by epoch
  std::int64_t every_steps = 0;      // save after every N-th global step; 0 = never by step
  int max_to_keep = 3;               // the newest N complete checkpoints are kept
  std::string dir;                   // empty = <run dir>/checkpoints
  bool operator==(const CheckpointConfig&) const = default;
};

// reproducibility (docs/reproducibility.md): what may change a run's bits.
//   fast              the sums are taken in the order the replicas, lanes and ranks finish them
//                     (deterministic for one configuration; another replica count or thread
//                     count changes the last bits)
//   replica_invariant the global batch is cut into micro-batches of micro_batch_size samples, each
//                     computed whole by one thread, and combined by exact integer sums: the same
//                     bits for any replica, lane, thread or rank count
enum class ReproducibilityMode { fast, replica_invariant };

// reproducibility.isa: the instruction set the CPU's kernels are capped to (oneDNN's maximum ISA),
// so that machines with at least that set compute the same bits; native = whatever this CPU has.
enum class IsaCap { native, avx2, avx512_core, avx512_core_bf16, avx512_core_amx };

struct ReproducibilityConfig {
  ReproducibilityMode mode = ReproducibilityMode::fast;
  std::int64_t micro_batch_size = 8;
  IsaCap isa = IsaCap::native;
  SourceLocation where;      // reproducibility.mode (line 0 when left out)
  SourceLocation isa_where;  // reproducibility.isa (line 0 when left out)
  bool invariant() const { return mode == ReproducibilityMode::replica_invariant; }
  bool operator==(const ReproducibilityConfig& o) const {
    return mode == o.mode && micro_batch_size == o.micro_batch_size && isa == o.isa;
  }
};

// The longest `name`: it names the run directory runs/<name>, and runs/<name>-2, ... after it.
inline constexpr std::size_t kMaxExperimentNameBytes = 200;

struct Experiment {
  std::string name = "experiment";
  std::uint64_t seed = 42;
  Precision precision = Precision::float32;
  SourceLocation precision_where;  // line 0 when left out
  // Where the batch sizes come from (the value's file:line:column or its --set; the data section
  // when left out), for the errors they decide: memory, workers.
  SourceLocation batch_where;       // data.global_batch_size, else data.batch_size_per_replica
  SourceLocation eval_batch_where;  // data.eval_batch_size, else batch_where
  SourceLocation data_where;        // data.path (or data.shards), else the data section: for errors of the data
  SourceLocation initial_weights_where;  // model.initial_weights (line 0 when left out): for errors of that file
  SourceLocation input_shape_where;       // model.input_shape: for a data sample of another shape
  SourceLocation validation_split_where;  // data.validation_split (line 0 when left out): for a split that leaves none
  SourceLocation metrics_where;           // the metrics list (line 0 when left out): for labels a metric cannot read
  SourceLocation steps_per_epoch_where;   // train.steps_per_epoch (line 0 when left out): for more steps than the data
  StrategyConfig strategy;
  DataConfig data;
  ModelConfig model;
  LossConfig loss;
  OptimizerConfig optimizer;
  std::vector<MetricKind> metrics;
  TrainConfig train;
  CheckpointConfig checkpoint;
  ReproducibilityConfig reproducibility;
  std::string source_file;  // the YAML it was read from
  bool operator==(const Experiment&) const = default;
};

}  // namespace dtrain::config
