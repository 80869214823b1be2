// The tune chart: one row per setting of the sweep, two bars each (peak reserved at the capacity,
// smallest device without OOM), the capacity as a line, OOM counts in red, the recommendation and
// the default marked. The x-axis is scaled to the data, not to the capacity, so that differences
// of a few percent are visible; a capacity far off the data is named instead of drawn.
#pragma once

#include <string>

#include "tune.h"

namespace gpustitch::replay {

struct TunePlotOptions {
  std::string title;
  int width = 1000;
  int height = 0;  // 0: from the number of settings
};

std::string tune_plot_svg(const TuneReport& report, const TunePlotOptions& options);

// Writes the chart to path (.svg, or .png through an SVG converter; see plot.h).
bool write_tune_plot(const TuneReport& report, const TunePlotOptions& options,
                     const std::string& path, std::string* why);

}  // namespace gpustitch::replay
