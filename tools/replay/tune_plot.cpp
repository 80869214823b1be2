// tune_plot_svg / write_tune_plot: see tune_plot.h.
#include "tune_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "plot.h"

namespace gpustitch::replay {

std::string tune_plot_svg(const TuneReport& rep, const TunePlotOptions& o) {
  const double gib = 1024.0 * 1024.0 * 1024.0;
  // The left margin holds the longest label (about 7 px a character at 12 px).
  std::size_t longest = 0;
  for (const auto& r : rep.rows) longest = std::max(longest, r.setting.label.size() + 16);
  const double row_h = 24, top = 76, bottom = 56, right = 90;
  const double left = std::max(200.0, 7.0 * static_cast<double>(longest));
  const double W = std::max<double>(o.width, left + right + 400);
  const double H =
      o.height ? o.height : top + bottom + row_h * static_cast<double>(rep.rows.size());
  const double pw = W - left - right, ph = H - top - bottom;
  const double rh = ph / std::max<double>(1, static_cast<double>(rep.rows.size()));
  double data_max = 0, data_min = 1e300;
  for (const auto& r : rep.rows) {
    for (double v :
         {static_cast<double>(r.at_capacity.peak_reserved), static_cast<double>(r.min_capacity)}) {
      if (v <= 0) continue;
      data_max = std::max(data_max, v);
      data_min = std::min(data_min, v);
    }
  }
  const double cap = static_cast<double>(rep.capacity);
  const bool cap_on_scale = cap <= data_max * 1.5;
  double xmax = std::max(cap_on_scale ? cap : 0.0, data_max) * 1.05 / gib;
  // Start the axis near the data when all bars are long: a 2% difference stays visible.
  double xmin =
      data_min < 1e300 ? std::max(0.0, data_min / gib - 0.25 * (xmax - data_min / gib)) : 0;
  if (xmin < 0.2 * xmax) xmin = 0;
  xmax = std::max(xmax, xmin + 1e-3);
  double step = plot_nice_step(xmax - xmin, 8);
  xmin = std::floor(xmin / step) * step;
  xmax = std::ceil(xmax / step) * step;
  auto X = [&](double bytes) {
    return left + std::clamp((bytes / gib - xmin) / (xmax - xmin), 0.0, 1.0) * pw;
  };
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(1);
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" viewBox=\"0 0 " << W << ' ' << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << W / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">"
    << plot_escape(o.title) << "</text>\n";
  // Legend.
  s << "<rect x=\"" << 20 << "\" y=\"32\" width=\"14\" height=\"9\" fill=\"#1f77b4\"/>"
    << "<text x=\"" << 38 << "\" y=\"41\">peak reserved at the capacity</text>\n";
  s << "<rect x=\"" << 240 << "\" y=\"32\" width=\"14\" height=\"9\" fill=\"#ff7f0e\"/>"
    << "<text x=\"" << 258 << "\" y=\"41\">smallest device without OOM</text>\n";
  s << "<text x=\"" << 450
    << "\" y=\"41\" fill=\"#d62728\">N OOM: out-of-memory at the "
       "capacity</text>\n";
  for (double v = xmin; v <= xmax + 1e-9; v += step) {
    const double x = left + (v - xmin) / (xmax - xmin) * pw;
    s << "<line x1=\"" << x << "\" y1=\"" << top << "\" x2=\"" << x << "\" y2=\"" << top + ph
      << "\" stroke=\"#e4e4e4\"/>\n";
    char t[32];
    std::snprintf(t, sizeof t, step < 0.1 ? "%.2f" : "%.1f", v);
    s << "<text x=\"" << x << "\" y=\"" << top + ph + 16 << "\" text-anchor=\"middle\">" << t
      << "</text>\n";
  }
  s << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 14 << "\" text-anchor=\"middle\">GiB"
    << (xmin > 0 ? " (axis starts at " : "");
  if (xmin > 0) {
    char t[32];
    std::snprintf(t, sizeof t, "%.2f", xmin);
    s << t << ")";
  }
  s << "</text>\n";
  for (std::size_t i = 0; i < rep.rows.size(); ++i) {
    const auto& r = rep.rows[i];
    const double y = top + static_cast<double>(i) * rh;
    const bool rec = i == rep.answer.recommended;
    if (i % 2)
      s << "<rect x=\"0\" y=\"" << y << "\" width=\"" << W << "\" height=\"" << rh
        << "\" fill=\"#f6f6f6\"/>\n";
    std::string label = r.setting.label;
    if (rec) label = "\u2605 " + label + " (recommended)";
    s << "<text x=\"" << left - 8 << "\" y=\"" << y + rh / 2 + 4 << "\" text-anchor=\"end\""
      << (rec ? " font-weight=\"bold\"" : "")
      << (r.setting.family == TuneFamily::gpustitch ? " fill=\"#2a7a2a\"" : "") << ">"
      << plot_escape(label) << "</text>\n";
    const double bh = std::max(3.0, rh / 2 - 2);
    s << "<rect x=\"" << left << "\" y=\"" << y + 2 << "\" width=\""
      << X(static_cast<double>(r.at_capacity.peak_reserved)) - left << "\" height=\"" << bh
      << "\" fill=\"#1f77b4\"/>\n";
    if (r.min_capacity) {
      s << "<rect x=\"" << left << "\" y=\"" << y + 2 + bh << "\" width=\""
        << X(static_cast<double>(r.min_capacity)) - left << "\" height=\"" << bh
        << "\" fill=\"#ff7f0e\"/>\n";
    } else {
      s << "<text x=\"" << left + 4 << "\" y=\"" << y + 2 + 2 * bh << "\" font-size=\"10\">"
        << "no device up to the largest tried fits</text>\n";
    }
    if (r.at_capacity.ooms > 0)
      s << "<text x=\"" << left + pw + 6 << "\" y=\"" << y + rh / 2 + 4 << "\" fill=\"#d62728\">"
        << r.at_capacity.ooms << " OOM</text>\n";
  }
  s << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"none\" stroke=\"#333\"/>\n";
  if (cap_on_scale) {
    const double x = X(cap);
    s << "<line x1=\"" << x << "\" y1=\"" << top - 4 << "\" x2=\"" << x << "\" y2=\"" << top + ph
      << "\" stroke=\"#d62728\" stroke-width=\"1.5\" stroke-dasharray=\"5,3\"/>\n";
    s << "<text x=\"" << x << "\" y=\"" << top - 8 << "\" text-anchor=\"middle\" fill=\"#d62728\">"
      << "capacity</text>\n";
  } else {
    char t[64];
    std::snprintf(t, sizeof t, "capacity %.1f GiB: off the scale", cap / gib);
    s << "<text x=\"" << left + pw << "\" y=\"" << top - 8 << "\" text-anchor=\"end\" fill=\""
      << "#d62728\">" << t << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

bool write_tune_plot(const TuneReport& report, const TunePlotOptions& options,
                     const std::string& path, std::string* why) {
  return write_svg_or_png(tune_plot_svg(report, options), path, why);
}

}  // namespace gpustitch::replay
