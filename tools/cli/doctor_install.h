// `gpustitch doctor`'s installation checks: is what the package installed where the other parts
// look for it, and does it work together? The paths come from packaging/InstallLayout.cmake, the
// same file the install rules use, so the doctor and the package cannot disagree.
//
// Checks, in order (each one line of the doctor's report):
//   preload library    present at the installed path, and a program started with it in
//                      LD_PRELOAD runs (the dynamic loader accepts it and its constructor returns)
//   daemon binary      present and executable
//   daemon config      /etc/gpustitch/gpustitchd.conf is key = value lines
//   preload config     /etc/gpustitch/gpustitch.conf's entries are accepted by the library's parser
//   GPUSTITCH_CONF     the environment variable, when set, is accepted by that parser
//   systemd unit       installed, and its ExecStart= names the installed daemon
//   sysusers/tmpfiles  entries for the service user and runtime directory are installed
//   service user       exists (checked only on the live system, not under another root)
//   runtime directory  /run/gpustitch exists
//   daemon socket      something accepts connections on the daemon's socket
//   ld.so.preload      if /etc/ld.so.preload names libgpustitch.so, the named file exists
//   /dev/shm           exists as a world-writable sticky directory (where records are published)
//
// The checks live in their own namespace: doctor.h's DoctorCheck is the registrar of doctor
// checks; doctor_install_check.cpp registers these as one of them.
#pragma once

#include <string>
#include <vector>

namespace gpustitch::cli::install {

struct DoctorCheck {
  std::string name;
  bool ok;
  std::string detail;
};

// Where an installation keeps its files. Paths are absolute as seen on the installed system;
// `root` is prepended to each when checking (empty for the live system; a dpkg -x tree or a
// container's filesystem otherwise).
struct InstallLayout {
  std::string root;
  std::string preload_library;
  std::string daemon;
  std::string daemon_config;
  std::string preload_config;
  std::string unit;
  std::string sysusers;
  std::string tmpfiles;
  std::string runtime_dir;
  std::string socket;  // used unless the daemon config sets "socket"
  std::string service_user;
  // A program that exists on every system, run with the library in LD_PRELOAD to prove it loads.
  std::string probe_program = "/bin/true";

  // The layout this build installs (what the .deb contains).
  static InstallLayout installed();
  // The same layout below another root directory.
  static InstallLayout under(std::string root);
  // root + path.
  std::string at(const std::string& path) const { return root + path; }
};

// Checks the live system's installation.
std::vector<DoctorCheck> check_installation();
std::vector<DoctorCheck> check_installation(const InstallLayout& layout);

}  // namespace gpustitch::cli::install
