// What ps, top and show have in common: where the statistics come from (gpustitchd's socket, or
// the calling user's records read directly when the daemon is not running), and how figures are
// printed (binary units, percentages, tables).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "command.h"

namespace gpustitch::cli {

struct SourceOptions {
  std::string socket;   // "" = $GPUSTITCH_SOCKET or the default path
  bool direct = false;  // never ask the daemon
  bool daemon = false;  // only the daemon (fail with kUnreachable when it is not there)
  std::string prefix;   // record name prefix ("" = $GPUSTITCH_SHM_PREFIX or "gpustitch")
};

// Adds --socket, --direct, --daemon (and the hidden --prefix) to a subcommand.
void add_source_options(CLI::App& sub, SourceOptions& opts);

struct Fetched {
  int status = kOk;    // kOk, or kUnreachable when the daemon was required and absent
  std::string source;  // "daemon" or "direct"
  std::string error;
  nlohmann::json answer;  // list: {"processes":[..]}; show: {"process":{..},"history":[..]}
};

std::string socket_path(const SourceOptions& opts);
std::string record_prefix(const SourceOptions& opts);

// summary: only what the ps/top tables show (much less to build, send and parse).
Fetched fetch_list(const SourceOptions& opts, bool summary = false);
// status kNotFound when the process is not visible.
Fetched fetch_show(const SourceOptions& opts, long pid, unsigned history_seconds);

// 1536 -> "1.5 KiB", 0 -> "0 B".
std::string human_bytes(std::uint64_t bytes);
std::string percent(double ratio);  // 0.4 -> "40.0%"
// The daemon's answer line as JSON: an object nested at most kMaxAnswerDepth deep (printing a
// deeper one would recurse off the stack), with "process", "processes" and "history", where
// present, of the types the commands read. nullopt (and why) otherwise.
inline constexpr int kMaxAnswerDepth = 32;
std::optional<nlohmann::json> parse_daemon_answer(std::string_view text, std::string* why);

// j[key] when j is an object that has it, else null: never the undefined behaviour of a const
// operator[] on a missing key.
const nlohmann::json& member(const nlohmann::json& j, const char* key);
// j[key] when it is an array, else an empty array.
const nlohmann::json& items(const nlohmann::json& j, const char* key);
// A number as unsigned, 0 for anything else.
std::uint64_t as_u64(const nlohmann::json& v);

// Numbers out of JSON, tolerant to missing fields and wrong types.
std::uint64_t u64(const nlohmann::json& j, const char* key);
double f64(const nlohmann::json& j, const char* key);
std::string str(const nlohmann::json& j, const char* key);

// Column-aligned table; the last column is left unpadded and cut to fit `width` when > 0.
std::string format_table(const std::vector<std::vector<std::string>>& rows,
                         const std::vector<bool>& right_aligned, int width = 0);
int terminal_width();  // COLUMNS, the tty's width, or 0 when not a terminal

// Prints JSON with invalid UTF-8 replaced.
void print_json(const nlohmann::json& j);

// ps/top rows: one per process and device.
std::vector<std::vector<std::string>> process_rows(const nlohmann::json& processes, bool header);
extern const std::vector<bool> kProcessRowAlign;

// The `gpustitch ps` table, header first: from the daemon's summary list read straight into rows
// (no JSON document is built: with 1,000 processes that document is a few MiB of small
// allocations, the larger part of ps's time in a fresh process), or from the records directly.
// *processes: how many processes the rows show.
Fetched fetch_table(const SourceOptions& opts, std::vector<std::vector<std::string>>* rows,
                    std::size_t* processes);

// The daemon's summary list answer (text) read straight into table rows, header first. parsed:
// the text was JSON; ok: the daemon said ok; processes: how many processes the rows show.
struct ListTable {
  bool parsed = false, ok = false;
  std::string error;
  std::size_t processes = 0;
};
ListTable parse_list_table(std::string_view text, std::vector<std::vector<std::string>>* rows);

}  // namespace gpustitch::cli
