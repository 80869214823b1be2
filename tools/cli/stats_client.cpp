#include "stats_client.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <iostream>

#include "gpustitch/shm/json.h"
#include "gpustitch/shm/names.h"
#include "gpustitch/shm/record_reader.h"
#include "terminal_text.h"

namespace gpustitch::cli {
using nlohmann::json;

void add_source_options(CLI::App& sub, SourceOptions& opts) {
  sub.add_option(
      "--socket", opts.socket,
      "gpustitchd socket (default $GPUSTITCH_SOCKET or " + std::string(shm::kDefaultSocket) + ")");
  auto* d = sub.add_flag("--direct", opts.direct,
                         "Read the records in /dev/shm directly instead of asking gpustitchd");
  sub.add_flag("--daemon", opts.daemon, "Ask gpustitchd only; fail when it is not reachable")
      ->excludes(d);
  sub.add_option("--prefix", opts.prefix, "Record name prefix (tests)")->group("");
}

std::string socket_path(const SourceOptions& opts) {
  if (!opts.socket.empty()) return opts.socket;
  if (const char* env = std::getenv("GPUSTITCH_SOCKET"); env && *env) return env;
  return shm::kDefaultSocket;
}

std::string record_prefix(const SourceOptions& opts) {
  if (!opts.prefix.empty()) return opts.prefix;
  if (const char* env = std::getenv("GPUSTITCH_SHM_PREFIX"); env && *env) return env;
  return std::string(shm::kDefaultPrefix);
}

namespace {
constexpr int kDaemonTimeoutMs = 2000;

// Asks the daemon unless told not to. Returns true when the answer (or a definitive failure)
// came from the daemon; false means "fall back to reading records directly".
bool ask_daemon(const SourceOptions& opts, const json& request, Fetched* out) {
  if (opts.direct) return false;
  std::string why;
  auto text = shm::query_daemon_text(socket_path(opts), request, kDaemonTimeoutMs, &why);
  std::optional<json> answer;
  if (text) answer = parse_daemon_answer(*text, &why);
  if (!answer) {
    if (opts.daemon || !opts.socket.empty()) {
      out->status = kUnreachable;
      out->error = "gpustitchd not reachable: " + why;
      return true;
    }
    return false;
  }
  out->source = "daemon";
  if (member(*answer, "ok") != true) {
    const json& e = member(*answer, "error");
    out->error = e.is_string() ? terminal_text(e.get<std::string>()) : std::string("error");
    out->status = out->error == "not found" ? kNotFound : kProblem;
    return true;
  }
  out->answer = std::move(*answer);
  return true;
}
}  // namespace

Fetched fetch_list(const SourceOptions& opts, bool summary) {
  Fetched f;
  if (ask_daemon(opts, json{{"cmd", "list"}, {"summary", summary}}, &f)) return f;
  f.source = "direct";
  json processes = shm::scan_processes_json(
      record_prefix(opts), summary ? shm::JsonDetail::summary : shm::JsonDetail::counters);
  const shm::GpuInventory gpus = shm::GpuInventory::read(shm::gpus_dir_from_environment());
  for (auto& p : processes) shm::add_gpu_fields(p, gpus);
  f.answer = json{{"ok", true}, {"processes", std::move(processes)}};
  return f;
}

Fetched fetch_show(const SourceOptions& opts, long pid, unsigned history_seconds) {
  Fetched f;
  if (ask_daemon(opts, json{{"cmd", "show"}, {"pid", pid}, {"history_seconds", history_seconds}},
                 &f))
    return f;
  f.source = "direct";
  uid_t me = ::geteuid();
  std::optional<uid_t> only;
  if (me != 0) only = me;
  for (const auto& name : shm::discover_records(record_prefix(opts), only)) {
    if (name.pid != pid || !shm::record_process_alive(name)) continue;
    shm::ReadError err;
    auto reader = shm::RecordReader::open(name, only, &err);
    if (!reader) {
      f.status = kUnreachable;
      f.error = name.path() + ": " + shm::to_string(err);
      return f;
    }
    auto j = shm::read_process_json(*reader, shm::JsonDetail::full, &err);
    if (!j) {
      f.status = kUnreachable;
      f.error = name.path() + ": " + shm::to_string(err);
      return f;
    }
    shm::add_gpu_fields(*j, shm::GpuInventory::read(shm::gpus_dir_from_environment()));
    f.answer = json{{"ok", true}, {"process", std::move(*j)}, {"history", json::array()}};
    return f;
  }
  f.status = kNotFound;
  f.error = "not found";
  return f;
}

std::string human_bytes(std::uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 6) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, v < 10 ? "%.2f %s" : v < 100 ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

std::string percent(double ratio) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", ratio * 100.0);
  return buf;
}

std::optional<json> parse_daemon_answer(std::string_view text, std::string* why) {
  auto fail = [&](const char* what) -> std::optional<json> {
    if (why) *why = what;
    return std::nullopt;
  };
  // Depth first, without building anything: brackets outside strings.
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxAnswerDepth) return fail("the daemon sent JSON nested too deep");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  json answer = json::parse(text.begin(), text.end(), nullptr, false);
  if (answer.is_discarded() || !answer.is_object()) return fail("the daemon sent malformed JSON");
  auto wrong = [&](const char* key, json::value_t type) {
    auto it = answer.find(key);
    return it != answer.end() && it->type() != type;
  };
  if (wrong("process", json::value_t::object) || wrong("processes", json::value_t::array) ||
      wrong("history", json::value_t::array))
    return fail("the daemon sent an answer of the wrong shape");
  return answer;
}

const json& member(const json& j, const char* key) {
  static const json null;
  if (!j.is_object()) return null;
  auto it = j.find(key);
  return it == j.end() ? null : *it;
}

const json& items(const json& j, const char* key) {
  static const json empty = json::array();
  const json& m = member(j, key);
  return m.is_array() ? m : empty;
}

std::uint64_t as_u64(const json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer())
    return static_cast<std::uint64_t>(std::max<std::int64_t>(0, v.get<std::int64_t>()));
  return 0;
}

std::uint64_t u64(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_unsigned() ? it->get<std::uint64_t>()
         : it != j.end() && it->is_number_integer()
             ? static_cast<std::uint64_t>(std::max<std::int64_t>(0, it->get<std::int64_t>()))
             : 0;
}

double f64(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

std::string str(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? terminal_text(it->get<std::string>()) : std::string();
}

int terminal_width() {
  if (const char* c = std::getenv("COLUMNS"); c && std::atoi(c) > 0) return std::atoi(c);
  winsize ws{};
  if (::isatty(STDOUT_FILENO) && ::ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col)
    return ws.ws_col;
  return 0;
}

std::string format_table(const std::vector<std::vector<std::string>>& rows,
                         const std::vector<bool>& right, int width) {
  // Every cell may come from a record or the daemon: made safe for a terminal before measuring.
  std::vector<std::vector<std::string>> safe;
  safe.reserve(rows.size());
  for (const auto& r : rows) {
    safe.emplace_back();
    for (const auto& cell : r) safe.back().push_back(terminal_text(cell));
  }
  std::vector<std::size_t> w;
  for (const auto& r : safe)
    for (std::size_t i = 0; i + 1 < r.size(); ++i) {
      if (w.size() <= i) w.resize(i + 1, 0);
      w[i] = std::max(w[i], r[i].size());
    }
  std::string out;
  for (const auto& cells : safe) {
    const auto& r = cells;
    std::string line;
    for (std::size_t i = 0; i < r.size(); ++i) {
      if (i) line += "  ";
      if (i + 1 == r.size()) {
        line += cells[i];
        break;
      }
      std::string pad(w[i] - cells[i].size(), ' ');
      line += (i < right.size() && right[i]) ? pad + cells[i] : cells[i] + pad;
    }
    if (width > 0 && line.size() > static_cast<std::size_t>(width)) line.resize(width);
    out += line + "\n";
  }
  return out;
}

void print_json(const json& j) {
  std::cout << terminal_json(j.dump(2, ' ', false, json::error_handler_t::replace)) << "\n";
}

const std::vector<bool> kProcessRowAlign = {true, false, true, true, true, true,
                                            true, true,  true, true, false};

namespace {

// One process as the ps/top table shows it.
struct DeviceLine {
  std::uint64_t device = 0, allocated = 0, reserved = 0, largest_free = 0, stitches = 0, ooms = 0;
  double fragmentation = 0;
  // Memory the program maps itself (cuMemCreate/cuMemMap), which the pool does not serve.
  std::uint64_t program = 0;
  std::optional<std::uint64_t> gpu;  // the GPU's index (nvidia-smi's), when the driver lists it
};
struct ProcessLine {
  std::uint64_t pid = 0;
  std::string user, command, exe;
  std::vector<DeviceLine> devices;
};

// The GPU column: the GPU's index where the driver lists it; else the process's own device
// ordinal, marked ("cuda0"), which is not a GPU index (CUDA_VISIBLE_DEVICES renumbers).
std::string gpu_column(std::optional<std::uint64_t> gpu, std::uint64_t ordinal) {
  return gpu ? std::to_string(*gpu) : "cuda" + std::to_string(ordinal);
}

std::vector<std::string> header_row() {
  return {"PID",  "USER",         "GPU",      "ALLOCATED", "RESERVED", "PROGRAM-MAPPED",
          "FRAG", "LARGEST FREE", "STITCHES", "OOMS",      "COMMAND"};
}

void append_rows(const ProcessLine& p, std::vector<std::vector<std::string>>* rows) {
  std::string pid = std::to_string(p.pid);
  const std::string& cmd = p.command.empty() ? p.exe : p.command;
  if (p.devices.empty()) {
    rows->push_back({pid, p.user, "-", "-", "-", "-", "-", "-", "-", "-", cmd});
    return;
  }
  for (const auto& d : p.devices)
    rows->push_back({pid, p.user, gpu_column(d.gpu, d.device), human_bytes(d.allocated),
                     human_bytes(d.reserved), human_bytes(d.program), percent(d.fragmentation),
                     human_bytes(d.largest_free), std::to_string(d.stitches),
                     std::to_string(d.ooms), cmd});
}

// Reads the daemon's list answer ({"ok":..,"error":..,"processes":[{..,"devices":[{..}]}]}) as a
// stream of parse events into ProcessLines and then rows. Unknown keys are skipped; a field of
// the wrong type reads as 0 or empty, as process_rows() treats it.
class TableReader final : public nlohmann::json_sax<json> {
 public:
  explicit TableReader(std::vector<std::vector<std::string>>* rows) : rows_(rows) {}
  bool ok = false;
  std::string error;
  std::size_t processes = 0;

  bool null() override { return true; }
  bool boolean(bool v) override {
    if (depth_ == 1 && key_ == "ok") ok = v;
    return true;
  }
  bool number_integer(number_integer_t v) override {
    return number(v < 0 ? 0 : static_cast<std::uint64_t>(v), static_cast<double>(v));
  }
  bool number_unsigned(number_unsigned_t v) override { return number(v, static_cast<double>(v)); }
  bool number_float(number_float_t v, const string_t&) override {
    // 1e30 from a daemon must not be an out-of-range conversion (undefined behaviour).
    return number(!(v > 0)                      ? 0
                  : v >= 18446744073709551615.0 ? ~std::uint64_t{0}
                                                : static_cast<std::uint64_t>(v),
                  v);
  }
  bool string(string_t& v) override {
    if (depth_ == 1 && key_ == "error") error = std::move(v);
    if (depth_ != 3) return true;
    if (key_ == "user") line_.user = std::move(v);
    if (key_ == "command") line_.command = std::move(v);
    if (key_ == "exe") line_.exe = std::move(v);
    return true;
  }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    ++depth_;
    if (depth_ == 3 && in_processes_) line_ = ProcessLine{};
    if (depth_ == 5 && in_devices_) line_.devices.emplace_back();
    return true;
  }
  bool end_object() override {
    if (depth_ == 3 && in_processes_) {
      append_rows(line_, rows_);
      ++processes;
    }
    --depth_;
    return true;
  }
  bool start_array(std::size_t) override {
    ++depth_;
    if (depth_ == 2 && key_ == "processes") in_processes_ = true;
    if (depth_ == 4 && in_processes_ && key_ == "devices") in_devices_ = true;
    return true;
  }
  bool end_array() override {
    if (depth_ == 2) in_processes_ = false;
    if (depth_ == 4) in_devices_ = false;
    --depth_;
    return true;
  }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  bool number(std::uint64_t u, double f) {
    if (depth_ == 3 && in_processes_ && key_ == "pid") line_.pid = u;
    if (depth_ != 5 || !in_devices_ || line_.devices.empty()) return true;
    DeviceLine& d = line_.devices.back();
    if (key_ == "device") d.device = u;
    if (key_ == "gpu") d.gpu = u;
    if (key_ == "bytes_allocated") d.allocated = u;
    if (key_ == "bytes_reserved") d.reserved = u;
    if (key_ == "largest_free_block") d.largest_free = u;
    if (key_ == "stitches") d.stitches = u;
    if (key_ == "ooms") d.ooms = u;
    if (key_ == "program_held_bytes") d.program = u;
    if (key_ == "fragmentation") d.fragmentation = f;
    return true;
  }

  std::vector<std::vector<std::string>>* rows_;
  int depth_ = 0;
  bool in_processes_ = false, in_devices_ = false;
  std::string key_;
  ProcessLine line_;
};

}  // namespace

std::vector<std::vector<std::string>> process_rows(const json& processes, bool header) {
  std::vector<std::vector<std::string>> rows;
  if (header) rows.push_back(header_row());
  for (const auto& p : processes) {
    ProcessLine line;
    line.pid = u64(p, "pid");
    line.user = str(p, "user");
    line.command = str(p, "command");
    line.exe = str(p, "exe");
    for (const auto& d : items(p, "devices"))
      line.devices.push_back(
          {u64(d, "device"), u64(d, "bytes_allocated"), u64(d, "bytes_reserved"),
           u64(d, "largest_free_block"), u64(d, "stitches"), u64(d, "ooms"),
           f64(d, "fragmentation"), u64(d, "program_held_bytes"),
           member(d, "gpu").is_number() ? std::optional(u64(d, "gpu")) : std::nullopt});
    append_rows(line, &rows);
  }
  return rows;
}

ListTable parse_list_table(std::string_view text, std::vector<std::vector<std::string>>* rows) {
  ListTable t;
  rows->clear();
  rows->push_back(header_row());
  TableReader reader(rows);
  t.parsed = json::sax_parse(text, &reader);
  t.ok = reader.ok;
  t.error = reader.error;
  t.processes = reader.processes;
  return t;
}

Fetched fetch_table(const SourceOptions& opts, std::vector<std::vector<std::string>>* rows,
                    std::size_t* processes) {
  Fetched f;
  rows->clear();
  *processes = 0;
  if (!opts.direct) {
    std::string why;
    auto text = shm::query_daemon_text(socket_path(opts), json{{"cmd", "list"}, {"summary", true}},
                                       kDaemonTimeoutMs, &why);
    if (text) {
      f.source = "daemon";
      ListTable t = parse_list_table(*text, rows);
      if (!t.parsed) {
        f.status = kUnreachable;
        f.error = "gpustitchd not reachable: the daemon sent malformed JSON";
      } else if (!t.ok) {
        f.error = t.error.empty() ? std::string("error") : terminal_text(t.error);
        f.status = f.error == "not found" ? kNotFound : kProblem;
      }
      *processes = t.processes;
      return f;
    }
    if (opts.daemon || !opts.socket.empty()) {
      f.status = kUnreachable;
      f.error = "gpustitchd not reachable: " + why;
      return f;
    }
  }
  f.source = "direct";
  rows->push_back(header_row());
  const shm::GpuInventory gpus = shm::GpuInventory::read(shm::gpus_dir_from_environment());
  shm::scan_processes(
      record_prefix(opts), [&](const shm::RecordReader& reader, const shm::SnapshotCopy& snap) {
        const shm::ProcessIdentity& id = reader.identity();
        ProcessLine line{
            static_cast<std::uint64_t>(id.pid), shm::user_name(id.uid), id.cmdline, id.exe, {}};
        for (const auto& d : snap.devices) {
          const shm::GpuInfo* g = gpus.find(d.uuid);
          line.devices.push_back({static_cast<std::uint64_t>(std::max<std::int64_t>(0, d.ordinal)),
                                  d.bytes_allocated, d.bytes_reserved, d.largest_free_block,
                                  d.stitches, d.ooms, d.fragmentation(), d.program_held_bytes,
                                  g ? std::optional<std::uint64_t>(g->index) : std::nullopt});
        }
        append_rows(line, rows);
        ++*processes;
      });
  return f;
}

}  // namespace gpustitch::cli
