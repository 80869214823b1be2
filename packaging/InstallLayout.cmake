# Where an installed gpustitch puts its files: one place, read by the install rules
# (packaging/CMakeLists.txt), the systemd/sysusers/tmpfiles templates and `gpustitch doctor`
# (tools/cli/doctor_install.cpp), so the three cannot disagree.
#
# Paths are absolute (GNUInstallDirs' FULL forms): with the default /usr prefix the library lands
# in the multiarch directory (/usr/lib/x86_64-linux-gnu) and configuration in /etc, which is where
# the .deb puts them (CPACK_PACKAGING_INSTALL_PREFIX follows CMAKE_INSTALL_PREFIX).
include(GNUInstallDirs)

set(GPUSTITCH_PRELOAD_PATH "${CMAKE_INSTALL_FULL_LIBDIR}/libgpustitch.so")
set(GPUSTITCH_DAEMON_PATH "${CMAKE_INSTALL_FULL_SBINDIR}/gpustitchd")
set(GPUSTITCH_CLI_PATH "${CMAKE_INSTALL_FULL_BINDIR}/gpustitch")
set(GPUSTITCH_CONF_DIR "${CMAKE_INSTALL_FULL_SYSCONFDIR}/gpustitch")
set(GPUSTITCH_DAEMON_CONF "${GPUSTITCH_CONF_DIR}/gpustitchd.conf")
set(GPUSTITCH_PRELOAD_CONF "${GPUSTITCH_CONF_DIR}/gpustitch.conf")
# systemd's vendor directories live under the prefix (/usr/lib/systemd/system, ...), which
# systemd searches for /usr and /usr/local alike. Relative forms are what install() takes.
set(GPUSTITCH_UNIT_RELDIR "lib/systemd/system")
set(GPUSTITCH_SYSUSERS_RELDIR "lib/sysusers.d")
set(GPUSTITCH_TMPFILES_RELDIR "lib/tmpfiles.d")
set(GPUSTITCH_UNIT_PATH "${CMAKE_INSTALL_PREFIX}/${GPUSTITCH_UNIT_RELDIR}/gpustitchd.service")
set(GPUSTITCH_SYSUSERS_PATH "${CMAKE_INSTALL_PREFIX}/${GPUSTITCH_SYSUSERS_RELDIR}/gpustitch.conf")
set(GPUSTITCH_TMPFILES_PATH "${CMAKE_INSTALL_PREFIX}/${GPUSTITCH_TMPFILES_RELDIR}/gpustitch.conf")
# The daemon's runtime directory and socket are fixed: systemd's RuntimeDirectory= creates
# /run/<name>, whatever the prefix.
set(GPUSTITCH_SERVICE_USER "gpustitch")
set(GPUSTITCH_RUNTIME_DIR "/run/gpustitch")
set(GPUSTITCH_SOCKET_PATH "${GPUSTITCH_RUNTIME_DIR}/gpustitchd.sock")
# Default Prometheus port of the daemon (off unless enabled in gpustitchd.conf).
set(GPUSTITCH_PROMETHEUS_PORT 9477)

# For code that checks the layout (gpustitch doctor).
set(GPUSTITCH_LAYOUT_DEFINITIONS
    GPUSTITCH_PRELOAD_PATH="${GPUSTITCH_PRELOAD_PATH}"
    GPUSTITCH_DAEMON_PATH="${GPUSTITCH_DAEMON_PATH}"
    GPUSTITCH_CLI_PATH="${GPUSTITCH_CLI_PATH}"
    GPUSTITCH_DAEMON_CONF="${GPUSTITCH_DAEMON_CONF}"
    GPUSTITCH_PRELOAD_CONF="${GPUSTITCH_PRELOAD_CONF}"
    GPUSTITCH_UNIT_PATH="${GPUSTITCH_UNIT_PATH}"
    GPUSTITCH_SYSUSERS_PATH="${GPUSTITCH_SYSUSERS_PATH}"
    GPUSTITCH_TMPFILES_PATH="${GPUSTITCH_TMPFILES_PATH}"
    GPUSTITCH_SERVICE_USER="${GPUSTITCH_SERVICE_USER}"
    GPUSTITCH_RUNTIME_DIR="${GPUSTITCH_RUNTIME_DIR}"
    GPUSTITCH_SOCKET_PATH="${GPUSTITCH_SOCKET_PATH}")
