// Checks run by `gpustitch doctor`. Any file compiled into the CLI can add one:
//
//   static gpustitch::cli::DoctorCheck my_check{"trace", 50, [](const DoctorContext& ctx) {
//     return DoctorResult{DoctorLevel::ok, "trace directory writable", {}};
//   }};
//
// Checks run in ascending order (built-ins use 10..40); a check must not throw and should finish
// within a second. Any `fail` makes doctor exit with kProblem (1); `warn` does not.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "stats_client.h"

namespace gpustitch::cli {

enum class DoctorLevel { ok, warn, fail, skip };
const char* to_string(DoctorLevel level);

struct DoctorContext {
  SourceOptions source;  // where the daemon is
  std::string preload;   // --preload PATH, or ""
};

struct DoctorResult {
  DoctorLevel level = DoctorLevel::ok;
  std::string summary;                             // one line
  std::vector<std::string> lines;                  // details (one per device, ...)
  nlohmann::json data = nlohmann::json::object();  // machine-readable figures for --json
};

struct DoctorCheckSpec {
  std::string name;
  int order;
  std::function<DoctorResult(const DoctorContext&)> run;
};

std::vector<DoctorCheckSpec>& doctor_checks();

struct DoctorCheck {
  DoctorCheck(std::string name, int order, std::function<DoctorResult(const DoctorContext&)> run) {
    doctor_checks().push_back({std::move(name), order, std::move(run)});
  }
};

}  // namespace gpustitch::cli
