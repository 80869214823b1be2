// libFuzzer target: arbitrary bytes as gpustitchd's answer line, through the CLI's readers: the
// shape and depth checks (parse_daemon_answer), the ps/top rows built from the parsed document
// and straight from the text (parse_list_table), the table layout, and the JSON printing. None
// may crash, whatever the daemon (or whoever listens on its socket) sends.
#include <cstdint>
#include <string>
#include <string_view>

#include "stats_client.h"

using namespace gpustitch::cli;
using nlohmann::json;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  std::string why;
  if (auto answer = parse_daemon_answer(text, &why)) {
    auto rows = process_rows(items(*answer, "processes"), true);
    (void)format_table(rows, kProcessRowAlign, static_cast<int>(size % 120));
    const json& p = member(*answer, "process");
    for (const auto& d : items(p, "devices")) (void)(u64(d, "bytes_allocated") + as_u64(d));
    for (const auto& h : items(*answer, "history"))
      for (const auto& t : items(h, "time_ns")) (void)as_u64(t);
    (void)answer->dump(2, ' ', false, json::error_handler_t::replace);
  } else if (why.empty()) {
    __builtin_trap();  // a refusal always says why
  }
  std::vector<std::vector<std::string>> rows;
  ListTable t = parse_list_table(text, &rows);
  if (rows.empty() || (!t.parsed && t.processes > rows.size())) __builtin_trap();
  (void)format_table(rows, kProcessRowAlign, 80);
  return 0;
}
