#include "gpustitch/types.h"
#include "gpustitch/stats.h"

namespace gpustitch {

const char* to_string(Status s) noexcept {
  switch (s) {
    case Status::ok:
      return "ok";
    case Status::out_of_memory:
      return "out of memory";
    case Status::invalid_value:
      return "invalid value";
    case Status::invalid_device:
      return "invalid device";
    case Status::not_supported:
      return "not supported";
    case Status::not_initialized:
      return "not initialized";
    case Status::error:
      return "error";
  }
  return "unknown";
}

const char* to_string(ServedBy s) noexcept {
  switch (s) {
    case ServedBy::cache:
      return "cache";
    case ServedBy::fresh:
      return "fresh";
    case ServedBy::stitched:
      return "stitched";
    case ServedBy::small:
      return "small";
  }
  return "unknown";
}

}  // namespace gpustitch
