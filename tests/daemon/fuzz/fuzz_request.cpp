// libFuzzer target: arbitrary bytes as a request line on gpustitchd's socket. parse_request and
// handle_request must answer (a JSON line) without crashing for any input, for any peer.
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "request.h"

using namespace gpustitch::daemon;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static DaemonConfig config = [] {
    DaemonConfig c;
    c.record_prefix = "fuzz-no-records";
    c.admin_group = "nogroup";
    return c;
  }();
  static ProcessTable table(config);
  std::string_view line(reinterpret_cast<const char*>(data), size);
  std::string why;
  (void)parse_request(line, &why);
  Peer peer{static_cast<uid_t>(size % 3 == 0 ? 0 : 1000), 1000, 1, {}};
  std::string answer = handle_request(line, peer, table, config);
  // Every answer is one JSON object on one line.
  if (answer.empty() || answer.back() != '\n' ||
      !nlohmann::json::parse(answer, nullptr, false).is_object())
    __builtin_trap();
  return 0;
}
