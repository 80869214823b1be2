// libFuzzer target: arbitrary bytes as GPUSTITCH_CONF. parse_config runs inside the host program
// before anything else of ours, so for any text it must return (never throw, crash or hang), keep
// every value it accepts within the ranges the rest of the library assumes, and report every
// rejected entry as one message.
#include <cstdint>
#include <string_view>

#include "gpustitch/config.h"

using namespace gpustitch;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  ConfigResult result = parse_config(text);
  // Every message names something: an empty line would tell the user nothing.
  for (const std::string& e : result.errors) {
    if (e.empty()) __builtin_trap();
  }
  // Parsing on top of a parsed configuration (as config_from_env layers on defaults) is just as
  // safe, and text that parsed cleanly parses cleanly again.
  ConfigResult again = parse_config(text, result.config);
  if (result.errors.empty() && !again.errors.empty()) __builtin_trap();
  if (again.errors.size() != result.errors.size()) __builtin_trap();
  return 0;
}
