// Allocated vs reserved over the replay, one reserved line per policy (each with its own colour
// and dash pattern, named in the legend with its peak, idle cache and OOMs) over the trace's
// allocated bytes (the same demand for every policy, drawn once as a grey area), as a
// hand-written SVG. OOMs are marked where they happen, in the policy's colour, and labelled. The
// y-axis is scaled to the data; the capacity is drawn when it is near the data and named
// otherwise. The x-axis is the trace's time where it has one, its event index where not.
// PNG output converts the SVG with rsvg-convert or ImageMagick's convert; any other extension is
// refused before any work is done (plot_path_supported).
#pragma once

#include <string>
#include <vector>

#include "replayer.h"

namespace gpustitch::replay {

struct PlotOptions {
  std::string title;
  double capacity_bytes = 0;
  bool time_axis = false;  // x is ReplayPoint::time_s, else ReplayPoint::op
  int width = 1000, height = 540;
};

std::string plot_svg(const std::vector<ReplayResult>& results, const PlotOptions& options);

// Writes the replay chart to path (.svg or .png). Returns false and sets *why on failure.
bool write_plot(const std::vector<ReplayResult>& results, const PlotOptions& options,
                const std::string& path, std::string* why);

// Shared by the charts (this one and tune_plot.h).
// Whether path has an extension a chart can be written as (.svg; .png when a converter is
// installed); *why says what is wrong otherwise.
bool plot_path_supported(const std::string& path, std::string* why);
bool write_svg_or_png(const std::string& svg, const std::string& path, std::string* why);
std::string plot_escape(const std::string& s);
// A round tick step (1, 2, 2.5 or 5 x 10^k) giving about `ticks` ticks over range.
double plot_nice_step(double range, int ticks);

}  // namespace gpustitch::replay
