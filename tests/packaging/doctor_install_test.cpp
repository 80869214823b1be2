// `gpustitch doctor`'s installation checks (tools/cli/doctor_install.cpp) against installations
// built in a temporary root: a complete one passes every check, and each kind of breakage an
// operator can meet fails exactly the check that names it, with a detail that says why. Also
// checks that packaging/etc/gpustitch.conf documents every key the library accepts, with values
// the library accepts.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "doctor_install.h"
#include "gpustitch/config.h"

namespace fs = std::filesystem;
using gpustitch::cli::install::check_installation;
using gpustitch::cli::install::DoctorCheck;
using gpustitch::cli::install::InstallLayout;

namespace {

void write(const fs::path& p, const std::string& text, fs::perms mode = fs::perms(0644)) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
  fs::permissions(p, mode);
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A complete installation below a fresh temporary root, made of the real packaged files.
class DoctorInstall : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gpustitch-doctor-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    layout_ = InstallLayout::under(root_.string());
    // The library: the real preload library when it is built, else any loadable shared library
    // (the check is about the dynamic loader accepting the file at the installed path).
    fs::create_directories(at(layout_.preload_library).parent_path());
    fs::copy_file(TEST_PRELOAD_LIBRARY, at(layout_.preload_library));
    write(at(layout_.daemon), "#!/bin/sh\n", fs::perms(0755));
    fs::create_directories(at(layout_.daemon_config).parent_path());
    fs::copy_file(TEST_GENERATED_DIR "/gpustitchd.conf", at(layout_.daemon_config));
    fs::copy_file(TEST_SOURCE_DIR "/packaging/etc/gpustitch.conf", at(layout_.preload_config));
    fs::create_directories(at(layout_.unit).parent_path());
    fs::copy_file(TEST_GENERATED_DIR "/gpustitchd.service", at(layout_.unit));
    fs::create_directories(at(layout_.sysusers).parent_path());
    fs::copy_file(TEST_GENERATED_DIR "/gpustitch.sysusers", at(layout_.sysusers));
    fs::create_directories(at(layout_.tmpfiles).parent_path());
    fs::copy_file(TEST_GENERATED_DIR "/gpustitch.tmpfiles", at(layout_.tmpfiles));
    fs::create_directories(at(layout_.runtime_dir));
    listen_on(at(layout_.socket));
    ::unsetenv("GPUSTITCH_CONF");
  }
  void TearDown() override {
    if (listener_ >= 0) ::close(listener_);
    fs::remove_all(root_);
  }

  fs::path at(const std::string& p) const { return fs::path(layout_.at(p)); }

  void listen_on(const fs::path& path) {
    listener_ = ::socket(AF_UNIX, SOCK_STREAM, 0);
    ASSERT_GE(listener_, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    ASSERT_LT(path.string().size(), sizeof addr.sun_path);
    std::strcpy(addr.sun_path, path.c_str());
    ASSERT_EQ(::bind(listener_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(::listen(listener_, 4), 0);
  }

  // The named check; fails the test if there is none.
  DoctorCheck find(const std::string& name) {
    auto checks = check_installation(layout_);
    auto it = std::find_if(checks.begin(), checks.end(),
                           [&](const DoctorCheck& c) { return c.name == name; });
    EXPECT_NE(it, checks.end()) << "no check named " << name;
    return it == checks.end() ? DoctorCheck{name, false, "missing"} : *it;
  }

  // Every check but the named ones passes.
  void expect_only_failing(std::set<std::string> failing) {
    for (const auto& c : check_installation(layout_)) {
      if (c.name == "/dev/shm" || c.name == "service user") continue;  // the host's, not ours
      EXPECT_EQ(c.ok, failing.count(c.name) == 0) << c.name << ": " << c.detail;
    }
  }

  fs::path root_;
  InstallLayout layout_;
  int listener_ = -1;
};

TEST_F(DoctorInstall, CompleteInstallationPassesEveryCheck) {
  expect_only_failing({});
  EXPECT_NE(find("preload library").detail.find("loads"), std::string::npos);
  EXPECT_NE(find("daemon socket").detail.find("accepting"), std::string::npos);
}

TEST_F(DoctorInstall, MissingLibraryIsReported) {
  fs::remove(at(layout_.preload_library));
  expect_only_failing({"preload library"});
  EXPECT_NE(find("preload library").detail.find("missing"), std::string::npos);
}

TEST_F(DoctorInstall, LibraryTheLoaderRejectsIsReported) {
  // A truncated download or a library for another architecture: the loader refuses it.
  write(at(layout_.preload_library), "this is not an ELF file\n");
  DoctorCheck c = find("preload library");
  EXPECT_FALSE(c.ok);
  EXPECT_NE(c.detail.find("rejects"), std::string::npos) << c.detail;
}

TEST_F(DoctorInstall, DaemonMissingOrNotExecutable) {
  fs::permissions(at(layout_.daemon), fs::perms(0644));
  expect_only_failing({"daemon binary"});
  EXPECT_NE(find("daemon binary").detail.find("not executable"), std::string::npos);
  fs::remove(at(layout_.daemon));
  EXPECT_FALSE(find("daemon binary").ok);
}

TEST_F(DoctorInstall, MalformedDaemonConfigNamesTheLine) {
  write(at(layout_.daemon_config), "# ok\nsocket = /run/gpustitch/gpustitchd.sock\nbogus line\n");
  expect_only_failing({"daemon config"});
  EXPECT_NE(find("daemon config").detail.find("line 3"), std::string::npos)
      << find("daemon config").detail;
}

TEST_F(DoctorInstall, DaemonConfigSocketIsTheOneProbed) {
  // The config moves the socket: the old path's listener no longer counts.
  write(at(layout_.daemon_config), "socket = /run/gpustitch/elsewhere.sock\n");
  EXPECT_FALSE(find("daemon socket").ok);
  ::close(listener_);
  listen_on(at("/run/gpustitch/elsewhere.sock"));
  EXPECT_TRUE(find("daemon socket").ok) << find("daemon socket").detail;
}

TEST_F(DoctorInstall, PreloadConfigWithUnknownKeyIsReported) {
  write(at(layout_.preload_config), "# comment\nstitching:on\nno_such_key:1\n");
  expect_only_failing({"preload config"});
  EXPECT_NE(find("preload config").detail.find("no_such_key"), std::string::npos)
      << find("preload config").detail;
}

TEST_F(DoctorInstall, EnvironmentConfigIsChecked) {
  ::setenv("GPUSTITCH_CONF", "stitching:on,release_threshold_mb:64", 1);
  EXPECT_TRUE(find("GPUSTITCH_CONF").ok);
  ::setenv("GPUSTITCH_CONF", "stitching:on,frobnicate:7", 1);
  DoctorCheck c = find("GPUSTITCH_CONF");
  EXPECT_FALSE(c.ok);
  EXPECT_NE(c.detail.find("frobnicate"), std::string::npos) << c.detail;
  ::unsetenv("GPUSTITCH_CONF");
}

TEST_F(DoctorInstall, UnitRunningAnotherBinaryIsReported) {
  std::string unit = slurp(at(layout_.unit));
  unit = std::regex_replace(unit, std::regex("ExecStart=\\S+"), "ExecStart=/opt/old/gpustitchd");
  write(at(layout_.unit), unit);
  expect_only_failing({"systemd unit"});
  EXPECT_NE(find("systemd unit").detail.find("/opt/old/gpustitchd"), std::string::npos);
  fs::remove(at(layout_.unit));
  EXPECT_FALSE(find("systemd unit").ok);
}

TEST_F(DoctorInstall, StoppedDaemonAndMissingRuntimeDirectory) {
  ::close(listener_);
  listener_ = -1;
  expect_only_failing({"daemon socket"});  // the stale socket file refuses connections
  fs::remove_all(at(layout_.runtime_dir));
  expect_only_failing({"daemon socket", "runtime directory"});
}

TEST_F(DoctorInstall, StaleLdSoPreloadEntryIsReported) {
  write(at("/etc/ld.so.preload"), "/opt/other/libkeep.so " + layout_.preload_library + "\n");
  EXPECT_TRUE(find("ld.so.preload").ok) << find("ld.so.preload").detail;
  write(at("/etc/ld.so.preload"), "/usr/lib/old/libgpustitch.so\n");
  DoctorCheck c = find("ld.so.preload");
  EXPECT_FALSE(c.ok);
  EXPECT_NE(c.detail.find("does not exist"), std::string::npos) << c.detail;
}

// Every key the library knows is documented in the shipped gpustitch.conf, and every documented
// "#key:value" line is accepted by the library's parser once uncommented.
TEST(PackagedPreloadConfig, DocumentsEveryKeyWithAcceptedValues) {
  std::ifstream in(TEST_SOURCE_DIR "/packaging/etc/gpustitch.conf");
  ASSERT_TRUE(in);
  std::regex entry("^#([a-z_]+):(\\S+)$");
  std::set<std::string> documented;
  std::string line;
  while (std::getline(in, line)) {
    std::smatch m;
    if (!std::regex_match(line, m, entry)) continue;
    documented.insert(m[1]);
    auto r = gpustitch::parse_config(line.substr(1));
    EXPECT_TRUE(r.errors.empty()) << line << ": " << (r.errors.empty() ? "" : r.errors.front());
  }
  for (std::string_view key : gpustitch::config_keys())
    EXPECT_TRUE(documented.count(std::string(key))) << key << " is not documented";
  EXPECT_EQ(documented.size(), gpustitch::config_keys().size());
}

}  // namespace
