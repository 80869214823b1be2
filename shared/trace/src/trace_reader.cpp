// TraceReader: parses RMM logging CSVs (RMM's own and gpustitch's). See trace_reader.h.
//
// Field rules follow what RMM writes and what RMM's replay parser accepts: Pointer is hex (with
// or without 0x, as RMM's parser reads it base 16), Stream is hex with 0x or decimal, Action is
// allocate|free (RMM's documentation also shows "deallocate", accepted as free). Sizes and thread
// ids are decimal. Whitespace around fields and CRLF line ends are ignored.
#include "gpustitch/trace/trace_reader.h"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <map>

namespace gpustitch::trace {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split(std::string_view line) {
  std::vector<std::string_view> out;
  std::size_t start = 0;
  for (;;) {
    std::size_t comma = line.find(',', start);
    out.push_back(
        trim(line.substr(start, comma == std::string_view::npos ? line.npos : comma - start)));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

bool parse_uint(std::string_view s, int base, std::uint64_t* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out, base);
  return ec == std::errc() && p == s.data() + s.size();
}

bool parse_hex(std::string_view s, std::uint64_t* out) {
  if (s.size() >= 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) s.remove_prefix(2);
  if (s == "(nil)" || s == "nullptr") {
    *out = 0;
    return true;
  }
  return parse_uint(s, 16, out);
}

bool parse_stream(std::string_view s, std::uint64_t* out) {
  if (s.size() >= 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) return parse_hex(s, out);
  if (s == "(nil)" || s == "nullptr") {
    *out = 0;
    return true;
  }
  return parse_uint(s, 10, out);
}

struct Columns {
  int thread = 0, time = 1, action = 2, pointer = 3, size = 4, stream = 5, device = -1, served = -1;
};

std::optional<ServedBy> parse_served(std::string_view s) {
  if (s == "cache") return ServedBy::cache;
  if (s == "fresh") return ServedBy::fresh;
  if (s == "stitched") return ServedBy::stitched;
  if (s == "small") return ServedBy::small;
  return std::nullopt;
}

}  // namespace

int Trace::device_count() const noexcept {
  int n = 1;
  for (const auto& e : events) n = std::max(n, e.device + 1);
  return n;
}

std::optional<double> parse_trace_time(const std::string& text) {
  std::string_view s = trim(text);
  if (s.empty()) return std::nullopt;
  auto number = [](std::string_view v) -> std::optional<double> {
    if (v.empty()) return std::nullopt;
    double d = 0;
    auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), d);
    if (ec != std::errc() || p != v.data() + v.size()) return std::nullopt;
    return d;
  };
  std::size_t c1 = s.find(':');
  if (c1 == std::string_view::npos) return number(s);
  std::size_t c2 = s.find(':', c1 + 1);
  if (c2 == std::string_view::npos) return std::nullopt;
  auto h = number(s.substr(0, c1));
  auto m = number(s.substr(c1 + 1, c2 - c1 - 1));
  auto sec = number(s.substr(c2 + 1));
  if (!h || !m || !sec) return std::nullopt;
  return *h * 3600 + *m * 60 + *sec;
}

Trace read_trace(std::istream& in) {
  Trace trace;
  Columns cols;
  std::string line;
  std::uint64_t lineno = 0;
  auto bad = [&](std::uint64_t ln, std::string why) {
    ++trace.bad_lines;
    if (trace.errors.size() < kMaxKeptErrors) trace.errors.push_back({ln, std::move(why)});
  };
  while (std::getline(in, line)) {
    ++lineno;
    std::string_view view = trim(line);
    if (view.empty()) continue;
    auto fields = split(view);
    if (!trace.has_header && trace.events.empty()) {
      bool is_header = std::find(fields.begin(), fields.end(), "Action") != fields.end();
      if (is_header) {
        std::map<std::string_view, int> at;
        for (std::size_t i = 0; i < fields.size(); ++i) at[fields[i]] = static_cast<int>(i);
        auto col = [&](std::string_view name, int fallback) {
          auto it = at.find(name);
          return it == at.end() ? fallback : it->second;
        };
        cols.thread = col("Thread", -1);
        cols.time = col("Time", -1);
        cols.action = col("Action", -1);
        cols.pointer = col("Pointer", -1);
        cols.size = col("Size", -1);
        cols.stream = col("Stream", -1);
        cols.device = col("Device", -1);
        cols.served = col("ServedBy", -1);
        if (cols.action < 0 || cols.pointer < 0 || cols.size < 0) {
          bad(lineno, "header lacks Action, Pointer or Size; using RMM's column order");
          cols = Columns{};
        } else {
          trace.has_header = true;
          trace.gpustitch_columns = cols.device >= 0;
        }
        continue;
      }
    }
    auto field = [&](int i) -> std::string_view {
      return i >= 0 && i < static_cast<int>(fields.size()) ? fields[static_cast<std::size_t>(i)]
                                                           : std::string_view{};
    };
    if (static_cast<int>(fields.size()) < std::max({cols.action, cols.pointer, cols.size}) + 1) {
      bad(lineno, "too few fields (" + std::to_string(fields.size()) + ")");
      continue;
    }
    TraceEvent ev;
    ev.line = lineno;
    std::string_view action = field(cols.action);
    if (action == "allocate") {
      ev.action = TraceAction::allocate;
    } else if (action == "free" || action == "deallocate") {
      ev.action = TraceAction::free;
    } else {
      bad(lineno, "unknown action '" + std::string(action.substr(0, 32)) + "'");
      continue;
    }
    if (!parse_hex(field(cols.pointer), &ev.ptr)) {
      bad(lineno, "bad pointer '" + std::string(field(cols.pointer).substr(0, 32)) + "'");
      continue;
    }
    if (!parse_uint(field(cols.size), 10, &ev.size)) {
      bad(lineno, "bad size '" + std::string(field(cols.size).substr(0, 32)) + "'");
      continue;
    }
    if (cols.thread >= 0 && !field(cols.thread).empty() &&
        !parse_uint(field(cols.thread), 10, &ev.thread)) {
      bad(lineno, "bad thread id");
      continue;
    }
    if (cols.stream >= 0 && !field(cols.stream).empty() &&
        !parse_stream(field(cols.stream), &ev.stream)) {
      bad(lineno, "bad stream '" + std::string(field(cols.stream).substr(0, 32)) + "'");
      continue;
    }
    if (cols.time >= 0 && !field(cols.time).empty()) {
      if (auto t = parse_trace_time(std::string(field(cols.time)))) ev.time_s = *t;
    }
    if (cols.device >= 0 && !field(cols.device).empty()) {
      std::uint64_t d = 0;
      if (!parse_uint(field(cols.device), 10, &d) || d > 4096) {
        bad(lineno, "bad device '" + std::string(field(cols.device).substr(0, 32)) + "'");
        continue;
      }
      ev.device = static_cast<int>(d);
    }
    if (cols.served >= 0) ev.served_by = parse_served(field(cols.served));
    trace.events.push_back(ev);
  }
  return trace;
}

bool read_trace_file(const std::string& path, Trace* out, std::string* why) {
  std::ifstream in(path);
  if (!in) {
    if (why) *why = "cannot open " + path;
    return false;
  }
  *out = read_trace(in);
  return true;
}

}  // namespace gpustitch::trace
