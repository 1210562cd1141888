// The three loops of ParameterServerStrategy (distribute/parameter_server.hpp), one per role, which
// its kind registers with the trainer (train/strategy_loop.hpp) to run in place of fit()'s own:
//
//   coordinator (the chief)  schedules steps_per_epoch steps per epoch over the workers, at most
//       kInFlightPerWorker each (ClusterCoordinator.schedule), folds each step's loss and exact
//       metric counts into the epoch's figures as results arrive, and at the end of the epoch
//       (join: every scheduled step done) reads the variables back from the servers, evaluates
//       the test split once on them and prints the epoch lines. Checkpoints are written only where
//       no step is in flight (the scheduling stops at each checkpoint.every_steps boundary, and a
//       stop request lets the steps in flight finish first), so a checkpoint's "continue at step
//       k" has exactly k steps' updates in it. A worker that has not answered for
//       communication.timeout_seconds is marked lost; its unfinished steps go to the others.
//   worker  for each order: pull the variables from every server, run one batch of its own input
//       (auto_shard as across any worker processes), push the gradients (and the moving
//       statistics' changes) to the servers, report.
//   server  holds its shards and their optimizer slots; applies each push at once.
//
// The loops reach the trainer only through its LoopHost.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "core/error.hpp"
#include "distribute/parameter_server.hpp"
#include "train/strategy_loop.hpp"

namespace dtrain::train {

namespace {

using Clock = std::chrono::steady_clock;
using distribute::ParameterServerStrategy;

// Where the model's variables live: their shards, and each server's in the order it packs them.
struct Layout {
  std::vector<distribute::Shard> shards;
  std::vector<std::vector<std::size_t>> on_server;  // indices into shards
  std::vector<std::size_t> server_floats;
  std::vector<int> trainable_index;  // per variable: its index among the trainable ones, or -1
};

Layout layout_of(const std::vector<Variable*>& vars, const ParameterServerStrategy& ps) {
  Layout l;
  std::vector<Shape> shapes;
  int trained = 0;
  for (const Variable* v : vars) {
    shapes.push_back(v->value.shape());
    l.trainable_index.push_back(v->trainable ? trained++ : -1);
  }
  const int servers = ps.plan().ps;
  l.shards = distribute::place_shards(ps.partitioner(), shapes, servers);
  l.on_server.resize(static_cast<std::size_t>(servers));
  l.server_floats.assign(static_cast<std::size_t>(servers), 0);
  for (std::size_t i = 0; i < l.shards.size(); ++i) {
    const auto s = static_cast<std::size_t>(l.shards[i].server);
    l.on_server[s].push_back(i);
    l.server_floats[s] += static_cast<std::size_t>(l.shards[i].size);
  }
  return l;
}

// A shard's floats of a tensor in the memory of `ctx` (its variable, a gradient, a slot), to and
// from host memory: what the transport sends and receives.
void shard_to_host(device::Context& ctx, const Tensor& t, const distribute::Shard& s, float* host) {
  ctx.copy_to_host(t.address<float>() + s.offset, host, static_cast<std::size_t>(s.size) * sizeof(float));
}
void shard_from_host(device::Context& ctx, const float* host, Tensor& t, const distribute::Shard& s) {
  ctx.copy_from_host(host, t.address<float>() + s.offset, static_cast<std::size_t>(s.size) * sizeof(float));
}

// The result of a step, as a worker sends it: global step, loss, samples, staleness, whether the
// worker was asked to stop (a signal to its process: the coordinator stops the job for it), then
// each metric's counts and sums.
constexpr std::size_t kResultHead = 5;
// In place of a global step: the worker lost the server named next.
constexpr double kServerLost = -1.0;
// In place of a global step: the worker's answer to the coordinator's roll call.
constexpr double kRollCallAnswer = -2.0;

class ParameterServerLoop final : public StrategyLoop {
 public:
  static constexpr int kInFlightPerWorker = 2;
  explicit ParameterServerLoop(ParameterServerStrategy& ps) : ps_(ps) {}

  std::vector<EpochLog> fit(LoopHost& host) override {
    switch (ps_.role()) {
      case distribute::Role::chief: return coordinate(host);
      case distribute::Role::worker: work(host); return {};
      case distribute::Role::ps: serve(host); return {};
      case distribute::Role::evaluator: break;
    }
    throw InternalError("an evaluator rank does not train");
  }

 private:
  std::vector<EpochLog> coordinate(LoopHost& host);
  void work(LoopHost& host);
  void serve(LoopHost& host);
  ParameterServerStrategy& ps_;
};

const StrategyLoopRegistration registered(distribute::ParameterServerOptions::kind,
                                          [](distribute::Strategy& strategy) -> std::unique_ptr<StrategyLoop> {
                                            return std::make_unique<ParameterServerLoop>(
                                                strategy_as<ParameterServerStrategy>(strategy));
                                          });

}  // namespace

// ------------------------------------------------------------------------------------- server

void ParameterServerLoop::serve(LoopHost& host) {
  ParameterServerStrategy& ps = ps_;
  optim::Optimizer& built = host.replica_optimizer();
  const std::vector<Variable*>& vars = host.replica_model().variables();
  const Layout layout = layout_of(vars, ps);
  const auto me = static_cast<std::size_t>(ps.transport().rank() - ps.server_rank(0));
  const std::vector<std::size_t>& mine = layout.on_server[me];

  // This server's shards start from the model as this rank built or restored it (every rank built
  // it from the same seed, or restored the same checkpoint), optimizer slots included. They live
  // in the memory of this rank's replica context, whose numerics update them.
  device::Context& ctx = host.replica_model().context();
  std::vector<Variable> parts(mine.size());
  std::vector<Variable*> trained;
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const distribute::Shard& s = layout.shards[mine[i]];
    const Variable& whole = *vars[s.variable];
    parts[i].name = fmt::format("{}/part_{}", whole.name, s.part);
    parts[i].value = ctx.tensor(s.shape);
    parts[i].grad = ctx.tensor(s.shape);
    parts[i].trainable = whole.trainable;
    ctx.copy_on_device(whole.value.address<float>() + s.offset, parts[i].value.raw(), parts[i].value.bytes());
    if (whole.trainable) trained.push_back(&parts[i]);
  }
  auto optimizer = optim::make_optimizer(host.experiment().optimizer, host.replica_numerics());
  optimizer->place_slots(ctx);
  const std::size_t slots = optimizer->slot_names().size();
  if (!trained.empty()) optimizer->build(trained);
  if (built.built()) {
    std::size_t j = 0;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const distribute::Shard& s = layout.shards[mine[i]];
      const int ti = layout.trainable_index[s.variable];
      if (ti < 0) continue;
      for (std::size_t k = 0; k < slots; ++k) {
        Tensor& slot = optimizer->slot(j, k);
        ctx.copy_on_device(built.slot(static_cast<std::size_t>(ti), k).address<float>() + s.offset, slot.raw(),
                           slot.bytes());
      }
      ++j;
    }
  }
  optimizer->set_iterations(built.iterations());

  // Appends `t` (memory of ctx) to host `out`.
  const auto append = [&ctx](const Tensor& t, std::vector<float>& out) {
    const std::size_t at = out.size();
    out.resize(at + static_cast<std::size_t>(t.numel()));
    ctx.copy_to_host(t, out.data() + at);
  };
  distribute::ServerHandlers handlers;
  handlers.values = [&](std::vector<float>& out) {
    out.clear();
    for (const Variable& p : parts) append(p.value, out);
  };
  handlers.apply = [&](std::span<const float> pushed) {
    std::size_t at = 0;
    for (Variable& p : parts) {
      const auto n = static_cast<std::size_t>(p.value.numel());
      ctx.copy_from_host(pushed.data() + at, p.grad);
      // Moving statistics: the worker's change to the value it read (assign_add on the server).
      if (!p.trainable) host.replica_numerics().axpy(1.0f, p.grad.address<float>(), p.value.address<float>(), n);
      at += n;
    }
    if (trained.empty()) {
      optimizer->set_iterations(optimizer->iterations() + 1);
    } else {
      optimizer->apply_gradients(trained);
    }
  };
  handlers.stop_requested = [&host] {
    const std::atomic<int>* stop = host.stop_requested();
    return stop && stop->load() != 0;
  };
  handlers.state = [&](std::vector<float>& out) {
    handlers.values(out);
    for (std::size_t j = 0; j < trained.size(); ++j)
      for (std::size_t k = 0; k < slots; ++k) append(optimizer->slot(j, k), out);
    return optimizer->iterations();
  };
  ps.transport().serve(handlers, layout.server_floats[me]);
}

// ------------------------------------------------------------------------------------- worker

void ParameterServerLoop::work(LoopHost& host) {
  ParameterServerStrategy& ps = ps_;
  distribute::PsTransport& transport = ps.transport();
  nn::Sequential& model = host.replica_model();
  device::Context& ctx = model.context();
  const std::vector<Variable*>& vars = model.variables();
  const Layout layout = layout_of(vars, ps);
  const int servers = ps.plan().ps;

  // This worker's input, sharded over the workers as multi_worker_mirrored's auto_shard does; each
  // step is one global batch of it (the function a worker runs has one replica).
  host.read_input_share(ps.plan().workers, ps.worker_number());
  auto input = host.training_input();

  std::vector<std::vector<float>> values(static_cast<std::size_t>(servers)), pushed(values.size());
  for (std::size_t s = 0; s < values.size(); ++s) {
    values[s].resize(layout.server_floats[s]);
    pushed[s].resize(layout.server_floats[s]);
  }
  std::vector<std::int64_t> versions(values.size());
  std::vector<std::vector<float>> read(vars.size());  // the non-trainable values as read
  std::vector<float> now;                              // and after the step
  std::vector<double> result;
  double loss = 0.0;  // the last step's
  std::int64_t samples = 0;
  bool servers_asked_to_stop = false;  // a server's process was asked to stop: passed on with the results
  // One step: read the variables, compute on `batches`, push; returns the staleness.
  auto exchange = [&](const std::vector<data::ReplicaBatch>& batches, std::int64_t global_step) {
    std::int64_t staleness = 0;
    // Read the current variables from every server.
    for (std::size_t s = 0; s < values.size(); ++s) {
      bool server_stopping = false;
      versions[s] = transport.pull(ps.server_rank(static_cast<int>(s)), values[s], &server_stopping);
      servers_asked_to_stop = servers_asked_to_stop || server_stopping;
      std::size_t at = 0;
      for (std::size_t idx : layout.on_server[s]) {
        const distribute::Shard& sh = layout.shards[idx];
        shard_from_host(ctx, values[s].data() + at, vars[sh.variable]->value, sh);
        at += static_cast<std::size_t>(sh.size);
      }
    }
    for (std::size_t v = 0; v < vars.size(); ++v)
      if (!vars[v]->trainable) {
        read[v].resize(static_cast<std::size_t>(vars[v]->value.numel()));
        ctx.copy_to_host(vars[v]->value, read[v].data());
      }

    // One step on this worker's batch: the trainer's own replica step (the strategy applies nothing).
    samples = input->global_samples();
    loss = host.run_step(batches, samples, global_step);
    model.apply_updates();  // the moving statistics' new values: their change is pushed

    for (std::size_t s = 0; s < values.size(); ++s) {
      std::size_t at = 0;
      for (std::size_t idx : layout.on_server[s]) {
        const distribute::Shard& sh = layout.shards[idx];
        const Variable& v = *vars[sh.variable];
        float* out = pushed[s].data() + at;
        if (v.trainable) {
          shard_to_host(ctx, v.grad, sh, out);
        } else {
          now.resize(static_cast<std::size_t>(sh.size));
          shard_to_host(ctx, v.value, sh, now.data());
          const float* before = read[sh.variable].data() + sh.offset;
          for (std::int64_t e = 0; e < sh.size; ++e) out[e] = now[static_cast<std::size_t>(e)] - before[e];
        }
        at += static_cast<std::size_t>(sh.size);
      }
      staleness = std::max(staleness, transport.push(ps.server_rank(static_cast<int>(s)), versions[s], pushed[s]));
    }
    return staleness;
  };
  std::int64_t epoch = -1;
  for (;;) {
    const distribute::StepOrder order = transport.receive_order();
    if (order.kind == distribute::StepOrder::stop) return;
    if (order.kind == distribute::StepOrder::roll_call) {
      const double here[1] = {kRollCallAnswer};
      transport.send_result(here, transport.timeout_seconds());
      continue;
    }
    if (order.epoch != epoch) {
      epoch = order.epoch;
      // An epoch resumed at step k: the k steps before it are taken to have gone round the
      // workers in turn, so this worker goes on past its share of them (one worker: exactly
      // where the run stood).
      const std::int64_t workers = ps.plan().workers, me = ps.worker_number(), k = order.epoch_first_step;
      const std::int64_t taken = k / workers + (me < k % workers ? 1 : 0);
      input->start_epoch(epoch, input->steps_per_epoch() > 0 ? taken % input->steps_per_epoch() : 0);
    }
    const std::vector<data::ReplicaBatch>* batches = input->next();
    if (!batches) {
      // More steps than this worker's share holds: it goes through its share again.
      input->start_epoch(epoch);
      batches = input->next();
    }
    DTRAIN_CHECK(batches != nullptr, "a worker's input share has no batch");

    std::int64_t staleness = 0;
    try {
      staleness = exchange(*batches, order.global_step);
    } catch (const distribute::ServerLost& lost) {
      // Tell the coordinator first, so that it ends the job naming the server, not this worker.
      // Briefly: a message this small leaves at once unless the coordinator is gone too, and
      // this process is ending.
      const double report[2] = {kServerLost, static_cast<double>(lost.server_rank)};
      transport.send_result(report, std::min(transport.timeout_seconds(), 2.0));
      throw;
    }
    const std::atomic<int>* stop = host.stop_requested();
    result.assign({static_cast<double>(order.global_step), loss, static_cast<double>(samples),
                   static_cast<double>(staleness), servers_asked_to_stop || (stop && stop->load() != 0) ? 1.0 : 0.0});
    for (std::size_t i = 0; i < host.experiment().metrics.size(); ++i) {
      const metrics::MetricState st = host.train_metric_state(i);  // every lane's counts
      for (std::int64_t c : st.counts) result.push_back(static_cast<double>(c));
      result.insert(result.end(), st.sums.begin(), st.sums.end());
    }
    transport.send_result(result, transport.timeout_seconds());
  }
}

// -------------------------------------------------------------------------------- coordinator

namespace {

// The servers' variables and optimizer state into the chief's model and optimizer (what
// evaluation and checkpoints read).
void gather(ParameterServerStrategy& ps, const Layout& layout, nn::Sequential& model, optim::Optimizer& optimizer) {
  device::Context& ctx = model.context();
  const std::vector<Variable*>& vars = model.variables();
  optimizer.build(model.trainable_variables());
  const std::size_t slots = optimizer.slot_names().size();
  std::vector<float> state;
  std::int64_t iterations = 0;
  for (std::size_t s = 0; s < layout.on_server.size(); ++s) {
    iterations = std::max(iterations, ps.transport().gather(ps.server_rank(static_cast<int>(s)), state));
    std::size_t at = 0;
    for (std::size_t idx : layout.on_server[s]) {
      const distribute::Shard& sh = layout.shards[idx];
      shard_from_host(ctx, state.data() + at, vars[sh.variable]->value, sh);
      at += static_cast<std::size_t>(sh.size);
    }
    for (std::size_t idx : layout.on_server[s]) {
      const distribute::Shard& sh = layout.shards[idx];
      const int ti = layout.trainable_index[sh.variable];
      if (ti < 0) continue;
      for (std::size_t k = 0; k < slots; ++k) {
        shard_from_host(ctx, state.data() + at, optimizer.slot(static_cast<std::size_t>(ti), k), sh);
        at += static_cast<std::size_t>(sh.size);
      }
    }
    DTRAIN_CHECK(at == state.size(), fmt::format("parameter server {} sent {} floats of state, not {}",
                                                 ps.server_rank(static_cast<int>(s)), state.size(), at));
  }
  optimizer.set_iterations(iterations);
}

// Stops every worker and server when the coordinator leaves, however it leaves. Unless a rank is
// known lost already (every survivor then ends without MPI_Finalize), a roll call comes first: a
// rank that died with nothing asked of it (a worker given no step since, a server after the last
// gather) is noticed by nobody else, and the survivors, told to stop normally, would wait for it
// in MPI_Finalize forever. Found missing, it is lost, and the stop orders say so.
struct StopEveryone {
  ParameterServerStrategy& ps;
  ~StopEveryone() {
    try {
      if (!ps.transport().peer_lost()) roll_call();
      for (int w = 0; w < ps.plan().workers; ++w)
        ps.transport().send_order(ps.worker_rank(w),
                                  distribute::StepOrder{ps.transport().peer_lost() ? distribute::StepOrder::stop_after_loss
                                                                                   : distribute::StepOrder::stop,
                                                        0, 0});
      for (int s = 0; s < ps.plan().ps; ++s) ps.transport().stop_server(ps.server_rank(s));
    } catch (const std::exception&) {
      // The job is failing already: the error on its way out says why.
    }
  }

  // Every worker and server answers within its limit, or is marked lost (a warning names it).
  void roll_call() {
    distribute::PsTransport& transport = ps.transport();
    const int workers = ps.plan().workers;
    for (int w = 0; w < workers; ++w)
      transport.send_order(ps.worker_rank(w), distribute::StepOrder{distribute::StepOrder::roll_call, 0, 0});
    std::vector<bool> answered(static_cast<std::size_t>(workers), false);
    const auto until = Clock::now() + std::chrono::duration<double>(transport.timeout_seconds());
    while (!std::all_of(answered.begin(), answered.end(), [](bool a) { return a; }) && Clock::now() < until) {
      const std::optional<distribute::StepResultMessage> got = transport.poll_result();  // waits a little
      // Only answers count: a step's result still on its way (the coordinator leaving on an error) does not.
      if (!got || got->payload.empty() || got->payload[0] != kRollCallAnswer) continue;
      const auto i = static_cast<std::size_t>(got->worker_rank - ps.worker_rank(0));
      if (i < answered.size()) answered[i] = true;
    }
    for (int w = 0; w < workers; ++w) {
      if (answered[static_cast<std::size_t>(w)]) continue;
      transport.mark_peer_lost();
      fmt::print(stderr, "dtrain: warning: worker rank {} did not answer the coordinator's roll call within {:g} s as the "
                 "job ended: it is lost\n", ps.worker_rank(w), transport.timeout_seconds());
    }
    for (int s = 0; s < ps.plan().ps; ++s)
      if (!transport.server_answers(ps.server_rank(s)))
        fmt::print(stderr, "dtrain: warning: parameter server rank {} did not answer the coordinator's roll call within {:g} "
                   "s as the job ended: it is lost\n", ps.server_rank(s), transport.server_timeout());
  }
};

}  // namespace

std::vector<EpochLog> ParameterServerLoop::coordinate(LoopHost& host) {
  ParameterServerStrategy& ps = ps_;
  const config::Experiment& exp = host.experiment();
  std::FILE* out = host.out();
  distribute::PsTransport& transport = ps.transport();
  StopEveryone stop_everyone{ps};
  nn::Sequential& model = host.replica_model();
  std::vector<std::string> names;
  for (const Variable* v : model.variables()) names.push_back(v->name);
  const Layout layout = layout_of(model.variables(), ps);
  fmt::print(out, "variables on the parameter servers (ranks {}..{}): {}\n", ps.server_rank(0),
             ps.server_rank(ps.plan().ps - 1), distribute::describe_placement(layout.shards, names));
  std::fflush(out);

  // steps_per_epoch as the trainer's own loop counts it, over the whole training split.
  auto input = host.training_input();
  LoopState state;
  state.steps = host.steps_per_epoch(*input);
  // The callbacks see a stop request only where no step is in flight (a checkpoint then holds
  // exactly the steps it says): the loop passes the request on when it has drained.
  std::atomic<int> stop_seen{0};
  const std::atomic<int>* stop_requested = host.stop_requested();
  CallbackList callbacks = host.make_callbacks(&stop_seen);
  bool worker_asked_to_stop = false;  // a signal to a worker's process, passed on in its results
  auto asked_to_stop = [&] { return worker_asked_to_stop || (stop_requested && stop_requested->load() != 0); };

  const int workers = ps.plan().workers;
  const double timeout = transport.timeout_seconds();
  std::vector<bool> lost(static_cast<std::size_t>(workers), false);
  std::vector<std::deque<std::int64_t>> in_flight(lost.size());
  std::vector<Clock::time_point> last_heard(lost.size(), Clock::now());
  std::vector<std::string> lost_notes;
  const std::int64_t every_steps = exp.checkpoint.every_steps;

  callbacks.on_train_begin(state);
  std::vector<EpochLog> history;
  for (state.epoch = host.first_epoch(); state.epoch < exp.train.epochs; ++state.epoch) {
    host.begin_epoch(state, *input);
    callbacks.on_epoch_begin(state);
    const auto t0 = Clock::now();
    const std::int64_t first = state.step, base = host.global_step();
    std::deque<std::int64_t> pending;  // steps of this epoch not yet scheduled, or given back by a lost worker
    for (std::int64_t k = first; k < state.steps; ++k) pending.push_back(k);
    // The steps to finish before the next point where nothing is in flight: the next
    // checkpoint.every_steps boundary, or the epoch's end.
    auto next_boundary = [&](std::int64_t done) {
      if (every_steps <= 0) return state.steps;
      const std::int64_t global_done = base + (done - first);
      return std::min(state.steps, first + (global_done / every_steps + 1) * every_steps - base);
    };
    std::int64_t boundary = next_boundary(state.step), scheduled_end = first;
    bool stopping = false;
    double staleness_sum = 0.0;
    std::int64_t staleness_max = 0, staleness_count = 0;
    while (state.step < state.steps) {
      for (int w = 0; w < workers; ++w) {
        const auto i = static_cast<std::size_t>(w);
        while (!lost[i] && in_flight[i].size() < static_cast<std::size_t>(kInFlightPerWorker) && !pending.empty() &&
               pending.front() < boundary) {
          const std::int64_t k = pending.front();
          pending.pop_front();
          if (in_flight[i].empty()) last_heard[i] = Clock::now();
          transport.send_order(ps.worker_rank(w), distribute::StepOrder{distribute::StepOrder::step, base + (k - first),
                                                                        state.epoch, first});
          in_flight[i].push_back(k);
          scheduled_end = std::max(scheduled_end, k + 1);
        }
      }
      const std::optional<distribute::StepResultMessage> got = transport.poll_result();
      // A worker that has not answered for the timeout is lost: its unfinished steps go back.
      // Checked whatever arrived, so that the others' results do not hide it until they run dry
      // (the worker just heard from is not lost).
      for (int w = 0; w < workers; ++w) {
        const auto i = static_cast<std::size_t>(w);
        if (lost[i] || in_flight[i].empty() || (got && got->worker_rank == ps.worker_rank(w)) ||
            std::chrono::duration<double>(Clock::now() - last_heard[i]).count() <= timeout)
          continue;
        lost[i] = true;
        transport.mark_peer_lost();
        const std::string note = fmt::format("worker rank {} was lost at epoch {}, step {} (no answer for {:g} s)",
                                             ps.worker_rank(w), state.epoch + 1, state.step, timeout);
        fmt::print(stderr, "dtrain: warning: {}; its {} unfinished step(s) go to the other workers\n", note,
                   in_flight[i].size());
        lost_notes.push_back(note);
        pending.insert(pending.begin(), in_flight[i].begin(), in_flight[i].end());
        std::sort(pending.begin(), pending.end());
        in_flight[i].clear();
      }
      if (std::all_of(lost.begin(), lost.end(), [](bool l) { return l; }))
        throw PeerLostError(fmt::format("every worker is lost ({})", lost_notes.back()));
      if (!got) continue;
      const auto i = static_cast<std::size_t>(got->worker_rank - ps.worker_rank(0));
      if (i >= lost.size() || lost[i]) continue;  // a lost worker's late answer: its step ran elsewhere
      const std::vector<double>& r = got->payload;
      if (r.at(0) == kServerLost) {
        transport.mark_peer_lost();  // passed on to the others by StopEveryone
        throw PeerLostError(fmt::format("parameter server rank {} is lost: worker rank {} got no answer from it within {:g} "
                                        "s; the job cannot go on without its variables",
                                        static_cast<int>(r.at(1)), got->worker_rank, transport.server_timeout()));
      }
      const auto k = static_cast<std::int64_t>(r[0]) - base + first;
      const auto pos = std::find(in_flight[i].begin(), in_flight[i].end(), k);
      DTRAIN_CHECK(pos != in_flight[i].end(), fmt::format("worker rank {} reported step {}, which it was not given",
                                                          got->worker_rank, static_cast<std::int64_t>(r[0])));
      in_flight[i].erase(pos);
      last_heard[i] = Clock::now();

      state.loss_sum += r[1];
      state.samples += static_cast<std::int64_t>(r[2]);
      const auto staleness = static_cast<std::int64_t>(r[3]);
      staleness_sum += static_cast<double>(staleness);
      staleness_max = std::max(staleness_max, staleness);
      ++staleness_count;
      if (r[4] != 0.0 && !worker_asked_to_stop) {
        worker_asked_to_stop = true;
        fmt::print(stderr, "dtrain: worker rank {} (or a parameter server it reads) was asked to stop: the job stops "
                           "after the steps in flight\n",
                   got->worker_rank);
      }
      std::size_t at = kResultHead;
      for (std::size_t m = 0; m < exp.metrics.size(); ++m) {
        metrics::MetricState st = host.train_metric_state(m);  // its shape; the values are the worker's
        for (auto& c : st.counts) c = static_cast<std::int64_t>(r.at(at++));
        for (auto& v : st.sums) v = r.at(at++);
        host.merge_train_metric(m, st);
      }
      ++state.step;
      host.set_global_step(base + (state.step - first));
      state.global_step = host.global_step();

      if (!stopping && asked_to_stop()) {
        // Finish what is in flight (and what a lost worker left), schedule nothing new.
        stopping = true;
        boundary = scheduled_end;
      }
      const bool drained = state.step == boundary &&
                           std::all_of(in_flight.begin(), in_flight.end(), [](const auto& f) { return f.empty(); });
      if (drained) {
        // join(): every update is in; a checkpoint may be written now.
        gather(ps, layout, model, host.replica_optimizer());
        if (stopping) stop_seen = 1;
        boundary = next_boundary(state.step);
      }
      // While the coordinator is in its callbacks (a checkpoint, a test's hold) it hears nobody:
      // that time is not a worker's silence.
      const auto callbacks_began = Clock::now();
      callbacks.on_train_batch_end(state);
      const auto not_listening = Clock::now() - callbacks_began;
      for (auto& heard : last_heard) heard += not_listening;
      if (state.stop_training) {
        callbacks.on_train_end(state);
        throw Interrupted{state.checkpoint, state.epoch, state.step};
      }
    }
    EpochLog log = host.end_epoch(state, std::chrono::duration<double>(Clock::now() - t0).count());
    log.staleness_mean = staleness_count > 0 ? staleness_sum / static_cast<double>(staleness_count) : 0.0;
    log.staleness_max = staleness_max;
    fmt::print(out, "{}\n{}\n", epoch_line(log), throughput_line(log));
    std::fflush(out);
    if (asked_to_stop()) stop_seen = 1;  // asked during the evaluation: the epoch is complete
    callbacks.on_epoch_end(state, log);
    history.push_back(log);
    if (state.stop_training) {
      callbacks.on_train_end(state);
      throw Interrupted{state.checkpoint, state.epoch + 1, 0};
    }
  }
  callbacks.on_train_end(state);
  for (const std::string& note : lost_notes)
    fmt::print(stderr, "dtrain: warning: {}; training finished on the other workers\n", note);
  return history;
}

}  // namespace dtrain::train
