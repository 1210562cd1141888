// dtrain plot: the learning curves of one or more runs in one PNG (observe/plot.hpp).
#include <set>

#include <fmt/format.h>

#include "commands.hpp"
#include "observe/plot.hpp"

namespace dtrain::app {

int plot_command(const PlotArgs& args) {
  std::vector<observe::RunCurves> runs;
  for (const std::string& dir : args.run_dirs) runs.push_back(observe::read_run_curves(dir));
  // Runs from different places with the same last path component: the legend shows the paths.
  std::set<std::string> labels;
  for (const auto& run : runs) labels.insert(run.label);
  if (labels.size() < runs.size())
    for (std::size_t i = 0; i < runs.size(); ++i) runs[i].label = args.run_dirs[i];
  const std::string png = !args.output.empty() ? args.output
                          : args.run_dirs.size() == 1 ? args.run_dirs.front() + "/curves.png"
                                                      : std::string("curves.png");
  // The picture is a PNG whatever the name says; a viewer goes by the name.
  if (!png.ends_with(".png"))
    fmt::print(stderr, "dtrain: warning: -o {}: dtrain plot writes a PNG image; name it .png so that viewers read it as one\n",
               png);
  observe::plot_curves(runs, png);
  fmt::print("wrote {}\n", png);
  return kOk;
}

}  // namespace dtrain::app
