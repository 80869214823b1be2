// plot_svg / write_plot: see plot.h.
#include "plot.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

extern char** environ;

namespace gpustitch::replay {

namespace {

const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                         "#9467bd", "#8c564b", "#e377c2", "#17becf"};

std::string escape(const std::string& s) {
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

double nice_step(double range, int ticks) {
  double raw = range / ticks;
  double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

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

}  // namespace

std::string plot_svg(const std::vector<ReplayResult>& results, const std::string& title,
                     double capacity_bytes) {
  const double W = 1000, H = 540, left = 80, right = 270, top = 50, bottom = 60;
  const double pw = W - left - right, ph = H - top - bottom;
  double max_x = 1, max_y = capacity_bytes;
  for (const auto& r : results) {
    max_x = std::max(max_x, static_cast<double>(r.ops));
    for (const auto& p : r.series)
      max_y = std::max({max_y, static_cast<double>(p.reserved), static_cast<double>(p.allocated)});
  }
  const double gib = 1024.0 * 1024.0 * 1024.0;
  double ymax_gib = std::max(max_y / gib * 1.05, 0.001);
  double ystep = nice_step(ymax_gib, 6);
  ymax_gib = std::ceil(ymax_gib / ystep) * ystep;
  auto X = [&](double op) { return left + op / max_x * pw; };
  auto Y = [&](double bytes) { return top + ph - bytes / gib / ymax_gib * ph; };

  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(1);
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" viewBox=\"0 0 " << W << ' ' << H << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  s << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"16\">"
    << escape(title) << "</text>\n";
  // Grid and axes.
  for (double v = 0; v <= ymax_gib + 1e-9; v += ystep) {
    double y = Y(v * gib);
    s << "<line x1=\"" << left << "\" y1=\"" << y << "\" x2=\"" << left + pw << "\" y2=\"" << y
      << "\" stroke=\"#ddd\"/>\n";
    s << "<text x=\"" << left - 8 << "\" y=\"" << y + 4 << "\" text-anchor=\"end\">" << v
      << "</text>\n";
  }
  double xstep = nice_step(max_x, 8);
  for (double v = 0; v <= max_x + 1e-9; v += xstep) {
    s << "<text x=\"" << X(v) << "\" y=\"" << top + ph + 18 << "\" text-anchor=\"middle\">"
      << static_cast<long long>(v) << "</text>\n";
  }
  s << "<rect x=\"" << left << "\" y=\"" << top << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"none\" stroke=\"#333\"/>\n";
  s << "<text x=\"" << left + pw / 2 << "\" y=\"" << H - 18
    << "\" text-anchor=\"middle\">trace event</text>\n";
  s << "<text transform=\"translate(22," << top + ph / 2
    << ") rotate(-90)\" text-anchor=\"middle\">GiB</text>\n";
  if (capacity_bytes > 0) {
    double y = Y(capacity_bytes);
    s << "<line x1=\"" << left << "\" y1=\"" << y << "\" x2=\"" << left + pw << "\" y2=\"" << y
      << "\" stroke=\"#000\" stroke-dasharray=\"2,3\"/>\n";
    s << "<text x=\"" << left + 4 << "\" y=\"" << y - 4 << "\">capacity</text>\n";
  }
  // Lines.
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    const char* color = kColors[i % (sizeof kColors / sizeof *kColors)];
    auto polyline = [&](bool reserved, const char* extra) {
      s << "<polyline fill=\"none\" stroke=\"" << color << "\" " << extra << " points=\"";
      for (const auto& p : r.series)
        s << X(static_cast<double>(p.op)) << ','
          << Y(static_cast<double>(reserved ? p.reserved : p.allocated)) << ' ';
      s << "\"/>\n";
    };
    polyline(true, "stroke-width=\"1.6\"");
    polyline(false, "stroke-width=\"1\" stroke-dasharray=\"4,3\" opacity=\"0.7\"");
    if (r.first_oom_op >= 0) {
      double x = X(static_cast<double>(r.first_oom_op));
      s << "<line x1=\"" << x << "\" y1=\"" << top << "\" x2=\"" << x << "\" y2=\"" << top + ph
        << "\" stroke=\"" << color << "\" stroke-width=\"0.8\" stroke-dasharray=\"1,2\"/>\n";
    }
    // Legend.
    double ly = top + 10 + static_cast<double>(i) * 52;
    double lx = left + pw + 14;
    s << "<line x1=\"" << lx << "\" y1=\"" << ly << "\" x2=\"" << lx + 24 << "\" y2=\"" << ly
      << "\" stroke=\"" << color << "\" stroke-width=\"2\"/>\n";
    s << "<text x=\"" << lx + 30 << "\" y=\"" << ly + 4 << "\">" << escape(r.policy)
      << " reserved</text>\n";
    s << "<line x1=\"" << lx << "\" y1=\"" << ly + 16 << "\" x2=\"" << lx + 24 << "\" y2=\""
      << ly + 16 << "\" stroke=\"" << color << "\" stroke-dasharray=\"4,3\"/>\n";
    s << "<text x=\"" << lx + 30 << "\" y=\"" << ly + 20 << "\">allocated</text>\n";
    char info[160];
    std::snprintf(info, sizeof info, "peak %.2f GiB, frag %.0f%%, %llu OOM",
                  static_cast<double>(r.peak_reserved) / gib, r.frag_at_peak * 100,
                  static_cast<unsigned long long>(r.ooms));
    s << "<text x=\"" << lx + 30 << "\" y=\"" << ly + 36 << "\" font-size=\"10\">" << info
      << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

bool write_plot(const std::vector<ReplayResult>& results, const std::string& title,
                double capacity_bytes, const std::string& path, std::string* why) {
  std::string svg = plot_svg(results, title, capacity_bytes);
  bool png = ends_with(path, ".png");
  std::string svg_path = png ? path + ".svg" : path;
  {
    std::ofstream out(svg_path);
    out << svg;
    if (!out) {
      if (why) *why = "cannot write " + svg_path;
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

}  // namespace gpustitch::replay
