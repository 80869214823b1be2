// Registers the installation checks (doctor_install.h) with `gpustitch doctor` as one check,
// "installation", with one line per item. It runs only when this CLI is the installed one: a
// build tree's binary has no installation to check. A daemon that is not answering is a warning,
// as in the doctor's daemon check (the CLI then reads records directly); anything else missing
// or incoherent is a failure.
#include <unistd.h>

#include "doctor.h"
#include "doctor_install.h"

namespace gpustitch::cli {
namespace {

std::string self_path() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

DoctorCheck installation_check{
    "installation", 50, [](const DoctorContext&) {
      DoctorResult r;
      std::string self = self_path();
      if (self != GPUSTITCH_CLI_PATH) {
        r.level = DoctorLevel::skip;
        r.summary = "not checked: this gpustitch runs from " + self + ", not " GPUSTITCH_CLI_PATH;
        return r;
      }
      auto checks = install::check_installation();
      int failed = 0, warned = 0;
      r.data["checks"] = nlohmann::json::array();
      for (const auto& c : checks) {
        bool warn_only = c.name == "daemon socket";
        if (!c.ok) (warn_only ? warned : failed) += 1;
        r.lines.push_back(std::string(c.ok        ? "ok    "
                                      : warn_only ? "warn  "
                                                  : "FAIL  ") +
                          c.name + ": " + c.detail);
        r.data["checks"].push_back({{"name", c.name}, {"ok", c.ok}, {"detail", c.detail}});
      }
      r.level = failed ? DoctorLevel::fail : warned ? DoctorLevel::warn : DoctorLevel::ok;
      r.summary = failed
                      ? std::to_string(failed) + " of " + std::to_string(checks.size()) +
                            " installation checks failed"
                      : "installed files coherent (" + std::to_string(checks.size()) + " checks)";
      return r;
    }};

}  // namespace
}  // namespace gpustitch::cli
