// Strategy: how replicas are laid out, where their variables live and how their values are
// combined — nothing else (tf.distribute.Strategy). The training loop calls run(), reduce_sum(),
// sum_gradients() and update() and never asks which kind of strategy it has.
//
// Each kind is one file in distribute/ (named for the kind; its header, where it has options,
// holds their struct) that registers, in one StrategyRegistration statement, its YAML schema (config/strategies.hpp: kind,
// option keys, parse, write, what `dtrain init` says of it), its placement (the devices of this
// process's replicas, whether it spans the job's processes and with which roles, whether it runs
// its own loop) and its factory. make_strategy() and the questions below look the kind up there.
//
// Replica threads are created once and live as long as the strategy; the cores are divided among
// them (threads_per_replica) so there are never more compute threads than cores.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "config/experiment.hpp"
#include "config/strategies.hpp"
#include "core/error.hpp"
#include "core/tensor.hpp"
#include "core/variable.hpp"
#include "device/context.hpp"
#include "distribute/communicator.hpp"

namespace dtrain::distribute {

struct ReplicaContext {
  int replica_id = 0;            // among this process's replicas
  int num_replicas_in_sync = 1;  // over all workers
  int global_replica_id = 0;     // worker_index * local replicas + replica_id
};

class Strategy {
 public:
  using ReplicaFn = std::function<void(const ReplicaContext&)>;
  virtual ~Strategy() = default;
  Strategy() = default;
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  // ---- layout
  // The header line's fragment: "strategy mirrored | replicas 2 (cpu:0, cpu:1) | cross-device ops ring".
  virtual std::string describe() const = 0;
  // Why `auto` chose what it chose; empty when the experiment named it.
  virtual const std::string& choice_note() const = 0;
  // This process's replicas, and the worker processes (each with as many).
  virtual int num_local_replicas() const = 0;
  virtual int workers() const = 0;
  virtual int worker_index() const = 0;
  int num_replicas_in_sync() const { return num_local_replicas() * workers(); }
  // Only the chief prints and writes files.
  virtual bool is_chief() const { return worker_index() == 0; }
  virtual Device replica_device(int replica) const = 0;
  // Compute threads of each local replica (the cores divided among them).
  virtual int threads_per_replica() const = 0;
  ReplicaContext replica_context(int replica) const;

  // ---- variables
  // Whether local replica `replica` keeps a copy of the variables and applies the update to it
  // (mirrored kinds: every replica; central storage: only the parameter device's).
  virtual bool holds_variables(int replica) const = 0;
  // The replica whose copy checkpoints save, and restore writes first (the others then copy it).
  virtual int primary_replica() const = 0;
  // Once every replica's model is built and before its first step: replicas that hold no copy
  // compute with the holder's values (their Variable::value then shares the holder's storage).
  virtual void place_variables(std::span<const std::vector<Variable*>> per_replica) = 0;

  // ---- running
  // Runs fn on every local replica and returns when all have finished (with one replica, on the
  // calling thread). If a replica throws, the others are released from any collective they wait
  // in (they stop with BarrierBroken) and the first exception is rethrown here.
  virtual void run(const ReplicaFn& fn) = 0;
  // A step failed (here, on another replica or on another worker): device sums queued on this
  // process's GPUs may wait for peers that will never queue theirs, and tearing down a context
  // waits for its stream. Cancels them (NCCL: ncclCommAbort), so that the error is reported and
  // the process ends; nothing is summed on a device after it across workers. run() calls it when
  // one of its replicas failed, and the trainer when it is torn down by an error.
  virtual void abandon_device_sums() {}
  // One value per local replica, summed in replica order and then across the workers
  // (tf.distribute.Strategy.reduce(SUM)).
  virtual double reduce_sum(std::span<const double> per_replica) = 0;
  // Outside run(): exact element-wise sums and maxima across the workers (every worker calls
  // them at the same point; `what` names them for the watchdog).
  virtual void all_reduce_sum(std::span<std::int64_t> values, const char* what) = 0;
  virtual void all_reduce_sum(std::span<double> values, const char* what) = 0;
  virtual int all_reduce_max(int value, const char* what) = 0;
  // Every worker's `mine`, in worker order (the input shares' sizes).
  virtual std::vector<std::int64_t> all_gather(std::int64_t mine, const char* what) = 0;
  // The global step about to run, for the watchdog's reports.
  virtual void set_step(std::int64_t global_step) = 0;

  // ---- inside run()
  // Before the first step: whether the model makes collectives (all_reduce_sum_in_replica) during
  // backward. Across workers, two threads may not call MPI at once and every rank must enter the
  // collectives in the same order, so the gradient sums then no longer overlap backward. Call it
  // before bind_gradients().
  virtual void set_collectives_in_backward(bool yes) = 0;
  // Each replica registers its gradient arena once, before its first sum_gradients(): one
  // contiguous f32 tensor in the memory of the replica's context `ctx`, partitioned into
  // variables of `sizes` floats (the same on every replica). Collectives over host memory reach it
  // through staging copies where the host cannot read it in place (staged_gradients.hpp).
  virtual void bind_gradients(int replica, device::Context& ctx, const Tensor& gradients,
                              std::span<const std::size_t> sizes) = 0;
  // During backward: variables [first, first + count) of the replica's arena hold their final
  // gradients for this step. Across workers, their sum may start now.
  virtual void gradients_ready(const ReplicaContext& replica, std::size_t first, std::size_t count) = 0;
  // Whether the sums across workers overlap backward (gradients_ready() then matters). Known once
  // the gradients are bound.
  virtual bool overlaps_backward() const = 0;
  // Sums the replicas' gradients: into every replica that holds variables.
  virtual void sum_gradients(const ReplicaContext& replica) = 0;
  // Applies `apply` once per variable copy: on the replicas that hold variables. Returns whether
  // it ran here.
  virtual bool update(const ReplicaContext& replica, const std::function<void()>& apply) = 0;
  // Called by every replica in sync, in the same order (synchronized batch normalization during
  // forward and backward): the element-wise sum over every local replica, in replica order, and
  // then across the workers, on every replica. During backward only after
  // set_collectives_in_backward(true): while gradient sums overlap backward it is an InternalError.
  virtual void all_reduce_sum_in_replica(const ReplicaContext& replica, std::span<double> values, const char* what) = 0;
  // The same over exact integers (reproducibility: replica_invariant's fixed-point gradients and
  // exponent-binned losses): a sum in any order is the same sum, so the result is the same for
  // every layout of replicas, lanes and ranks.
  virtual void all_reduce_sum_in_replica(const ReplicaContext& replica, std::span<std::int64_t> values,
                                         const char* what) = 0;

  // ---- reporting
  // Seconds since the last call inside the collectives summing gradients across workers, and
  // blocked waiting for them (less than the first when they overlap backward); 0 in one process.
  virtual double take_cross_worker_seconds() = 0;
  virtual double take_cross_worker_wait_seconds() = 0;

  // A strategy that runs its own training loop (a parameter-server coordinator dispatching steps
  // to workers) says so here; the trainer's loop then is not the one that runs steps: the loop its
  // kind registered runs instead (train/strategy_loop.hpp).
  virtual bool schedules_steps() const { return false; }
  // Whether a process of the job died and this one outlived it (a parameter-server job under
  // mpirun --enable-recovery): MPI_Finalize could then wait for the dead one forever, and the app
  // ends the process without it (WorkerGroup::note_rank_lost).
  virtual bool lost_a_rank() const { return false; }
};

// ---- the registry of strategy kinds

// What a strategy file registers besides its YAML schema: where its replicas go and how it is made.
struct StrategyPlacement {
  // The devices of this process's replicas; total_threads are the compute threads it may use.
  std::vector<Device> (*local_devices)(const config::StrategyConfig& config, int total_threads) = nullptr;
  // For a kind that spans the job's worker processes (MPI ranks): the roles its ranks take
  // (resolved with TF_CONFIG against the job: roles.hpp). Null for a kind that runs in one process.
  const config::RolesConfig* (*roles)(const config::StrategyConfig& config) = nullptr;
  // Whether its training ranks run a loop of its own instead of the trainer's (the one its kind
  // registers in train/strategy_loop.hpp), each step then being one process's replicas' alone.
  bool own_loop = false;
  // The strategy, on `devices` (local_devices' answer); `workers` are the job's processes (a group
  // of one without a launcher). ConfigError, with the YAML location, for what the devices cannot do.
  std::unique_ptr<Strategy> (*make)(const config::StrategyConfig& config, std::vector<Device> devices,
                                    int total_threads, Communicator& workers) = nullptr;
};

// In a strategy file (before main; InternalError for a kind registered twice):
//   const StrategyRegistration registered({.kind = MyOptions::kind, .listed_at = 70, .keys = {...},
//                                          .parse = &parse, .write = &write, ...},
//                                         {.local_devices = &local_devices, .make = &make});
struct StrategyRegistration {
  StrategyRegistration(const config::StrategySchema& schema, const StrategyPlacement& placement);
};

// The strategy of `config` for this process: total_threads are the compute threads it may use;
// workers the worker processes (used by the kinds that span them; the others run in this process
// alone). ConfigError, with the YAML location, for what the devices cannot do.
std::unique_ptr<Strategy> make_strategy(const config::StrategyConfig& config, int total_threads, Communicator& workers);

// Whether `config`'s strategy spans the worker processes of a job (roles, the evaluator).
bool spans_workers(const config::StrategyConfig& config);
// Its roles when it does; null otherwise.
const config::RolesConfig* roles_of(const config::StrategyConfig& config);
// Whether its training ranks run its own loop instead of the trainer's.
bool runs_own_loop(const config::StrategyConfig& config);
// The kinds that span worker processes, in listing order; `trainer_loop`: only those whose steps
// the trainer's loop runs (synchronous training across processes).
std::vector<std::string_view> kinds_spanning_workers(bool trainer_loop = false);
// The kinds whose training ranks run their own loop, in listing order.
std::vector<std::string_view> kinds_with_own_loop();
// The replicas in sync make_strategy would make of `config` in a job of `workers` processes.
int num_replicas_in_sync(const config::StrategyConfig& config, int total_threads, int workers);
// What evaluation runs under: the default kind in one process; across `workers` > 1 processes
// the first kind that spans them with the trainer's loop (each evaluates its share; the counts
// are combined exactly), with its default options.
config::StrategyConfig evaluation_strategy(int workers);

// The devices of a `devices` key: the list, or when automatic, cpu:0 .. cpu:(automatic_count-1).
std::vector<Device> devices_of(const config::DeviceList& devices, int automatic_count);
// The GPUs `devices: auto` takes (device::device_count): 0 where the machine has none. A
// ConfigError at the strategy's devices key where it has NVIDIA's driver but the CUDA backend
// cannot load: such a run must not fall back to the CPU unnoticed.
int automatic_gpus(const config::StrategyConfig& config);

// The options of a strategy, as its kind's own type; InternalError for another kind's.
template <class Options>
const Options& options_as(const config::StrategyOptions& options) {
  const Options* typed = options.get_if<Options>();
  DTRAIN_CHECK(typed != nullptr, "strategy options read as another kind's");
  return *typed;
}
template <class Options>
const Options& options_as(const config::StrategyConfig& config) {
  return options_as<Options>(config.options);
}

// A strategy config built in code (tests, tools): the kind comes from the options type.
template <class Options>
config::StrategyConfig strategy_config(Options options) {
  config::StrategyConfig c;
  c.kind = std::string(Options::kind);
  c.options = std::move(options);
  return c;
}

// Parses "cpu:3" / "gpu:0" (already normalised by the config parser).
Device parse_device(const std::string& name);

}  // namespace dtrain::distribute
