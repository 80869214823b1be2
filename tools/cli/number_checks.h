// Validators for the CLI's numeric options, so that a number the command cannot use is a usage
// error (exit 2, one line naming the option) before any work starts.
//
// CLI11's own Range is not enough for floating-point options: every comparison with NaN is false,
// so NaN passes any range, and "inf" or "1e30" parse as numbers whose conversion to a byte count
// or a millisecond count is undefined behaviour (a busy loop in `top -d nan`, a wrapped capacity
// in `replay --capacity-gb 1e30`). finite_range() accepts finite values inside the bounds only;
// integer options use CLI::Range with bounds the command can actually serve.
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>

namespace gpustitch::cli {

// A finite number in [min, max] (or (min, max] when min_exclusive), described as `what` in the
// error message, e.g. "a positive number of GiB up to 1048576".
inline CLI::Validator finite_range(double min, double max, bool min_exclusive, std::string what) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        const char* begin = text.c_str();
        char* end = nullptr;
        const double v = std::strtod(begin, &end);
        const bool parsed = end != begin && *end == '\0';
        if (!parsed || !std::isfinite(v) || v > max || (min_exclusive ? v <= min : v < min))
          return "'" + text + "' is not " + what;
        return {};
      },
      what);
}

// The largest device the simulated and modelled policies take: 1 PiB (GPUs hold well under 1 TiB;
// anything larger is a typo, and 1e30 GiB does not fit a byte count).
inline constexpr double kMaxCapacityGb = 1024.0 * 1024.0;

// Charts: beyond this a PNG would take gigabytes of memory to render.
inline constexpr int kMaxPlotPixels = 20000;
// The synthetic trace's steps (replay --generate, demo): 10,000 steps are millions of events.
inline constexpr int kMaxGeneratedSteps = 10000;
// demo --batch: sequences per step (the tokens of a step are batch x up to 8,192).
inline constexpr int kMaxDemoBatch = 1024;
// gpustitchd keeps at most a week of history (daemon/src/request.cpp).
inline constexpr unsigned kMaxHistorySeconds = 604800;

inline CLI::Validator capacity_gb_check() {
  return finite_range(0, kMaxCapacityGb, true, "a positive number of GiB up to 1048576");
}

// A process id: a whole number from 1 to 2^31-1. (CLI::PositiveNumber's message for "notapid"
// printed the range of a double, 300 digits long.)
inline CLI::Validator pid_check() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const char* begin = text.c_str();
        char* end = nullptr;
        errno = 0;
        const long long v = std::strtoll(begin, &end, 10);
        if (end == begin || *end != '\0' || errno == ERANGE || v < 1 || v > 2147483647LL)
          return "'" + text + "' is not a process id";
        return {};
      },
      "PID");
}

}  // namespace gpustitch::cli
