// Allocated vs reserved over the replay, one reserved line per policy (and the trace's allocated
// bytes, the same demand for all of them, as a dashed line), as a hand-written SVG. PNG output
// converts the SVG with rsvg-convert or ImageMagick's convert when one is installed.
#pragma once

#include <string>
#include <vector>

#include "replayer.h"

namespace gpustitch::replay {

std::string plot_svg(const std::vector<ReplayResult>& results, const std::string& title,
                     double capacity_bytes);

// Writes FILE.svg, or FILE.png through an SVG converter. Returns false and sets *why on failure.
bool write_plot(const std::vector<ReplayResult>& results, const std::string& title,
                double capacity_bytes, const std::string& path, std::string* why);

}  // namespace gpustitch::replay
