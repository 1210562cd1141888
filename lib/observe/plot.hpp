// Learning curves of one or more runs, read from their metrics.jsonl and drawn by gnuplot into a
// PNG: loss and accuracy per epoch (train, validation when the run has one, test) and the
// training throughput, the runs overlaid, one colour per run. One key below the panels, outside
// every plotting area so that it never hides a curve, names the splits' line styles and the runs'
// colours. `dtrain plot` and the `train.plot` callback both draw through here.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace dtrain::observe {

// One epoch of metrics.jsonl; what the epoch did not record is empty.
struct EpochPoint {
  int epoch = 0;
  double loss = 0.0;
  std::optional<double> accuracy, val_loss, val_accuracy, test_loss, test_accuracy, samples_per_s;
};

struct RunCurves {
  std::string label;  // the legend's name for the run
  std::vector<EpochPoint> epochs;  // by epoch; a resumed run's later record of an epoch wins
};

// Reads RUN_DIR/metrics.jsonl. InputError naming the directory when it has none or a line is not
// one of dtrain's epoch records.
RunCurves read_run_curves(const std::string& run_dir);

// The gnuplot script that draws `runs` into `png` (datablocks inline): exposed for tests.
std::string gnuplot_script(const std::vector<RunCurves>& runs, const std::string& png);

// Draws `runs` into `png`, replacing it only once gnuplot has written the whole picture.
// InputError when gnuplot is not installed (tools/setup installs it) or fails; IoError when the
// picture cannot be written.
void plot_curves(const std::vector<RunCurves>& runs, const std::string& png);

}  // namespace dtrain::observe
