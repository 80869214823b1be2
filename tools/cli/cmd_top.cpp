// gpustitch top: a refreshing view of every process using gpustitch (like gpustat -i / nvtop),
// with per-GPU totals (by UUID, named by the driver's index and model where it lists the GPU).
// Plain ANSI: clears the screen each refresh; `q` or Ctrl-C quits.
#include <poll.h>
#include <signal.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <iostream>
#include <map>

#include "number_checks.h"
#include "stats_client.h"
#include "terminal_text.h"

namespace gpustitch::cli {
namespace {

volatile sig_atomic_t g_stop = 0;
void on_sigint(int) {
  g_stop = 1;
}

struct TopOptions {
  SourceOptions source;
  double interval = 1.0;
  unsigned iterations = 0;
  std::string sort = "reserved";
};

// Puts the terminal in non-canonical mode (so `q` arrives without Enter) while alive.
class RawTerminal {
 public:
  RawTerminal() {
    if (!::isatty(STDIN_FILENO) || ::tcgetattr(STDIN_FILENO, &saved_) != 0) return;
    termios raw = saved_;
    raw.c_lflag &= ~(ICANON | ECHO);
    raw.c_cc[VMIN] = 0;
    raw.c_cc[VTIME] = 0;
    active_ = ::tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
  }
  ~RawTerminal() {
    if (active_) ::tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }

 private:
  termios saved_{};
  bool active_ = false;
};

std::uint64_t device_sort_key(const nlohmann::json& p, const std::string& key) {
  std::uint64_t v = 0;
  for (const auto& d : items(p, "devices")) {
    if (key == "allocated")
      v += u64(d, "bytes_allocated");
    else if (key == "ooms")
      v += u64(d, "ooms");
    else if (key == "stitches")
      v += u64(d, "stitches");
    else if (key == "fragmentation")
      v = std::max<std::uint64_t>(v, std::llround(f64(d, "fragmentation") * 1e6));
    else
      v += u64(d, "bytes_reserved");
  }
  return v;
}

std::string render(const Fetched& f, const TopOptions& o) {
  // The daemon's answer is untrusted: a missing or mistyped list shows as none (operator[] on a
  // const json with a missing key is undefined behaviour; Debug builds assert).
  static const nlohmann::json kNone = nlohmann::json::array();
  const nlohmann::json& processes =
      f.answer.is_object() && f.answer.contains("processes") && f.answer.at("processes").is_array()
          ? f.answer.at("processes")
          : kNone;
  std::vector<nlohmann::json> list(processes.begin(), processes.end());
  std::stable_sort(list.begin(), list.end(), [&](const auto& a, const auto& b) {
    if (o.sort == "pid") return u64(a, "pid") < u64(b, "pid");
    return device_sort_key(a, o.sort) > device_sort_key(b, o.sort);
  });
  // One line per GPU, keyed by UUID: the device ordinal is each process's own (three processes
  // with CUDA_VISIBLE_DEVICES=0, 1 and 2 all say device 0), the UUID is the GPU's. A device
  // without a UUID cannot be matched with any other and gets a line of its own.
  struct Totals {
    std::string title;
    std::uint64_t allocated = 0, reserved = 0, free = 0, total = 0, ooms = 0, procs = 0;
    std::uint64_t heartbeat = 0;  // of the process whose device free/total the line shows
    bool have_gpu = false;
    std::uint64_t gpu = 0;
  };
  std::map<std::string, Totals> per_gpu;
  for (const auto& p : list)
    for (const auto& d : items(p, "devices")) {
      std::string uuid = str(d, "uuid");
      std::string key = !uuid.empty() ? uuid
                                      : "pid " + std::to_string(u64(p, "pid")) + " device " +
                                            std::to_string(u64(d, "device"));
      auto [it, fresh] = per_gpu.try_emplace(key);
      Totals& t = it->second;
      if (fresh) {
        t.have_gpu = member(d, "gpu").is_number();
        t.gpu = u64(d, "gpu");
        std::string name = str(d, "gpu_name");
        t.title = t.have_gpu ? "GPU " + std::to_string(t.gpu) + (name.empty() ? "" : " " + name) +
                                   " (" + uuid + ")"
                  : !uuid.empty() ? "GPU " + uuid
                                  : key + " (no UUID)";
      }
      t.allocated += u64(d, "bytes_allocated");
      t.reserved += u64(d, "bytes_reserved");
      // Free memory changes all the time: show the figure the latest publisher saw.
      std::uint64_t hb = u64(p, "heartbeat_ns");
      if (fresh || hb >= t.heartbeat) {
        t.heartbeat = hb;
        t.free = u64(d, "device_free");
        t.total = u64(d, "device_total");
      }
      t.ooms += u64(d, "ooms");
      t.procs += 1;
    }
  std::vector<const Totals*> gpus;
  for (const auto& [key, t] : per_gpu) gpus.push_back(&t);
  // GPUs the driver lists first, in index order; the others by UUID.
  std::stable_sort(gpus.begin(), gpus.end(), [](const Totals* a, const Totals* b) {
    if (a->have_gpu != b->have_gpu) return a->have_gpu;
    return a->have_gpu && a->gpu < b->gpu;
  });
  std::string out;
  char stamp[32];
  std::time_t now = std::time(nullptr);
  std::strftime(stamp, sizeof stamp, "%H:%M:%S", std::localtime(&now));
  out += "gpustitch top - " + std::string(stamp) + " - " + std::to_string(list.size()) +
         (list.size() == 1 ? " process" : " processes") + " (source: " + f.source + ")   q: quit\n";
  for (const Totals* t : gpus) {
    double used = t->total ? 1.0 - double(t->free) / double(t->total) : 0.0;
    int bar = 30, filled = std::clamp(static_cast<int>(std::lround(used * bar)), 0, bar);
    out += t->title + "\n    [" + std::string(filled, '#') + std::string(bar - filled, '.') + "] " +
           human_bytes(t->total - std::min(t->free, t->total)) + " / " + human_bytes(t->total) +
           " used   gpustitch: " + human_bytes(t->allocated) + " allocated, " +
           human_bytes(t->reserved) + " reserved, " + std::to_string(t->ooms) + " OOMs, " +
           std::to_string(t->procs) + " procs\n";
  }
  out += "\n";
  out += format_table(process_rows(nlohmann::json(list), true), kProcessRowAlign, terminal_width());
  return out;
}

Registrar reg{
    "top", "Refreshing view of processes using gpustitch",
    [](CLI::App& sub, GlobalOptions& global) -> std::function<int()> {
      auto opts = std::make_shared<TopOptions>();
      add_source_options(sub, opts->source);
      sub.add_option("-d,--interval", opts->interval, "Seconds between refreshes")
          ->check(finite_range(0.05, 3600, false, "a number of seconds between 0.05 and 3600"));
      sub.add_option("-n,--iterations", opts->iterations, "Stop after N refreshes (0 = until q)");
      sub.add_option("-s,--sort", opts->sort,
                     "Sort by reserved|allocated|fragmentation|ooms|stitches|pid")
          ->check(
              CLI::IsMember({"reserved", "allocated", "fragmentation", "ooms", "stitches", "pid"}));
      sub.footer(
          "With --json prints one JSON object per refresh, one per line.\nExit status: 0, "
          "or 4 when the daemon is required but unreachable.");
      return [opts, &global]() {
        struct sigaction sa {};
        sa.sa_handler = on_sigint;
        ::sigaction(SIGINT, &sa, nullptr);
        ::sigaction(SIGTERM, &sa, nullptr);
        bool tty = ::isatty(STDOUT_FILENO) && !global.json;
        std::optional<RawTerminal> raw;
        if (tty) raw.emplace();
        for (unsigned i = 0; !g_stop && (opts->iterations == 0 || i < opts->iterations); ++i) {
          Fetched f = fetch_list(opts->source, /*summary=*/!global.json);
          if (f.status != kOk) {
            std::cerr << "gpustitch top: " << f.error << "\n";
            return f.status;
          }
          if (global.json) {
            std::cout << terminal_json(nlohmann::json{
                             {"time_ns", std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::system_clock::now().time_since_epoch())
                                             .count()},
                             {"source", f.source},
                             {"processes", f.answer.is_object() && f.answer.contains("processes")
                                               ? f.answer.at("processes")
                                               : nlohmann::json::array()}}
                                           .dump(-1, ' ', false,
                                                 nlohmann::json::error_handler_t::replace))
                      << "\n";
          } else {
            std::cout << (tty ? "\x1b[H\x1b[2J" : "") << render(f, *opts);
            if (!tty) std::cout << "\n";
          }
          std::cout.flush();
          if (opts->iterations && i + 1 == opts->iterations) break;
          // Wait for the interval, or for `q` on the terminal.
          auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<long>(opts->interval * 1000));
          while (!g_stop) {
            auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                deadline - std::chrono::steady_clock::now());
            if (left.count() <= 0) break;
            pollfd p{STDIN_FILENO, POLLIN, 0};
            int r = ::poll(&p, raw ? 1 : 0, static_cast<int>(left.count()));
            if (r > 0) {
              char c = 0;
              if (::read(STDIN_FILENO, &c, 1) == 1 && (c == 'q' || c == 'Q')) g_stop = 1;
            }
          }
        }
        return int(kOk);
      };
    }};

}  // namespace
}  // namespace gpustitch::cli
