#include "observe/plot.hpp"

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
#include <limits>
#include <map>
#include <span>
#include <sstream>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dtrain::observe {

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

// A figure dtrain wrote as null (not finite) is absent; so is a NaN or infinity written as text.
std::optional<double> finite(std::optional<double> value) {
  return value && std::isfinite(*value) ? value : std::nullopt;
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
const char* colour_of(std::size_t run) { return colours[run % std::size(colours)]; }

struct Series {
  int column;        // in the run's datablock
  const char* split; // the key's name of the split
  const char* style; // dash type and point type of the split
};
// Train solid with dots, validation dotted with rings, test dashed with squares.
constexpr Series loss_series[] = {{2, "train", "dt 1 pt 7"}, {4, "validation", "dt 3 pt 6"}, {6, "test", "dt 2 pt 5"}};
constexpr Series accuracy_series[] = {{3, "train", "dt 1 pt 7"}, {5, "validation", "dt 3 pt 6"}, {7, "test", "dt 2 pt 5"}};
constexpr int throughput_column = 8;

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

bool any_has_column(const std::vector<RunCurves>& runs, int col) {
  return std::any_of(runs.begin(), runs.end(), [&](const RunCurves& r) { return has_column(r, col); });
}

// The curves of one panel: every series of `series` the runs have, in the run's colour and the
// split's style, untitled (the one key below the panels names them). "" when none has any.
std::string panel_plot(const std::vector<RunCurves>& runs, std::span<const Series> series, const std::string& points) {
  std::vector<std::string> parts;
  for (std::size_t r = 0; r < runs.size(); ++r)
    for (const Series& s : series)
      if (has_column(runs[r], s.column))
        parts.push_back(fmt::format("$run{} using 1:{} with linespoints lw 2 {} lc rgb '{}' {} notitle", r, s.column,
                                    points, colour_of(r), s.style));
  return parts.empty() ? std::string() : fmt::format("plot {}\n", fmt::join(parts, ", \\\n     "));
}

// The picture, in pixels. The key sits in a strip below the panels, outside every plotting area,
// so that it never covers a curve whatever the curves do; its rows are counted here because the
// strip's height has to be known before gnuplot lays the key out.
constexpr int panel_width = 460;
constexpr int title_height = 62;     // the picture's title and the panel's title above the plot area
constexpr int plot_height = 290;
constexpr int axis_height = 62;      // the tic labels and "epoch" below the plot area, and a gap
constexpr int key_row_height = 20;
constexpr int key_padding = 14;      // a key's box around its rows, and the gap to the next
constexpr double char_width = 7.5;   // sans 10 in pixels, generously: too wide only adds rows

// A strip below the panels with one horizontal key: its entries ("NaN with ... title '...'": an
// empty plot that only draws its sample in the key), `columns` per row.
struct KeyStrip {
  std::vector<std::string> entries;
  int columns = 1;
  // A strip of no entries (runs with no epochs) still has one column: it takes one empty row.
  int rows() const {
    const int per_row = std::max(1, columns);
    return (static_cast<int>(entries.size()) + per_row - 1) / per_row;
  }
  int height() const { return rows() * key_row_height + key_padding; }
};

// As many entries per row as fit the picture's width, the widest title deciding (gnuplot makes
// every column of a key as wide as its widest title).
int columns_for(const std::vector<std::string>& titles, int width) {
  std::size_t longest = 1;
  for (const std::string& t : titles) longest = std::max(longest, t.size());
  const double column = char_width * static_cast<double>(longest + 2) + 60.0;  // + the line sample and gaps
  const int fit = std::max(1, static_cast<int>((width - 40) / column));
  return std::min(fit, static_cast<int>(titles.size()));
}

std::string screen(double pixels, int total) { return fmt::format("{:.4f}", pixels / total); }

}  // namespace

RunCurves read_run_curves(const std::string& run_dir) {
  const fs::path path = fs::path(run_dir) / "metrics.jsonl";
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (!fs::exists(status))
    throw InputError(fmt::format("{}: no metrics.jsonl in this directory; give the run directory of a dtrain run "
                                 "(runs/<name>)",
                                 run_dir));
  // A directory reads as nothing and a FIFO would block the read until something writes to it.
  if (!fs::is_regular_file(status))
    throw InputError(fmt::format("{}: is {}, not the metrics log a run writes; give the run directory of a dtrain run",
                                 path.string(), fs::is_directory(status) ? "a directory" : "not a regular file"));
  std::ifstream in(path);
  if (!in) throw InputError(fmt::format("{}: cannot be read ({}); check its permissions", path.string(), std::strerror(errno)));
  std::map<int, EpochPoint> by_epoch;
  std::string line;
  int number = 1;
  for (; std::getline(in, line); ++number) {
    if (line.empty()) continue;
    const auto epoch = field(line, "epoch");
    const auto loss = field(line, "loss");
    if (!epoch || !loss)
      throw InputError(fmt::format("{}:{}: not an epoch record of dtrain (no \"epoch\" and \"loss\")", path.string(),
                                   number));
    // Epochs count from 1 in an int (train.epochs); anything else would be cast out of range and
    // stretch the axis past what gnuplot can draw.
    if (!(*epoch >= 1 && *epoch <= std::numeric_limits<int>::max() && std::floor(*epoch) == *epoch))
      throw InputError(fmt::format("{}:{}: epoch {} is not an epoch number of dtrain (a whole number from 1 to {}); "
                                   "remove or correct the line",
                                   path.string(), number, *epoch, std::numeric_limits<int>::max()));
    // dtrain writes a loss that is not finite as null, which is not a record it plots.
    if (!std::isfinite(*loss))
      throw InputError(fmt::format("{}:{}: loss {} is not a finite number; remove or correct the line", path.string(),
                                   number, *loss));
    EpochPoint p;
    p.epoch = static_cast<int>(*epoch);
    p.loss = *loss;
    p.accuracy = finite(field(line, "accuracy"));
    p.val_loss = finite(field(line, "val_loss"));
    p.val_accuracy = finite(field(line, "val_accuracy"));
    p.test_loss = finite(field(line, "test_loss"));
    p.test_accuracy = finite(field(line, "test_accuracy"));
    p.samples_per_s = finite(field(line, "train_samples_per_s"));
    by_epoch[p.epoch] = p;  // a resumed run may log an epoch again: the later record is the run's
  }
  if (in.bad())
    throw InputError(fmt::format("{}: reading it failed ({}); check the file", path.string(), std::strerror(errno)));
  if (by_epoch.empty())
    throw InputError(fmt::format("{}: holds no epoch record (the run has not finished an epoch yet); plot it once it "
                                 "has",
                                 path.string()));
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
  const bool accuracy = any_has_column(runs, 3);
  const int panels = accuracy ? 3 : 2;
  const int width = panel_width * panels;

  // The key: the splits' line styles (in the run's colour for one run, neutral for several), then
  // for several runs one colour swatch per run.
  std::vector<KeyStrip> keys;
  {
    KeyStrip splits;
    const char* colour = several ? "#444444" : colour_of(0);
    for (std::size_t i = 0; i < std::size(loss_series); ++i) {
      const Series& l = loss_series[i];
      if (!any_has_column(runs, l.column) && !any_has_column(runs, accuracy_series[i].column)) continue;
      splits.entries.push_back(fmt::format("NaN with linespoints lw 2 ps 0.8 lc rgb '{}' {} title {}", colour, l.style,
                                           quoted(l.split)));
    }
    splits.columns = static_cast<int>(splits.entries.size());  // at most three: one row
    keys.push_back(std::move(splits));
  }
  if (several) {
    KeyStrip named;
    std::vector<std::string> titles;
    for (std::size_t r = 0; r < runs.size(); ++r) {
      named.entries.push_back(
          fmt::format("NaN with lines lw 6 lc rgb '{}' title {}", colour_of(r), quoted(runs[r].label)));
      titles.push_back(runs[r].label);
    }
    named.columns = columns_for(titles, width);
    keys.push_back(std::move(named));
  }
  int keys_height = 0;
  for (const KeyStrip& k : keys) keys_height += k.height();
  const int height = title_height + plot_height + axis_height + keys_height + 6;

  std::ostringstream s;
  // noenhanced: run names are shown as written (enhanced text would make "_" a subscript).
  s << fmt::format("set terminal pngcairo noenhanced size {},{} font 'sans,10'\n", width, height);
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
  const std::string all = fmt::format("dtrain: {}", fmt::join(labels, " vs "));
  // Past 100 characters the title would run off the picture; the key names the runs.
  const std::string title = all.size() <= 100 ? all : fmt::format("dtrain: {} runs", runs.size());
  s << fmt::format("set multiplot title {} font 'sans,12'\n", quoted(title));
  s << "set grid lc rgb '#dddddd'\nset border lc rgb '#555555'\nset xlabel 'epoch'\nunset key\n";
  // A little room above and below the curves: a point on the border is half hidden by it.
  s << "set offsets 0, 0, graph 0.05, graph 0.05\n";
  // Whole epochs on the axis; a run of one epoch still gets a visible range. Past 20 epochs a
  // point on every epoch would blur the line: every n-th then.
  s << fmt::format("set xrange [{}:{}]\n", last_epoch > 1 ? 1.0 : 0.5, last_epoch > 1 ? last_epoch : 1.5);
  s << (last_epoch <= 20 ? "set xtics 1\n" : "set xtics format '%.0f'\n");
  const int every = last_epoch / 20 + (last_epoch % 20 != 0);  // rounded up, without overflow at INT_MAX
  const std::string points = every > 1 ? fmt::format("ps 0.7 pi {}", every) : std::string("ps 0.7");
  // Every panel's plotting area at fixed screen positions, so that the panels line up and the
  // strip below them stays free for the key.
  s << fmt::format("set tmargin at screen {}\nset bmargin at screen {}\n", screen(height - title_height, height),
                   screen(height - title_height - plot_height, height));
  int panel = 0;
  auto place = [&] {
    s << fmt::format("set lmargin at screen {}\nset rmargin at screen {}\n", screen(panel * panel_width + 80, width),
                     screen((panel + 1) * panel_width - 25, width));
    ++panel;
  };
  place();
  s << "set title 'Loss (mean per example)'\nset ylabel 'loss'\n" << panel_plot(runs, loss_series, points);
  if (accuracy) {
    place();
    s << "set title 'Accuracy'\nset ylabel 'accuracy (%)'\nset yrange [0<*:*<100]\n"
      << panel_plot(runs, accuracy_series, points);
  }
  place();
  // Room above the highest point: a flat line at the top border would be hard to see.
  s << "set title 'Training throughput'\nset ylabel 'samples/s'\nset yrange [0:*]\nset offsets 0, 0, graph 0.1, 0\n";
  constexpr Series throughput[] = {{throughput_column, "train", "dt 1 pt 7"}};
  s << panel_plot(runs, throughput, points);

  // The key strips: empty plots whose only content is their key, centred under the panels.
  s << "unset title\nunset xlabel\nunset ylabel\nunset grid\nunset border\nunset tics\nset offsets 0, 0, 0, 0\n"
       "set xrange [0:1]\nset yrange [0:1]\nset lmargin at screen 0\nset rmargin at screen 1\n";
  int top = height - title_height - plot_height - axis_height;
  for (const KeyStrip& k : keys) {
    s << fmt::format("set tmargin at screen {}\nset bmargin at screen {}\n", screen(top, height),
                     screen(top - k.height() + key_padding / 2, height));
    s << fmt::format("set key at screen 0.5, {} center top horizontal maxcols {} Left reverse samplen 4 width 1 "
                     "spacing 1.25 box lc rgb '#cccccc'\n",
                     screen(top, height), k.columns);
    s << fmt::format("plot {}\n", fmt::join(k.entries, ", \\\n     "));
    top -= k.height();
  }
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

}  // namespace dtrain::observe
