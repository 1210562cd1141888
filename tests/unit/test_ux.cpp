// What surrounds a run for its user: when progress: auto draws a bar, the experiment `dtrain init`
// writes, and the curves `dtrain plot` reads and draws.
#include <doctest/doctest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "config/experiment_template.hpp"
#include "config/parse.hpp"
#include "core/error.hpp"
#include "observe/observers.hpp"
#include "observe/plot.hpp"

using namespace dtrain;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// getenv over a table.
auto environment(std::map<std::string, std::string> table) {
  return [table = std::move(table)](const char* name) -> const char* {
    const auto found = table.find(name);
    return found == table.end() ? nullptr : found->second.c_str();
  };
}

}  // namespace

TEST_CASE("progress: auto draws a bar only on a person's terminal, never through an MPI launcher") {
  using observe::progress_reaches_a_terminal;
  CHECK(progress_reaches_a_terminal(true, environment({{"TERM", "xterm-256color"}})));
  CHECK_FALSE(progress_reaches_a_terminal(false, environment({{"TERM", "xterm"}})));
  CHECK_FALSE(progress_reaches_a_terminal(true, environment({})));
  CHECK_FALSE(progress_reaches_a_terminal(true, environment({{"TERM", "dumb"}})));
  CHECK_FALSE(progress_reaches_a_terminal(true, environment({{"TERM", ""}})));
  // OpenMPI gives each rank a pseudo-terminal whatever mpirun's own output is.
  CHECK_FALSE(progress_reaches_a_terminal(true, environment({{"TERM", "xterm"}, {"OMPI_COMM_WORLD_SIZE", "2"}})));
  CHECK_FALSE(progress_reaches_a_terminal(true, environment({{"TERM", "xterm"}, {"PMIX_RANK", "0"}})));
  CHECK_FALSE(progress_reaches_a_terminal(true, environment({{"TERM", "xterm"}, {"PMI_RANK", "0"}})));
}

TEST_CASE("init: every strategy's template parses back to itself, with every key commented and the TODOs") {
  for (std::string_view kind : config::choices_of("strategy.kind")) {
    CAPTURE(kind);
    config::TemplateOptions options;
    options.strategy = std::string(kind);
    const std::string text = config::experiment_template(options);
    const config::Experiment e = config::parse_experiment(text, "init.yaml");
    CHECK(e.strategy.kind == kind);
    CHECK(e.loss.reduction == config::Reduction::none);
    CHECK(e.model.layers.size() == 7);
    for (const char* todo : {"strategy", "dataset", "model", "loss reduction", "metrics", "epochs"})
      CHECK(contains(text, fmt::format("# TODO({}):", todo)));
    // Every key is explained beside it or in the comment lines just above it; layers carry their
    // options written out. A key added to to_yaml without a note fails here.
    std::istringstream lines(text);
    std::string line, previous;
    while (std::getline(lines, line)) {
      const auto first = line.find_first_not_of(' ');
      const bool key = first != std::string::npos && line[first] != '#' && line.compare(first, 2, "- ") != 0;
      if (key && !contains(line, "#")) {
        const bool commented_above = previous.find_first_not_of(' ') != std::string::npos &&
                                     previous[previous.find_first_not_of(' ')] == '#';
        const bool section = line.back() == ':';
        CHECK_MESSAGE((commented_above || section), "no comment for: " << line);
      }
      previous = line;
    }
  }
  config::TemplateOptions mlp;
  mlp.model = "mlp";
  CHECK(config::parse_experiment(config::experiment_template(mlp), "init.yaml").model.layers.size() == 3);
}

TEST_CASE("init: the choices beside a key come from the parser's tables") {
  const std::string text = config::experiment_template({});
  CHECK(contains(text, "default | one_device | mirrored | central_storage | multi_worker_mirrored | parameter_server"));
  CHECK(contains(text, "none | sum | sum_over_batch_size | auto"));
  CHECK(contains(text, "auto | bar | lines | none"));
  // The layer registry's kinds and options.
  CHECK(contains(text, "#   conv2d: filters, kernel_size, strides, padding, activation"));
  CHECK(contains(text, "#   max_pool2d (or max_pooling2d): pool_size"));
  config::TemplateOptions bad;
  bad.model = "resnet";
  CHECK_THROWS_AS(config::experiment_template(bad), ConfigError);
  bad = {};
  bad.strategy = "tpu";
  CHECK_THROWS_AS(config::experiment_template(bad), ConfigError);
}

namespace {

// The text after "# " of every commented line of `text` that starts (after "# ") with `start`,
// its own trailing comment removed.
std::vector<std::string> commented(const std::string& text, const std::string& start) {
  std::vector<std::string> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const auto hash = line.find("# ");
    if (hash == std::string::npos || line.find_first_not_of(' ') != hash) continue;
    std::string body = line.substr(hash + 2);
    if (body.rfind(start, 0) != 0) continue;
    out.push_back(body.substr(0, body.find("   #")));
  }
  return out;
}

}  // namespace

TEST_CASE("init: every learning-rate schedule and data source is shown with its keys, and reads back") {
  const std::string text = config::experiment_template({});
  // One commented learning_rate line per schedule but the plain number, each one the parser takes.
  const std::vector<std::string> rates = commented(text, "learning_rate: {schedule: ");
  for (std::string_view kind : config::choices_of("optimizer.learning_rate.schedule")) {
    if (kind == "constant") continue;
    CAPTURE(kind);
    const auto line = std::find_if(rates.begin(), rates.end(), [&](const std::string& l) {
      return contains(l, fmt::format("{{schedule: {},", kind));
    });
    REQUIRE(line != rates.end());
    const std::string value = line->substr(std::string("learning_rate: ").size());
    const config::Experiment e = config::parse_experiment(text, "init.yaml", {"optimizer.learning_rate=" + value});
    CHECK(config::name_of(e.optimizer.learning_rate.kind) == kind);
  }
  CHECK(contains(text, "boundaries: [1000, 2000], values: [0.001, 0.0005, 0.0001]"));
  CHECK(contains(text, "decay_steps: 10000, alpha: 0.0"));  // the default the parser writes
  // The keys only some sources take, on one line each, which read back with their source.
  for (const char* source : {"synthetic", "tensors"}) {
    CAPTURE(source);
    std::string keys;
    for (const std::string& line : commented(text, ""))
      if (contains(text, fmt::format("# {}   # source: {} only", line, source))) keys = line;
    REQUIRE_FALSE(keys.empty());
    const config::Experiment e =
        config::parse_experiment(text, "init.yaml", {fmt::format("data={{source: {}, {}}}", source, keys)});
    CHECK(config::name_of(e.data.source) == std::string(source));
  }
  CHECK(contains(text, "# x: [1.0], y: [1.0], size: 100   # source: tensors only"));
}

TEST_CASE("init: each strategy's template shows only the keys that strategy takes") {
  auto of = [](const char* kind) {
    config::TemplateOptions options;
    options.strategy = kind;
    return config::experiment_template(options);
  };
  const std::string mwm = of("multi_worker_mirrored");
  CHECK(contains(mwm, "implementation: auto | ring | mpi | nccl"));
  CHECK(contains(mwm, "# roles: {chief: 1, evaluator: 0}"));
  // The commented roles line is one the parser takes under this strategy.
  CHECK_NOTHROW(config::parse_experiment(mwm, "init.yaml", {"strategy.roles={chief: 1, evaluator: 0}"}));
  const std::string ps = of("parameter_server");
  CHECK_FALSE(contains(ps, "# roles:"));  // its roles are written out; without ps it would be refused
  CHECK_FALSE(contains(ps, "bytes_per_pack"));
  CHECK_FALSE(contains(ps, "implementation"));
  CHECK_FALSE(contains(ps, "overlap"));
  CHECK(contains(ps, "communication: {timeout_seconds: 300.0}"));
  CHECK(contains(ps, "`mpirun -n 5 dtrain run FILE`"));
  for (const char* local : {"default", "one_device", "mirrored", "central_storage"}) {
    CAPTURE(local);
    const std::string text = of(local);
    CHECK_FALSE(contains(text, "communication"));
    CHECK_FALSE(contains(text, "roles"));
    CHECK_FALSE(contains(text, "mpirun -n 5"));
    CHECK(contains(text, "`dtrain run FILE`"));
  }
  CHECK(config::launcher_for("multi_worker_mirrored") == "mpirun -n 2 ");
  CHECK(config::launcher_for("default").empty());
}

TEST_CASE("plot: metrics.jsonl is read per epoch, a resumed run's later record winning") {
  const auto dir = std::filesystem::temp_directory_path() / "dtrain_test_ux_plot";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  CHECK_THROWS_AS(observe::read_run_curves(dir.string()), InputError);
  {
    std::ofstream out(dir / "metrics.jsonl");
    out << R"({"epoch": 1, "global_step": 3, "loss": 2.5, "accuracy": 0.25, "test_loss": 2.25, "test_accuracy": 0.5, "test_samples": 500, "train_samples": 192, "train_seconds": 0.5, "train_samples_per_s": 384.00})"
        << "\n"
        << R"({"epoch": 2, "global_step": 6, "loss": 2.0, "accuracy": 0.5, "val_loss": 1.75, "val_accuracy": 0.625, "val_samples": 8, "train_samples": 192, "train_seconds": 0.5, "train_samples_per_s": 384.00})"
        << "\n"
        << R"({"epoch": 2, "global_step": 6, "loss": 1.5, "train_samples": 192, "train_seconds": 0.5, "train_samples_per_s": 400.00})"
        << "\n";
  }
  const observe::RunCurves run = observe::read_run_curves(dir.string());
  CHECK(run.label == "dtrain_test_ux_plot");
  REQUIRE(run.epochs.size() == 2);
  CHECK(run.epochs[0].loss == 2.5);
  CHECK(*run.epochs[0].accuracy == 0.25);
  CHECK(*run.epochs[0].test_loss == 2.25);
  CHECK(*run.epochs[0].test_accuracy == 0.5);
  CHECK_FALSE(run.epochs[0].val_loss.has_value());
  CHECK(run.epochs[1].loss == 1.5);  // the later record of epoch 2
  CHECK(*run.epochs[1].samples_per_s == 400.0);
  CHECK_FALSE(run.epochs[1].accuracy.has_value());

  // The key names the splits' styles, and for several runs each run's colour.
  const std::string one = observe::gnuplot_script({run}, "x.png");
  CHECK(contains(one, "title 'train'"));
  CHECK(contains(one, "title 'test'"));
  CHECK_FALSE(contains(one, "title 'validation'"));  // no record has validation figures now
  CHECK_FALSE(contains(one, "title 'dtrain_test_ux_plot'"));  // the picture's title names the one run
  CHECK(contains(one, "set ylabel 'accuracy (%)'"));
  CHECK(contains(one, "1 2.5 25 NaN NaN 2.25 50 384\n"));
  observe::RunCurves other = run;
  other.label = "it's";
  const std::string two = observe::gnuplot_script({run, other}, "x.png");
  CHECK(contains(two, "title 'dtrain_test_ux_plot'"));
  CHECK(contains(two, "title 'it''s'"));  // gnuplot's quoting
  CHECK(contains(two, "title 'train'"));
  std::ofstream(dir / "metrics.jsonl") << "not json\n";
  CHECK_THROWS_AS(observe::read_run_curves(dir.string()), InputError);
  std::filesystem::remove_all(dir);
}

namespace {

// The InputError read_run_curves throws for `dir`, or "" when it reads.
std::string curves_error(const std::filesystem::path& dir) {
  try {
    observe::read_run_curves(dir.string());
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("plot: an empty, special or out-of-range metrics.jsonl is refused naming the file (and line)") {
  const auto dir = std::filesystem::temp_directory_path() / "dtrain_test_ux_plot_bad";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string log = (dir / "metrics.jsonl").string();
  // Empty, or blank lines only: nothing to draw (the key's layout divided by its zero columns).
  std::ofstream(log).close();
  CHECK(contains(curves_error(dir), log + ": holds no epoch record"));
  std::ofstream(log) << "\n\n";
  CHECK(contains(curves_error(dir), log + ": holds no epoch record"));
  // Epochs gnuplot cannot place, or an int cannot hold.
  for (const char* epoch : {"9223372036854775807", "-5", "0", "1.5", "2147483648", "nan"}) {
    CAPTURE(epoch);
    std::ofstream(log) << R"({"epoch": 1, "loss": 2.5})" << "\n" << R"({"epoch": )" << epoch << R"(, "loss": 2.0})" << "\n";
    CHECK(contains(curves_error(dir), log + ":2: epoch "));
  }
  std::ofstream(log) << R"({"epoch": 1, "loss": inf})" << "\n";
  CHECK(contains(curves_error(dir), log + ":1: loss inf is not a finite number"));
  // A figure that is not finite is left out, as dtrain's null is.
  std::ofstream(log) << R"({"epoch": 1, "loss": 2.5, "test_loss": nan, "accuracy": null})" << "\n";
  const observe::RunCurves run = observe::read_run_curves(dir.string());
  REQUIRE(run.epochs.size() == 1);
  CHECK_FALSE(run.epochs[0].test_loss.has_value());
  CHECK_FALSE(run.epochs[0].accuracy.has_value());
  // A directory or a FIFO where the log goes: refused before reading (a FIFO would block).
  std::filesystem::remove(log);
  std::filesystem::create_directory(log);
  CHECK(contains(curves_error(dir), log + ": is a directory"));
  std::filesystem::remove(log);
  REQUIRE(::mkfifo(log.c_str(), 0600) == 0);
  CHECK(contains(curves_error(dir), log + ": is not a regular file"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("plot: a script for runs without epochs has a key of one empty row, not a division by zero") {
  observe::RunCurves empty;
  empty.label = "empty";
  CHECK_FALSE(observe::gnuplot_script({empty}, "x.png").empty());
  CHECK_FALSE(observe::gnuplot_script({empty, empty}, "x.png").empty());
  // The largest epoch a record may hold: a point every 107374183 epochs, counted without overflow.
  observe::RunCurves last;
  last.epochs = {observe::EpochPoint{1, 2.0, {}, {}, {}, {}, {}, {}},
                 observe::EpochPoint{std::numeric_limits<int>::max(), 1.0, {}, {}, {}, {}, {}, {}}};
  CHECK(contains(observe::gnuplot_script({last}, "x.png"), "pi 107374183 "));
}

namespace {

// The numbers after `prefix` on each line of the script that starts with it.
std::vector<double> values_after(const std::string& script, const std::string& prefix) {
  std::vector<double> out;
  std::istringstream lines(script);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind(prefix, 0) == 0) out.push_back(std::stod(line.substr(prefix.size())));
  return out;
}

}  // namespace

TEST_CASE("plot: the key lies below the panels, outside every plotting area, for 1 to 8 runs") {
  observe::RunCurves run;
  run.label = "a_run_with_a_long_name";
  for (int epoch = 1; epoch <= 5; ++epoch) {
    observe::EpochPoint p;
    p.epoch = epoch;
    p.loss = 2.0 / epoch;
    p.accuracy = 0.1 + 0.02 * epoch;  // low accuracy: the curves run along the bottom
    p.val_loss = p.loss + 0.1;
    p.val_accuracy = *p.accuracy;
    p.test_loss = p.loss + 0.2;
    p.test_accuracy = *p.accuracy;
    p.samples_per_s = 1000.0;
    run.epochs.push_back(p);
  }
  int previous_height = 0;
  for (std::size_t n = 1; n <= 8; ++n) {
    CAPTURE(n);
    std::vector<observe::RunCurves> runs;
    for (std::size_t i = 0; i < n; ++i) {
      runs.push_back(run);
      runs.back().label += std::to_string(i);
    }
    const std::string script = observe::gnuplot_script(runs, "x.png");
    // Every curve is untitled: only the key's empty plots carry titles.
    std::istringstream lines(script);
    for (std::string line; std::getline(lines, line);)
      if (contains(line, " using ")) CHECK_MESSAGE(contains(line, "notitle"), line);
    // The panels' plotting areas end at the first bottom margin; every key's top is below it.
    const std::vector<double> bottoms = values_after(script, "set bmargin at screen ");
    const std::vector<double> keys = values_after(script, "set key at screen 0.5, ");
    REQUIRE_FALSE(bottoms.empty());
    REQUIRE(keys.size() == (n == 1 ? 1U : 2U));  // the splits' styles; the runs' colours
    for (double top : keys) CHECK(top < bottoms.front());
    CHECK(contains(script, "unset key\n"));  // before the first panel
    // More runs than fit one row of the key make the picture taller, not the panels smaller.
    const auto size = script.find("size ");
    const int height = std::stoi(script.substr(script.find(',', size) + 1));
    CHECK(height >= previous_height);
    previous_height = height;
  }
}
