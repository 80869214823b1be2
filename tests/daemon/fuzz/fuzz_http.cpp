// libFuzzer target: arbitrary bytes as a request on gpustitchd's metrics port, through the same
// parser limits and routing as the daemon (daemon/src/http.h). Either the parser refuses them or
// the answer is a whole HTTP response; nothing may crash.
#include <cstdint>
#include <string_view>

#include "http.h"

using namespace gpustitch::daemon;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static DaemonConfig config = [] {
    DaemonConfig c;
    c.record_prefix = "fuzz-no-records";
    return c;
  }();
  static ProcessTable table(config);
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto answer = http_answer(bytes, table);
  if (answer && answer->rfind("HTTP/1.", 0) != 0) __builtin_trap();
  return 0;
}
