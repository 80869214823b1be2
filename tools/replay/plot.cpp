// plot_svg / write_plot and the helpers the charts share: see plot.h.
#include "plot.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

extern char** environ;

namespace gpustitch::replay {

namespace {

const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                         "#9467bd", "#8c564b", "#e377c2", "#17becf"};
// Lines that coincide stay told apart by their dashes.
const char* kDashes[] = {"", "8,4", "2,3", "10,3,2,3", "5,5", "1,4", "12,6", "4,2,1,2"};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool run(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid;
  if (posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return false;
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  std::stringstream ss(path);
  std::string dir;
  while (std::getline(ss, dir, ':'))
    if (!dir.empty() && ::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
  return false;
}

std::string gib_text(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

}  // namespace

std::string plot_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

double plot_nice_step(double range, int ticks) {
  double raw = range / ticks;
  if (!(raw > 0)) return 1;
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

bool plot_path_supported(const std::string& path, std::string* why) {
  if (ends_with(path, ".svg")) return true;
  if (ends_with(path, ".png")) {
    if (on_path("rsvg-convert") || on_path("convert")) return true;
    *why = "cannot write " + path +
           ": PNG needs rsvg-convert (librsvg2-bin) or ImageMagick's convert; use .svg";
    return false;
  }
  *why = "cannot write " + path + ": charts are written as .svg or .png";
  return false;
}

bool write_svg_or_png(const std::string& svg, const std::string& path, std::string* why) {
  bool png = ends_with(path, ".png");
  std::string svg_path = png ? path + ".svg" : path;
  {
    std::ofstream out(svg_path);
    out << svg;
    // close() writes what is still buffered (a whole small chart): its failure (disk full, file
    // size limit) is the write's failure, and the command must not report success.
    out.close();
    if (!out) {
      if (why) *why = "cannot write " + svg_path + ": " + std::strerror(errno);
      return false;
    }
  }
  if (!png) return true;
  bool ok = run({"rsvg-convert", "-o", path, svg_path}) || run({"convert", svg_path, path});
  if (ok) {
    ::unlink(svg_path.c_str());
    return true;
  }
  if (why)
    *why = "no SVG converter (install librsvg2-bin for rsvg-convert); the plot is in " + svg_path;
  return false;
}

std::string plot_svg(const std::vector<ReplayResult>& results, const PlotOptions& o) {
  const double W = o.width, H = o.height, left = 70, right = 300, top = 50, bottom = 56;
  const double pw = W - left - right, ph = H - top - bottom;
  auto xval = [&](const ReplayPoint& p) {
    return o.time_axis ? p.time_s : static_cast<double>(p.op);
  };
  double max_x = 0, data_max = 0;
  for (const auto& r : results) {
    for (const auto& p : r.series) {
      max_x = std::max(max_x, xval(p));
      data_max =
          std::max({data_max, static_cast<double>(p.reserved), static_cast<double>(p.allocated)});
    }
    if (!o.time_axis) max_x = std::max(max_x, static_cast<double>(r.ops));
  }
  if (max_x <= 0) max_x = 1;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  // The capacity is drawn only when it is within the data's range (or close above it).
  const bool cap_on_scale = o.capacity_bytes > 0 && o.capacity_bytes <= data_max * 1.25;
  double ymax_gib = std::max(
      (cap_on_scale ? std::max(data_max, o.capacity_bytes) : data_max) / gib * 1.08, 0.001);
  double ystep = plot_nice_step(ymax_gib, 6);
  ymax_gib = std::ceil(ymax_gib / ystep) * ystep;
  double xstep = plot_nice_step(max_x, 8);
  max_x = std::ceil(max_x / xstep) * xstep;
  auto X = [&](double x) { return left + x / max_x * pw; };
  auto Y = [&](double bytes) { return top + ph - bytes / gib / ymax_gib * ph; };

  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(1);
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" viewBox=\"0 0 " << W << ' ' << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">"
    << plot_escape(o.title) << "</text>\n";
  for (double v = 0; v <= ymax_gib + 1e-9; v += ystep) {
    double y = Y(v * gib);
    s << "<line x1=\"" << left << "\" y1=\"" << y << "\" x2=\"" << left + pw << "\" y2=\"" << y
      << "\" stroke=\"#e4e4e4\"/>\n";
    char t[32];
    std::snprintf(t, sizeof t, ystep < 0.1 ? "%.2f" : "%.1f", v);
    s << "<text x=\"" << left - 8 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">" << t
      << "</text>\n";
  }
  for (double v = 0; v <= max_x + 1e-9; v += xstep) {
    char t[32];
    std::snprintf(t, sizeof t, o.time_axis && xstep < 1 ? "%.1f" : "%.0f", v);
    s << "<text x=\"" << X(v) << "\" y=\"" << top + ph + 18 << "\" text-anchor=\"middle\">" << t
      << "</text>\n";
  }
  s << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 16 << "\" text-anchor=\"middle\">"
    << (o.time_axis ? "time since the trace's first event (s)" : "trace event") << "</text>\n";
  s << "<text transform=\"translate(20," << top + ph / 2
    << ") rotate(-90)\" text-anchor=\"middle\">GiB</text>\n";
  // The demand, once: the same for every policy.
  if (!results.empty() && !results.front().series.empty()) {
    const auto& series = results.front().series;
    s << "<polygon fill=\"#cfcfcf\" fill-opacity=\"0.7\" stroke=\"none\" points=\"" << X(0) << ','
      << Y(0) << ' ';
    for (const auto& p : series)
      s << X(xval(p)) << ',' << Y(static_cast<double>(p.allocated)) << ' ';
    s << X(xval(series.back())) << ',' << Y(0) << "\"/>\n";
  }
  if (cap_on_scale) {
    double y = Y(o.capacity_bytes);
    s << "<line x1=\"" << left << "\" y1=\"" << y << "\" x2=\"" << left + pw << "\" y2=\"" << y
      << "\" stroke=\"#000\" stroke-width=\"1.2\" stroke-dasharray=\"6,3\"/>\n";
    s << "<text x=\"" << left + 4 << "\" y=\"" << y - 4 << "\">capacity "
      << gib_text(o.capacity_bytes) << "</text>\n";
  } else if (o.capacity_bytes > 0) {
    s << "<text x=\"" << left + pw - 4 << "\" y=\"" << top + 14 << "\" text-anchor=\"end\">"
      << "capacity " << gib_text(o.capacity_bytes) << " (off the scale)</text>\n";
  }
  s << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"none\" stroke=\"#333\"/>\n";
  const double lx = left + pw + 16;
  // Legend: the demand first.
  s << "<rect x=\"" << lx << "\" y=\"" << top << "\" width=\"24\" height=\"10\" fill=\"#cfcfcf\"/>"
    << "<text x=\"" << lx + 30 << "\" y=\"" << top + 9
    << "\">allocated (the trace's demand)</text>\n";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const char* color = kColors[i % (sizeof kColors / sizeof *kColors)];
    const char* dash = kDashes[i % (sizeof kDashes / sizeof *kDashes)];
    std::string dash_attr = *dash ? std::string(" stroke-dasharray=\"") + dash + "\"" : "";
    s << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\"" << dash_attr
      << " points=\"";
    for (const auto& p : r.series)
      s << X(xval(p)) << ',' << Y(static_cast<double>(p.reserved)) << ' ';
    s << "\"/>\n";
    // OOMs: a cross where each happened, the first one labelled.
    for (std::size_t k = 0; k < r.oom_events.size(); ++k) {
      const auto& e = r.oom_events[k];
      const double x = o.time_axis ? X(e.time_s) : X(static_cast<double>(e.op));
      const double y = top + ph - 8 - static_cast<double>(i) * 12;
      s << "<path d=\"M" << x - 4 << ',' << y - 4 << " l8,8 m0,-8 l-8,8\" stroke=\"" << color
        << "\" stroke-width=\"2\"/>\n";
      // Labelled on the side with room: marks near the right edge get theirs on the left.
      const bool flip = x > left + 0.7 * pw;
      if (k == 0)
        s << "<text x=\"" << (flip ? x - 6 : x + 6) << "\" y=\"" << y + 4 << "\" fill=\"" << color
          << "\" font-size=\"11\"" << (flip ? " text-anchor=\"end\"" : "") << ">OOM ("
          << plot_escape(r.policy) << ")</text>\n";
    }
    const double ly = top + 30 + static_cast<double>(i) * 40;
    s << "<line x1=\"" << lx << "\" y1=\"" << ly << "\" x2=\"" << lx + 24 << "\" y2=\"" << ly
      << "\" stroke=\"" << color << "\" stroke-width=\"2\"" << dash_attr << "/>\n";
    s << "<text x=\"" << lx + 30 << "\" y=\"" << ly + 4 << "\">" << plot_escape(r.policy)
      << " reserved</text>\n";
    char info[160];
    std::snprintf(info, sizeof info, "peak %.2f GiB, idle cache %.0f%%, %llu OOM%s",
                  static_cast<double>(r.peak_reserved) / gib, r.frag_at_peak * 100,
                  static_cast<unsigned long long>(r.ooms), r.ooms == 1 ? "" : "s");
    s << "<text x=\"" << lx + 30 << "\" y=\"" << ly + 18 << "\" font-size=\"10\""
      << (r.ooms ? " fill=\"#d62728\"" : "") << ">" << info << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

bool write_plot(const std::vector<ReplayResult>& results, const PlotOptions& options,
                const std::string& path, std::string* why) {
  return write_svg_or_png(plot_svg(results, options), path, why);
}

}  // namespace gpustitch::replay
