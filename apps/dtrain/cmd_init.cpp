// dtrain init: writes a commented experiment to start from (config/experiment_template.hpp).
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "commands.hpp"
#include "config/experiment_template.hpp"
#include "core/error.hpp"

namespace dtrain::app {

namespace fs = std::filesystem;

int init_command(const InitArgs& args) {
  config::TemplateOptions options;
  options.strategy = args.strategy;
  options.model = args.model;
  // The file's name names the experiment (and so its run directory) when it is a plain word.
  const std::string stem = fs::path(args.output).stem().string();
  if (!stem.empty() && std::all_of(stem.begin(), stem.end(), [](unsigned char c) {
        return std::isalnum(c) != 0 || c == '_' || c == '-' || c == '.';
      }))
    options.name = stem;
  const std::string text = config::experiment_template(options);
  if (args.output.empty()) {
    fmt::print("{}", text);
    return kOk;
  }
  if (fs::exists(args.output) && !args.force)
    throw ConfigError(fmt::format("{} exists; dtrain init does not overwrite it: choose another -o FILE, or add --force "
                                  "to replace it",
                                  args.output));
  std::ofstream out(args.output, std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw IoError(fmt::format("cannot write {}; check that its directory exists and is writable", args.output));
  fmt::print("wrote {}: edit the TODOs, then `dtrain validate {}` checks it and `{}dtrain run {}` trains it\n",
             args.output, args.output, config::launcher_for(args.strategy), args.output);
  return kOk;
}

}  // namespace dtrain::app
