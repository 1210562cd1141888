#include "train/plot.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <sstream>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::train {

namespace fs = std::filesystem;

namespace {

// The number after "key": in one of epoch_json's flat objects; the quote before the key keeps
// "loss" from matching "test_loss".
std::optional<double> field(const std::string& line, std::string_view key) {
  const std::string needle = fmt::format("\"{}\":", key);
  const auto at = line.find(needle);
  if (at == std::string::npos) return std::nullopt;
  const char* begin = line.c_str() + at + needle.size();
  char* end = nullptr;
  const double value = std::strtod(begin, &end);
  if (end == begin) return std::nullopt;
  return value;
}

std::string label_of(const std::string& run_dir) {
  fs::path p = fs::path(run_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().empty() ? run_dir : p.filename().string();
}

// gnuplot's single-quoted string: only the quote itself is special.
std::string quoted(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

std::string column(const std::optional<double>& value, double scale = 1.0) {
  return value ? fmt::format("{:.9g}", *value * scale) : std::string("NaN");
}

// One colour per run (the Tableau palette: distinct, and readable on white).
constexpr const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

struct Series {
  int column;        // in the run's datablock
  const char* split; // legend suffix
  const char* style; // dash type and point type of the split
};
// Train solid with dots, validation dotted with rings, test dashed with squares.
constexpr Series loss_series[] = {{2, "train", "dt 1 pt 7"}, {4, "validation", "dt 3 pt 6"}, {6, "test", "dt 2 pt 5"}};
constexpr Series accuracy_series[] = {{3, "train", "dt 1 pt 7"}, {5, "validation", "dt 3 pt 6"}, {7, "test", "dt 2 pt 5"}};

bool has_column(const RunCurves& run, int col) {
  return std::any_of(run.epochs.begin(), run.epochs.end(), [&](const EpochPoint& e) {
    switch (col) {
      case 3: return e.accuracy.has_value();
      case 4: return e.val_loss.has_value();
      case 5: return e.val_accuracy.has_value();
      case 6: return e.test_loss.has_value();
      case 7: return e.test_accuracy.has_value();
      case 8: return e.samples_per_s.has_value();
      default: return true;
    }
  });
}

// Room above (loss: it falls) or below (accuracy: it rises) the curves for a legend of `entries`
// lines, so that the legend never hides a point: the y range grows by that fraction.
std::string legend_room(std::size_t entries, bool at_top) {
  const double fraction = std::min(0.6, 0.045 + 0.055 * static_cast<double>(entries));
  const double grow = fraction / (1.0 - fraction);
  return at_top ? fmt::format("set offsets 0, 0, graph {:.3f}, 0\n", grow)
                : fmt::format("set offsets 0, 0, 0, graph {:.3f}\n", grow);
}

std::size_t entries(const std::vector<RunCurves>& runs, std::span<const Series> series) {
  std::size_t n = 0;
  for (const RunCurves& run : runs)
    for (const Series& s : series) n += has_column(run, s.column) ? 1 : 0;
  return n;
}

// "plot" with every series the runs have, or "" when none has any.
std::string plot_command(const std::vector<RunCurves>& runs, std::span<const Series> series, bool several) {
  std::vector<std::string> parts;
  for (std::size_t r = 0; r < runs.size(); ++r) {
    for (const Series& s : series) {
      if (!has_column(runs[r], s.column)) continue;
      const std::string title = several ? fmt::format("{} {}", runs[r].label, s.split) : s.split;
      parts.push_back(fmt::format("$run{} using 1:{} with linespoints lw 2 ps 0.7 lc rgb '{}' {} title {}", r, s.column,
                                  colours[r % std::size(colours)], s.style, quoted(title)));
    }
  }
  return parts.empty() ? std::string() : "plot " + fmt::format("{}", fmt::join(parts, ", \\\n     ")) + "\n";
}

}  // namespace

RunCurves read_run_curves(const std::string& run_dir) {
  const fs::path path = fs::path(run_dir) / "metrics.jsonl";
  std::ifstream in(path);
  if (!in)
    throw InputError(fmt::format("{}: no metrics.jsonl in this directory; give the run directory of a dtrain run "
                                 "(runs/<name>)",
                                 run_dir));
  std::map<int, EpochPoint> by_epoch;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    const auto epoch = field(line, "epoch");
    const auto loss = field(line, "loss");
    if (!epoch || !loss)
      throw InputError(fmt::format("{}:{}: not an epoch record of dtrain (no \"epoch\" and \"loss\")", path.string(),
                                   number));
    EpochPoint p;
    p.epoch = static_cast<int>(*epoch);
    p.loss = *loss;
    p.accuracy = field(line, "accuracy");
    p.val_loss = field(line, "val_loss");
    p.val_accuracy = field(line, "val_accuracy");
    p.test_loss = field(line, "test_loss");
    p.test_accuracy = field(line, "test_accuracy");
    p.samples_per_s = field(line, "train_samples_per_s");
    by_epoch[p.epoch] = p;  // a resumed run may log an epoch again: the later record is the run's
  }
  RunCurves run;
  run.label = label_of(run_dir);
  for (const auto& [epoch, point] : by_epoch) run.epochs.push_back(point);
  return run;
}

std::string gnuplot_script(const std::vector<RunCurves>& runs, const std::string& png) {
  const bool several = runs.size() > 1;
  int last_epoch = 1;
  for (const RunCurves& run : runs)
    for (const EpochPoint& e : run.epochs) last_epoch = std::max(last_epoch, e.epoch);
  const bool accuracy = std::any_of(runs.begin(), runs.end(), [](const RunCurves& r) { return has_column(r, 3); });
  const int panels = accuracy ? 3 : 2;

  std::ostringstream s;
  // noenhanced: run names are shown as written (enhanced text would make "_" a subscript).
  s << fmt::format("set terminal pngcairo noenhanced size {},420 font 'sans,10'\n", 460 * panels);
  s << "set output " << quoted(png) << "\n";
  for (std::size_t r = 0; r < runs.size(); ++r) {
    s << fmt::format("$run{} << EOD\n", r);
    for (const EpochPoint& e : runs[r].epochs)
      s << fmt::format("{} {:.9g} {} {} {} {} {} {}\n", e.epoch, e.loss, column(e.accuracy, 100.0), column(e.val_loss),
                       column(e.val_accuracy, 100.0), column(e.test_loss), column(e.test_accuracy, 100.0),
                       column(e.samples_per_s));
    s << "EOD\n";
  }
  std::vector<std::string> labels;
  for (const RunCurves& r : runs) labels.push_back(r.label);
  s << fmt::format("set multiplot layout 1,{} title {} font 'sans,12'\n", panels,
                   quoted(fmt::format("dtrain: {}", fmt::join(labels, " vs "))));
  s << "set grid lc rgb '#dddddd'\nset border lc rgb '#555555'\nset xlabel 'epoch'\n";
  s << "set key box opaque Left reverse samplen 3 spacing 1.1 width 1\n";
  // Whole epochs on the axis; a run of one epoch still gets a visible range.
  s << fmt::format("set xrange [{}:{}]\n", last_epoch > 1 ? 1.0 : 0.5, last_epoch > 1 ? last_epoch : 1.5);
  s << (last_epoch <= 20 ? "set xtics 1\n" : "set xtics format '%.0f'\n");
  s << "set title 'Loss (mean per example)'\nset ylabel 'loss'\nset key top right\n";
  s << legend_room(entries(runs, loss_series), true) << plot_command(runs, loss_series, several);
  if (accuracy) {
    s << "set title 'Accuracy'\nset ylabel 'accuracy (%)'\nset yrange [0<*:*<100]\nset key bottom right\n";
    s << legend_room(entries(runs, accuracy_series), false) << plot_command(runs, accuracy_series, several);
  }
  s << "set title 'Training throughput'\nset ylabel 'samples/s'\nset yrange [0:*]\nset offsets 0, 0, graph 0.1, 0\n";
  s << (several ? "set key bottom right\n" : "unset key\n");
  std::vector<std::string> throughput;
  for (std::size_t r = 0; r < runs.size(); ++r)
    if (has_column(runs[r], 8))
      throughput.push_back(fmt::format("$run{} using 1:8 with linespoints lw 2 ps 0.7 lc rgb '{}' dt 1 pt 7 title {}", r,
                                       colours[r % std::size(colours)], quoted(runs[r].label)));
  if (!throughput.empty()) s << "plot " << fmt::format("{}", fmt::join(throughput, ", \\\n     ")) << "\n";
  s << "unset multiplot\nset output\n";
  return s.str();
}

void plot_curves(const std::vector<RunCurves>& runs, const std::string& png) {
  // gnuplot draws into a temporary next to the picture, renamed over it once complete, so that a
  // viewer refreshing curves.png during training never shows half a picture.
  const std::string partial = png + ".partial";
  {
    std::ofstream probe(partial);
    if (!probe) throw IoError(fmt::format("cannot write {}: {}; check the directory", png, std::strerror(errno)));
  }
  char script_path[] = "/tmp/dtrain-plot-XXXXXX";
  const int script_fd = mkstemp(script_path);
  if (script_fd < 0) throw IoError(fmt::format("cannot create a temporary file in /tmp: {}", std::strerror(errno)));
  const std::string script = gnuplot_script(runs, partial);
  const bool written = ::write(script_fd, script.data(), script.size()) == static_cast<ssize_t>(script.size());
  ::close(script_fd);
  const std::string errors_path = std::string(script_path) + ".err";
  auto cleanup = [&] {
    std::error_code ignored;
    fs::remove(script_path, ignored);
    fs::remove(errors_path, ignored);
    fs::remove(partial, ignored);
  };
  if (!written) {
    cleanup();
    throw IoError(fmt::format("cannot write the temporary file {}", script_path));
  }

  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addopen(&files, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&files, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&files, 2, errors_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  // dtrain blocks SIGINT/SIGTERM in every thread (a watcher reads them); gnuplot gets them back.
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK);
  char program[] = "gnuplot";
  char* argv[] = {program, script_path, nullptr};
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, program, &files, &attributes, argv, environ);
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attributes);
  if (spawned != 0) {
    cleanup();
    if (spawned == ENOENT)
      throw InputError("gnuplot is not installed; run tools/setup (it installs Debian's gnuplot-nox)");
    throw IoError(fmt::format("cannot start gnuplot: {}", std::strerror(spawned)));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  std::string errors;
  {
    std::ifstream err(errors_path);
    std::getline(err, errors, '\0');
  }
  std::error_code size_error;
  const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 && fs::file_size(partial, size_error) > 0 && !size_error;
  if (!ok) {
    cleanup();
    while (!errors.empty() && (errors.back() == '\n' || errors.back() == ' ')) errors.pop_back();
    std::replace(errors.begin(), errors.end(), '\n', ' ');  // an error is one line
    throw IoError(fmt::format("gnuplot could not draw {}: {}", png, errors.empty() ? "no message" : errors));
  }
  std::error_code renamed;
  fs::rename(partial, png, renamed);
  if (renamed) {
    cleanup();
    throw IoError(fmt::format("cannot write {}: {}", png, renamed.message()));
  }
  std::error_code ignored;
  fs::remove(script_path, ignored);
  fs::remove(errors_path, ignored);
}

}  // namespace dtrain::train
