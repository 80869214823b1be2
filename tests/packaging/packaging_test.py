#!/usr/bin/env python3
"""Tests of the Debian package and the node-operation files (packaging/).

Each step is one ctest entry (tests/packaging/CMakeLists.txt):

  build        cpack -G DEB into WORK/deb, then dpkg -x into WORK/root (fixture for the rest)
  contents     the package's file list, modes, control fields, Depends vs the binaries' NEEDED
               libraries, conffiles
  scripts      maintainer scripts: sh -n, shellcheck, and what they do (run with logging stand-ins
               for systemctl & co. in a private mount namespace)
  unit         systemd-analyze verify of the installed unit, with the installed paths, against the
               unpacked tree
  manifests    Kubernetes/Prometheus YAML and the Grafana JSON parse; the JSON is what its
               generator writes
  metrics      every gpustitch_* metric that the dashboard, the scrape config and the alert rules
               use is one the daemon exports (scraped from the built daemon; the metric-name
               header is the fallback when the daemon is not built)
  e2e          the installed daemon and CLI (from WORK/root) against producer processes that run
               with the installed preload library on the simulated backend
  install      dpkg -i / -r / -P for real, in a private mount namespace whose /usr, /etc and /var
               are overlays (the host is untouched): maintainer scripts, `gpustitch doctor` on
               the installed system with its daemon running, removal and purge

Exit status 77 means "skipped" (ctest SKIP_RETURN_CODE): a prerequisite is missing, and the
message says which.
"""
import argparse
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

SKIP = 77


class Skip(Exception):
    pass


class Fail(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise Fail(msg)


def run(cmd, **kw):
    kw.setdefault("check", True)
    kw.setdefault("text", True)
    kw.setdefault("capture_output", True)
    try:
        return subprocess.run(cmd, **kw)
    except subprocess.CalledProcessError as e:
        raise Fail(f"{' '.join(map(str, cmd))} exited {e.returncode}:\n{e.stdout}\n{e.stderr}")


# ---------------------------------------------------------------------------------------------
# Layout of the package (from packaging/InstallLayout.cmake, passed by CMake as --layout JSON).


class Ctx:
    def __init__(self, a):
        self.source = a.source_dir
        self.build = a.build_dir
        self.work = a.work_dir
        self.layout = json.loads(a.layout)
        self.targets = set(t for t in a.targets.split(";") if t)
        self.producer = a.producer
        self.cuda_doubles = a.cuda_doubles
        self.daemon_build = a.daemon
        # The package's architecture: the build machine's, or a cross build's target.
        self.deb_arch = a.deb_arch or run(["dpkg", "--print-architecture"]).stdout.strip()
        self.emulator = a.emulator  # runs the package's programs in a cross build
        self.deb_dir = os.path.join(self.work, "deb")
        self.root = os.path.join(self.work, "root")

    def deb(self):
        debs = glob.glob(os.path.join(self.deb_dir, "*.deb"))
        if len(debs) != 1:
            raise Fail(f"expected one .deb in {self.deb_dir} (run the build step): {debs}")
        return debs[0]

    def version(self):
        with open(os.path.join(self.source, "VERSION")) as f:
            return f.read().strip()

    def rel(self, path):
        return path.lstrip("/")


def step_build(c):
    shutil.rmtree(c.work, ignore_errors=True)
    os.makedirs(c.deb_dir)
    r = run(["cpack", "-G", "DEB", "--config", os.path.join(c.build, "CPackConfig.cmake"),
             "-B", c.deb_dir])
    print(r.stdout.strip().splitlines()[-1])
    deb = c.deb()
    run(["dpkg-deb", "-x", deb, c.root])
    print(f"built {os.path.basename(deb)} ({os.path.getsize(deb)} bytes), unpacked into {c.root}")


def expected_files(c):
    """Files (not directories) the package must hold, with their modes."""
    L = c.layout
    files = {
        L["daemon_conf"]: 0o644,
        L["preload_conf"]: 0o644,
        L["unit"]: 0o644,
        L["sysusers"]: 0o644,
        L["tmpfiles"]: 0o644,
        L["cli"]: 0o755,
        L["bash_completion"]: 0o644,
    }
    if "gpustitch_preload" in c.targets:
        files[L["preload"]] = 0o644
        # The preload library's C API (gpustitch_malloc, ...), installed by preload/.
        if os.path.exists(os.path.join(c.source, "preload/include/gpustitch/gpustitch.h")):
            files[L["includedir"] + "/gpustitch/gpustitch.h"] = 0o644
    if "gpustitchd" in c.targets:
        files[L["daemon"]] = 0o755
    # The Python package (python/gpustitch), beside the CLI's prefix.
    if os.path.exists(os.path.join(c.source, "python/gpustitch/__init__.py")):
        prefix = os.path.dirname(os.path.dirname(L["cli"]))
        files[prefix + "/lib/python3/dist-packages/gpustitch/__init__.py"] = 0o644
    return files


def dpkg_fields(deb):
    out = run(["dpkg-deb", "-f", deb]).stdout
    fields, key = {}, None
    for line in out.splitlines():
        if line.startswith(" ") and key:
            fields[key] += "\n" + line
        else:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


# readelf -h's Machine field for each Debian architecture the package is built for.
ELF_MACHINE = {"amd64": "X86-64", "arm64": "AArch64"}


def step_contents(c):
    deb = c.deb()
    listing = run(["dpkg-deb", "-c", deb]).stdout.splitlines()
    files = {}
    for line in listing:
        parts = line.split()
        perms, owner, path = parts[0], parts[1], parts[-1]
        check(owner == "root/root", f"{path} is owned by {owner}, not root/root")
        if perms.startswith("-"):
            mode = 0
            for i, ch in enumerate(perms[1:10]):
                if ch != "-":
                    mode |= 1 << (8 - i)
            files["/" + path.lstrip("./")] = mode
    want = expected_files(c)
    for path, mode in want.items():
        check(path in files, f"package lacks {path}; it has:\n" + "\n".join(sorted(files)))
        check(files[path] == mode, f"{path} has mode {files[path]:o}, expected {mode:o}")
    doc = c.layout["docdir"]
    extra = [p for p in files if p not in want and not p.startswith(doc + "/")]
    check(not extra, f"package holds files nobody asked for: {extra}")
    for missing in ("gpustitch_preload", "gpustitchd"):
        if missing not in c.targets:
            print(f"note: target {missing} not built on this checkout; its file is not expected")
    print(f"file list: {len(files)} files, all expected ones present with the right modes")

    f = dpkg_fields(deb)
    arch = c.deb_arch
    check(f.get("Package") == "gpustitch", f"Package: {f.get('Package')}")
    check(f.get("Version") == c.version(), f"Version {f.get('Version')} != VERSION {c.version()}")
    check(f.get("Architecture") == arch, f"Architecture {f.get('Architecture')} != {arch}")
    check(re.match(r".+ <[^@\s]+@[^@\s]+>$", f.get("Maintainer", "")),
          f"Maintainer is not 'Name <email>': {f.get('Maintainer')}")
    check(f.get("Description", "").count("\n") >= 2, "Description has no extended text")
    depends = f.get("Depends", "")
    dep_pkgs = {d.strip().split()[0] for d in depends.split(",") if d.strip()}
    check("libc6" in dep_pkgs, f"Depends lacks libc6 (dpkg-shlibdeps did not run?): {depends}")

    # Every library a packaged binary needs is provided by a package in Depends.
    checked = 0
    for path, mode in files.items():
        full = os.path.join(c.root, c.rel(path))
        with open(full, "rb") as fh:
            if fh.read(4) != b"\x7fELF":
                continue
        # Every binary is built for the package's architecture (an arm64 .deb from a cross
        # build holds no build-machine binary).
        machine = re.search(r"Machine:\s+(.+)", run(["readelf", "-h", full]).stdout)
        want_machine = ELF_MACHINE.get(arch)
        check(want_machine and machine and want_machine in machine.group(1),
              f"{path} is built for {machine.group(1) if machine else '?'}, not {arch}")
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]",
                            run(["readelf", "-d", full]).stdout)
        for soname in needed:
            if soname.startswith("ld-linux"):
                continue
            owners = owning_packages(soname)
            check(not owners or owners & dep_pkgs,
                  f"{path} needs {soname} (from {sorted(owners)}) but Depends is: {depends}")
            checked += 1
    print(f"control: Package/Version/Architecture/Maintainer ok; Depends: {depends}")
    print(f"         {checked} NEEDED libraries of the packaged binaries covered by Depends")

    ctl = tempfile.mkdtemp(dir=c.work)
    run(["dpkg-deb", "-e", deb, ctl])
    with open(os.path.join(ctl, "conffiles")) as fh:
        conffiles = sorted(l.strip() for l in fh if l.strip())
    want_conf = sorted([c.layout["daemon_conf"], c.layout["preload_conf"]])
    check(conffiles == want_conf, f"conffiles {conffiles} != {want_conf}")
    for p in conffiles:
        check(p in files, f"conffile {p} is not in the package")
    print(f"conffiles: {conffiles}")

    # The bash completion completes the installed CLI's subcommands and a subcommand's options.
    bindir = os.path.dirname(os.path.join(c.root, c.rel(c.layout["cli"])))
    if c.emulator:
        # A cross build's CLI runs under the emulator: a gpustitch on PATH that starts it so.
        real = os.path.join(bindir, "gpustitch")
        bindir = tempfile.mkdtemp(dir=c.work)
        with open(os.path.join(bindir, "gpustitch"), "w") as fh:
            fh.write(f'#!/bin/sh\nexec {c.emulator} {real} "$@"\n')
        os.chmod(os.path.join(bindir, "gpustitch"), 0o755)
    completion = os.path.join(c.root, c.rel(c.layout["bash_completion"]))
    help_text = run([os.path.join(bindir, "gpustitch"), "--help"]).stdout
    subs = re.findall(r"^  ([a-z][a-z-]*)\s", help_text.split("ubcommands:")[-1], re.M)
    check(subs, f"gpustitch --help lists no subcommands:\n{help_text}")
    script = (f'PATH={bindir}:$PATH; source {completion}; '
              f'COMP_WORDS=(gpustitch ""); COMP_CWORD=1; _gpustitch; echo "${{COMPREPLY[*]}}"; '
              f'COMP_WORDS=(gpustitch {subs[0]} --); COMP_CWORD=2; _gpustitch; '
              f'echo "${{COMPREPLY[*]}}"')
    lines = run(["bash", "-c", script]).stdout.splitlines()
    check(len(lines) == 2 and set(subs) <= set(lines[0].split()),
          f"completion of 'gpustitch ' gave {lines[:1]}, expected {subs}")
    check("--help" in lines[1].split(), f"completion of 'gpustitch {subs[0]} --' gave {lines[1:]}")
    print(f"bash completion: subcommands {subs}; options of {subs[0]}: {lines[1]}")


_owner_cache = {}


def owning_packages(soname):
    """Packages that ship a file named soname (several for multilib: libstdc++6, lib32stdc++6),
    and the virtual packages they provide."""
    if soname not in _owner_cache:
        r = subprocess.run(["dpkg", "-S", "*/" + soname], text=True, capture_output=True)
        owners = set()
        for line in r.stdout.splitlines():
            pkgs, _, path = line.partition(": ")
            if os.path.basename(path) == soname:
                owners.update(p.split(":")[0] for p in pkgs.split(", "))
        # A Depends entry may name a virtual package the owner provides (libspdlog1.10 provides
        # libspdlog1.10-fmt9, which is what its shlibs file puts in Depends).
        names = set(owners)
        for pkg in owners:
            # One line per installed architecture of pkg (multiarch: amd64 and arm64 both).
            q = subprocess.run(["dpkg-query", "-W", "-f=${Provides}\n", pkg], text=True,
                               capture_output=True)
            names.update(p.strip().split()[0] for p in q.stdout.replace("\n", ",").split(",")
                         if p.strip())
        _owner_cache[soname] = names
    return _owner_cache[soname]


# ---------------------------------------------------------------------------------------------
# Maintainer scripts


SHIMS = ["systemd-sysusers", "systemd-tmpfiles", "systemctl", "deb-systemd-helper",
         "deb-systemd-invoke", "useradd"]
TOOLS = ["sh", "getent", "install", "sed", "grep", "mktemp", "chmod", "mv", "rm", "cat"]


def run_script(c, ctl, script, args, systemd_running, shims=SHIMS, preload_text=None):
    """Runs a maintainer script in a private mount namespace: /etc is an overlay (writes vanish),
    /run a fresh tmpfs (with /run/systemd/system when systemd_running). Commands it calls through
    PATH are logging stand-ins. Returns (log lines, /etc/ld.so.preload after, /run listing)."""
    sandbox = tempfile.mkdtemp(dir=c.work)
    bindir = os.path.join(sandbox, "bin")
    os.makedirs(bindir)
    log = os.path.join(sandbox, "calls.log")
    for name in shims:
        with open(os.path.join(bindir, name), "w") as fh:
            fh.write(f'#!/bin/sh\necho "{name} $*" >> {log}\n')
        os.chmod(os.path.join(bindir, name), 0o755)
    for tool in TOOLS:
        os.symlink(shutil.which(tool), os.path.join(bindir, tool))
    for d in ("upper", "work"):
        os.makedirs(os.path.join(sandbox, d))
    result = os.path.join(sandbox, "ld.so.preload.after")
    runlist = os.path.join(sandbox, "run.after")
    setup = [
        f"mount -t overlay overlay -o lowerdir=/etc,upperdir={sandbox}/upper,"
        f"workdir={sandbox}/work /etc",
        "mount -t tmpfs tmpfs /run",
        "mkdir -p /run/gpustitch",
    ]
    if systemd_running:
        setup.append("mkdir -p /run/systemd/system")
    if preload_text is not None:
        with open(os.path.join(sandbox, "preload.in"), "w") as fh:
            fh.write(preload_text)
        setup.append(f"cp {sandbox}/preload.in /etc/ld.so.preload")
    else:
        setup.append("rm -f /etc/ld.so.preload")
    quoted = " ".join("'" + a + "'" for a in args)
    body = (" && ".join(setup) +
            f" && PATH={bindir} sh {os.path.join(ctl, script)} {quoted};"
            f" rc=$?; cat /etc/ld.so.preload > {result} 2>/dev/null;"
            f" ls /run > {runlist}; exit $rc")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", body],
                       text=True, capture_output=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
    if r.returncode != 0:
        raise Fail(f"{script} {args} exited {r.returncode}: {r.stderr}")
    calls = open(log).read().splitlines() if os.path.exists(log) else []
    after = open(result).read() if os.path.exists(result) else None
    run_after = open(runlist).read().split()
    return calls, after, run_after


def step_scripts(c):
    ctl = tempfile.mkdtemp(dir=c.work)
    run(["dpkg-deb", "-e", c.deb(), ctl])
    scripts = ["postinst", "prerm", "postrm"]
    for s in scripts:
        path = os.path.join(ctl, s)
        check(os.path.exists(path), f"control archive lacks {s}")
        check(os.stat(path).st_mode & 0o777 == 0o755, f"{s} is not mode 0755")
        check(open(path).readline().strip() == "#!/bin/sh", f"{s} does not start with #!/bin/sh")
        run(["sh", "-n", path])
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", "-s", "sh"] + [os.path.join(ctl, s) for s in scripts],
                           text=True, capture_output=True)
        check(r.returncode == 0, f"shellcheck:\n{r.stdout}{r.stderr}")
        print("maintainer scripts: sh -n and shellcheck clean")
    else:
        print("maintainer scripts: sh -n clean; shellcheck not installed (tools/install-deps.sh)")

    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0 or os.geteuid() != 0:
        raise Skip("cannot create a mount namespace here (needs root with CAP_SYS_ADMIN), so the "
                   "maintainer scripts were only checked statically")
    L = c.layout
    unit = "gpustitchd.service"

    calls, _, _ = run_script(c, ctl, "postinst", ["configure", ""], systemd_running=False)
    want = [f"systemd-sysusers {L['sysusers']}", f"systemd-tmpfiles --create {L['tmpfiles']}",
            f"deb-systemd-helper unmask {unit}", f"deb-systemd-helper --quiet was-enabled {unit}",
            f"deb-systemd-helper enable {unit}"]
    check(calls == want, f"postinst configure without systemd called {calls}, expected {want}")
    print("postinst configure, no systemd: user, runtime dir, enabled for next boot, not started")

    calls, _, _ = run_script(c, ctl, "postinst", ["configure", ""], systemd_running=True)
    check(calls == want + ["systemctl --system daemon-reload", f"deb-systemd-invoke start {unit}"],
          f"postinst configure with systemd called {calls}")
    calls, _, _ = run_script(c, ctl, "postinst", ["configure", "0.0.1"], systemd_running=True)
    check(calls[-1] == f"deb-systemd-invoke try-restart {unit}",
          f"postinst on upgrade should try-restart: {calls}")
    print("postinst configure, systemd running: reload + start; on upgrade: try-restart")

    calls, _, _ = run_script(c, ctl, "postinst", ["configure", ""], systemd_running=False,
                             shims=["useradd", "deb-systemd-helper"])
    check(any(x.startswith("useradd --system") and x.endswith(L["user"]) for x in calls),
          f"without systemd-sysusers postinst should fall back to useradd: {calls}")
    print("postinst without systemd-sysusers: falls back to useradd")

    lib = L["preload"]
    preload_text = (f"/opt/other/libkeep.so {lib}\n"
                    f"{lib}:/opt/x/libtwo.so\n"
                    f"/usr/local/lib/libgpustitch.so\n")
    calls, after, _ = run_script(c, ctl, "prerm", ["remove"], systemd_running=True,
                                 preload_text=preload_text)
    check(calls == [f"deb-systemd-invoke stop {unit}"], f"prerm remove called {calls}")
    entries = re.split(r"[\s:]+", after.strip())
    check("/opt/other/libkeep.so" in entries and "/opt/x/libtwo.so" in entries,
          f"prerm dropped other preload entries: {after!r}")
    check(not any("libgpustitch" in e for e in entries),
          f"prerm left libgpustitch.so in /etc/ld.so.preload: {after!r}")
    calls, after, _ = run_script(c, ctl, "prerm", ["upgrade", "0.2.0"], systemd_running=True,
                                 preload_text=preload_text)
    check(calls == [] and after == preload_text, f"prerm upgrade touched things: {calls} {after!r}")
    print("prerm remove: stops the daemon, drops only our /etc/ld.so.preload entries; "
          "prerm upgrade: does nothing")

    calls, _, run_after = run_script(c, ctl, "postrm", ["purge"], systemd_running=True)
    check(calls == [f"deb-systemd-helper purge {unit}", f"deb-systemd-helper unmask {unit}"],
          f"postrm purge called {calls}")
    check(os.path.basename(L["runtime_dir"]) not in run_after,
          f"postrm purge left {L['runtime_dir']}")
    calls, _, _ = run_script(c, ctl, "postrm", ["remove"], systemd_running=True)
    check(calls == ["systemctl --system daemon-reload", f"deb-systemd-helper mask {unit}"],
          f"postrm remove called {calls}")
    print("postrm remove: daemon-reload + mask; purge: forget enable state, remove runtime dir")


# ---------------------------------------------------------------------------------------------
# systemd unit


def step_unit(c):
    if not shutil.which("systemd-analyze"):
        raise Skip("systemd-analyze not installed (package systemd, tools/install-deps.sh)")
    # A root to verify against: the unpacked package plus what the unit refers to from outside it
    # (systemd's own targets, /bin/kill for ExecReload=).
    vroot = os.path.join(c.work, "verify-root")
    shutil.rmtree(vroot, ignore_errors=True)
    shutil.copytree(c.root, vroot, symlinks=True)
    host_units = next(d for d in ("/usr/lib/systemd/system", "/lib/systemd/system")
                      if os.path.exists(os.path.join(d, "multi-user.target")))
    shutil.copytree(host_units, os.path.join(vroot, "lib/systemd/system"), symlinks=True,
                    dirs_exist_ok=True)
    os.makedirs(os.path.join(vroot, "bin"), exist_ok=True)
    shutil.copy2(shutil.which("kill") or "/bin/kill", os.path.join(vroot, "bin/kill"))
    daemon = os.path.join(vroot, c.rel(c.layout["daemon"]))
    if not os.path.exists(daemon):
        print(f"note: gpustitchd is not built on this checkout; verifying with a placeholder at "
              f"{c.layout['daemon']}")
        os.makedirs(os.path.dirname(daemon), exist_ok=True)
        with open(daemon, "w") as fh:
            fh.write("#!/bin/sh\n")
        os.chmod(daemon, 0o755)
    r = subprocess.run(["systemd-analyze", "verify", f"--root={vroot}", "--man=no",
                        "--generators=no", c.layout["unit"]], text=True, capture_output=True)
    out = (r.stdout + r.stderr).strip()
    check(r.returncode == 0 and not out, f"systemd-analyze verify (rc {r.returncode}):\n{out}")
    print(f"systemd-analyze verify {c.layout['unit']}: clean")
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", f"--root={vroot}",
                        c.layout["unit"]], text=True, capture_output=True)
    level = [l for l in r.stdout.splitlines() if "Overall exposure level" in l]
    if level:
        print(level[0].strip().lstrip("→ "))

    # What the unit must say, whatever else changes.
    text = open(os.path.join(c.root, c.rel(c.layout["unit"]))).read()
    settings = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            settings.setdefault(k.strip(), []).append(v.strip())
    need = {
        "Type": "notify", "User": c.layout["user"], "NoNewPrivileges": "yes",
        "ProtectSystem": "strict", "ProtectHome": "yes", "Restart": "on-failure",
        "RuntimeDirectory": os.path.basename(c.layout["runtime_dir"]),
        "CapabilityBoundingSet": "CAP_DAC_READ_SEARCH CAP_FOWNER",
        "AmbientCapabilities": "CAP_DAC_READ_SEARCH CAP_FOWNER",
        "ReadOnlyPaths": "/dev", "ReadWritePaths": "/dev/shm", "DevicePolicy": "closed",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    }
    for k, v in need.items():
        check(settings.get(k) == [v], f"unit: {k}={settings.get(k)}, expected {v}")
    for k in ("PrivateDevices", "PrivateIPC", "ProtectProc", "ProcSubset"):
        check(k not in settings, f"unit sets {k}=, which hides /dev/shm or other processes")
    check(settings["ExecStart"][0].split()[0] == c.layout["daemon"],
          f"ExecStart runs {settings['ExecStart']}")
    print("unit: Type=notify, own user, CAP_DAC_READ_SEARCH + CAP_FOWNER only, /dev read-only "
          "except /dev/shm, the host's /dev/shm and /proc left visible")


# ---------------------------------------------------------------------------------------------
# Kubernetes / Prometheus / Grafana


def fleet_files(c):
    pk = os.path.join(c.source, "packaging")
    return (sorted(glob.glob(os.path.join(pk, "kubernetes", "*.yaml"))),
            sorted(glob.glob(os.path.join(pk, "prometheus", "*.yml"))),
            os.path.join(pk, "grafana", "gpustitch-dashboard.json"))


def step_manifests(c):
    try:
        import yaml
    except ImportError:
        raise Skip("python3-yaml not installed (tools/install-deps.sh)")
    k8s, prom, dash = fleet_files(c)
    kinds = []
    for f in k8s:
        for doc in yaml.safe_load_all(open(f)):
            check(isinstance(doc, dict) and "apiVersion" in doc and "kind" in doc,
                  f"{f}: a document without apiVersion/kind")
            kinds.append(doc["kind"])
    check("DaemonSet" in kinds, "no DaemonSet in packaging/kubernetes")
    ds = next(d for f in k8s for d in yaml.safe_load_all(open(f)) if d["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    check(spec.get("hostPID") is True, "DaemonSet must share the node's pid namespace")
    check(spec.get("nodeSelector"), "DaemonSet has no nodeSelector for GPU nodes")
    shm = [v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == "/dev/shm"]
    check(shm, "DaemonSet does not mount the node's /dev/shm")
    daemon = spec["containers"][0]
    sc = daemon["securityContext"]
    check(sc["capabilities"]["drop"] == ["ALL"] and
          sorted(sc["capabilities"]["add"]) == ["DAC_READ_SEARCH", "FOWNER"],
          f"daemon capabilities: {sc['capabilities']}")
    check(sc.get("allowPrivilegeEscalation") is False and not sc.get("privileged"),
          "daemon container may escalate privileges")
    check(daemon.get("resources", {}).get("limits"), "daemon container has no resource limits")
    print(f"kubernetes: {len(k8s)} files, kinds {sorted(set(kinds))}; DaemonSet hostPID, "
          f"/dev/shm, caps drop ALL + DAC_READ_SEARCH, FOWNER")
    for f in prom:
        doc = yaml.safe_load(open(f))
        check(isinstance(doc, dict) and ("scrape_configs" in doc or "groups" in doc or
                                         ("tests" in doc and "rule_files" in doc)),
              f"{f}: neither scrape_configs, rule groups nor promtool rule tests")
    print(f"prometheus: {[os.path.basename(f) for f in prom]} parse")
    d = json.load(open(dash))
    check(d.get("panels") and d.get("title"), "dashboard without panels")
    gen = os.path.join(c.source, "packaging", "grafana", "generate_dashboard.py")
    regenerated = run([sys.executable, gen]).stdout
    check(json.loads(regenerated) == d,
          "gpustitch-dashboard.json differs from generate_dashboard.py's output: regenerate it")
    print(f"grafana: {len(d['panels'])} panels, matches its generator")


def metrics_used(c):
    """gpustitch_* metric names in every PromQL expression of the fleet files."""
    import yaml
    _, prom, dash = fleet_files(c)
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "query", "definition") and isinstance(v, str):
                    exprs.append(v)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.load(open(dash)))
    for f in prom:
        walk(yaml.safe_load(open(f)))
    used = set()
    for e in exprs:
        used.update(re.findall(r"\bgpustitch_[a-z0-9_]+", e))
    return used, len(exprs)


def parse_exposition(text):
    """{family name: type} and the samples [(name, labels dict, value)] of Prometheus text."""
    types, samples = {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(None, 3)
            types[name] = typ
        elif line and not line.startswith("#"):
            m = re.match(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)', line)
            if not m:
                raise Fail(f"unparsable exposition line: {line!r}")
            labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
            samples.append((m.group(1), labels, float(m.group(4))))
    return types, samples


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """gpustitchd with a private socket and Prometheus port, its config written to a temp dir."""

    def __init__(self, c, binary, tag, prefix=()):
        """prefix: a command that runs the daemon (setpriv with the unit's user and rights)."""
        self.dir = tempfile.mkdtemp(prefix=f"gpustitchd-{tag}-", dir="/tmp")
        os.chmod(self.dir, 0o755)
        rundir = os.path.join(self.dir, "run")
        os.makedirs(rundir)
        os.chmod(rundir, 0o777)
        self.socket = os.path.join(rundir, "gpustitchd.sock")
        self.port = free_port()
        self.config = os.path.join(self.dir, "gpustitchd.conf")
        with open(self.config, "w") as fh:
            fh.write(f"socket = {self.socket}\n"
                     f"prometheus_port = {self.port}\n"
                     f"prometheus_address = 127.0.0.1\n"
                     f"sample_interval_ms = 100\n")
        self.log = open(os.path.join(self.dir, "daemon.log"), "w+")
        self.proc = subprocess.Popen(list(prefix) + [binary, "--config", self.config],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 15
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise Fail(f"gpustitchd exited {self.proc.returncode}:\n{self.output()}")
            try:
                self.scrape()
                if os.path.exists(self.socket):
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise Fail(f"gpustitchd did not serve its socket and /metrics within 15 s:\n{self.output()}")

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def scrape(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise Fail("gpustitchd did not exit within 10 s of SIGTERM")
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.proc.returncode


# The producer's allocation pattern (tests/packaging/producer.c): on a 64 MiB simulated device,
# 16 x 4 MiB, every other one freed, then 16 MiB (only possible by stitching 4 free pieces), then
# 64 MiB (an out-of-memory), leaving 8 x 4 MiB + 16 MiB allocated.
PRODUCER_CONF = "backend:sim,sim_capacity_mb:64,publish_interval_ms:50"
PRODUCER_ALLOCATED = 48 * 1024 * 1024


class Producers:
    def __init__(self, c, preload, count):
        env = dict(os.environ, LD_PRELOAD=preload, GPUSTITCH_CONF=PRODUCER_CONF,
                   LD_LIBRARY_PATH=c.cuda_doubles)
        self.procs = []
        for _ in range(count):
            p = subprocess.Popen([c.producer], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)
            self.procs.append(p)
        for p in self.procs:
            line = p.stdout.readline().strip()
            if line != "READY":
                p.kill()
                raise Fail(f"producer said {line!r} instead of READY: {p.stderr.read()}")
        self.pids = [p.pid for p in self.procs]

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.stdin.close()
        for p in self.procs:
            try:
                rc = p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                raise Fail(f"producer {p.pid} did not exit")
            check(rc == 0, f"producer {p.pid} exited {rc}: {p.stderr.read()}")


def wait_for(what, fn, timeout=15):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        ok, last = fn()
        if ok:
            return last
        time.sleep(0.2)
    raise Fail(f"timed out waiting for {what}; last seen: {last}")


def exported_by_daemon(c):
    """Metric names the built daemon exports while a producer runs, or None without a daemon."""
    if not c.daemon_build or not os.path.exists(c.daemon_build):
        return None
    if not c.producer or "gpustitch_preload" not in c.targets:
        return None
    d = Daemon(c, c.daemon_build, "metrics")
    prod = None
    try:
        prod = Producers(c, c.layout["preload_build"], 1)
        pid = str(prod.pids[0])

        def seen():
            types, samples = parse_exposition(d.scrape())
            return any(l.get("pid") == pid for _, l, _ in samples), types
        types = wait_for("the producer's series", seen)
        return set(types)
    finally:
        if prod:
            prod.stop()
        d.stop()


def exported_by_header(c):
    """Metric names listed in the daemon's metric-name header under shared/include/gpustitch/."""
    names = set()
    headers = []
    for h in glob.glob(os.path.join(c.source, "shared", "include", "gpustitch", "**", "*.h"),
                       recursive=True):
        found = set(re.findall(r'"(gpustitch_[a-z0-9_]+)"', open(h).read()))
        if "gpustitch_allocated_bytes" in found:
            names |= found
            headers.append(os.path.relpath(h, c.source))
    return (names, headers) if names else (None, [])


def step_metrics(c):
    try:
        import yaml  # noqa: F401
    except ImportError:
        raise Skip("python3-yaml not installed (tools/install-deps.sh)")
    used, nexpr = metrics_used(c)
    check(used, "no gpustitch_* metric found in the dashboard or the Prometheus files")
    exported = exported_by_daemon(c)
    if exported is not None:
        source = "scraped from the built gpustitchd with a producer running"
    else:
        exported, headers = exported_by_header(c)
        if exported is None:
            raise Skip(f"neither the daemon (target gpustitchd + gpustitch_preload) nor a metric-"
                       f"name header under shared/include/gpustitch/ exists on this checkout: "
                       f"cannot check the {len(used)} metrics the dashboard uses")
        source = f"read from {', '.join(headers)} (daemon not built)"
    unknown = sorted(used - exported)
    check(not unknown, f"the dashboard/Prometheus files use metrics the daemon does not export "
                       f"({source}): {unknown}\nexported: {sorted(exported)}")
    unused = sorted(n for n in exported if n.startswith("gpustitch_") and n not in used)
    print(f"{len(used)} metrics used in {nexpr} expressions, all exported ({source})")
    if unused:
        print(f"exported but not on the dashboard: {unused}")


# ---------------------------------------------------------------------------------------------
# End to end from the unpacked package


CLI_SOCKET_ENV = "GPUSTITCH_SOCKET"


def step_e2e(c):
    missing = [t for t in ("gpustitch_preload", "gpustitchd") if t not in c.targets]
    if missing or not c.producer:
        raise Skip(f"targets {missing or ['fake_cudart (tests/preload)']} are not built on this "
                   f"checkout: the installed daemon and CLI cannot be run end to end")
    L = c.layout
    daemon_bin = os.path.join(c.root, c.rel(L["daemon"]))
    cli = os.path.join(c.root, c.rel(L["cli"]))
    preload = os.path.join(c.root, c.rel(L["preload"]))
    for p in (daemon_bin, cli, preload):
        check(os.path.exists(p), f"{p} missing from the unpacked package")

    # Run the daemon with the rights the unit gives it: an unprivileged user (the unit's own user
    # does not exist here: nobody stands in) holding exactly the unit's ambient capabilities. The
    # producers run as root, so their records are 0600 root files: reading and reaping them works
    # only if those capabilities are the right ones.
    unit = open(os.path.join(c.root, c.rel(L["unit"]))).read()
    caps = re.search(r"^AmbientCapabilities=(.+)$", unit, re.M).group(1).split()
    capspec = "-all," + ",".join("+" + cap.lower().removeprefix("cap_") for cap in caps)
    prefix = []
    if os.geteuid() == 0 and shutil.which("setpriv"):
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                  f"--inh-caps={capspec}", f"--ambient-caps={capspec}",
                  f"--bounding-set={capspec}", "--"]
        print(f"daemon runs as uid 65534 with only {' '.join(caps)} (the unit's ambient set)")
    else:
        print("note: not root or no setpriv: the daemon runs as this user, rights not checked")
    d = Daemon(c, daemon_bin, "e2e", prefix)
    prod = None
    try:
        prod = Producers(c, preload, 2)
        pids = [str(p) for p in prod.pids]
        print(f"installed gpustitchd on 127.0.0.1:{d.port}, producers {pids} preloading {preload}")

        # A sample may predate the producer's last publish (the daemon and the producers run on
        # their own intervals), so wait for the figures the producers hold once READY.
        def all_published():
            _, samples = parse_exposition(d.scrape())
            alloc = {l["pid"]: v for n, l, v in samples
                     if n == "gpustitch_allocated_bytes" and l.get("pid") in pids}
            ooms = {l["pid"]: v for n, l, v in samples
                    if n == "gpustitch_oom_total" and l.get("pid") in pids}
            done = (len(alloc) == len(pids) and all(v == PRODUCER_ALLOCATED for v in alloc.values())
                    and len(ooms) == len(pids) and all(v >= 1 for v in ooms.values()))
            return done, {"allocated": alloc, "ooms": ooms}
        wait_for(f"both producers in /metrics with gpustitch_allocated_bytes {PRODUCER_ALLOCATED} "
                 f"and their out-of-memory counted", all_published)
        _, samples = parse_exposition(d.scrape())

        def value(name, pid):
            return sum(v for n, l, v in samples if n == name and l.get("pid") == pid)
        for pid in pids:
            check(value("gpustitch_stitches_total", pid) >= 1, f"pid {pid}: no stitch counted")
            check(value("gpustitch_oom_total", pid) >= 1, f"pid {pid}: the OOM was not counted")
            check(value("gpustitch_reserved_bytes", pid) >= PRODUCER_ALLOCATED,
                  f"pid {pid}: reserved < allocated")
            users = {l.get("user") for n, l, v in samples if l.get("pid") == pid}
            commands = {l.get("command") for n, l, v in samples if l.get("pid") == pid}
            check(users and all(users), f"pid {pid}: series without a user label")
            check(any("producer" in (cmd or "") for cmd in commands),
                  f"pid {pid}: command label {commands} does not name the producer")
        print(f"/metrics: allocated {PRODUCER_ALLOCATED} bytes per producer, stitches and OOMs "
              f"counted, user/command labels set")

        env = dict(os.environ, **{CLI_SOCKET_ENV: d.socket})
        # --daemon: answer from the daemon only (not by reading /dev/shm directly).
        r = run([cli, "ps", "--json", "--daemon"], env=env)
        listed = json.dumps(json.loads(r.stdout))
        for pid in pids:
            check(re.search(rf'"pid":\s*{pid}\b', listed), f"gpustitch ps --json lacks pid {pid}:\n"
                                                          f"{r.stdout}")
        r = run([cli, "ps", "--daemon"], env=env)
        check(all(pid in r.stdout for pid in pids), f"gpustitch ps lacks the producers:\n{r.stdout}")
        print(f"installed gpustitch ps (text and --json) lists both producers")

        d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        check(d.proc.poll() is None, f"gpustitchd died on SIGHUP:\n{d.output()}")
        d.scrape()
        print("SIGHUP: daemon reloads and keeps serving")

        # One producer dies without cleaning up (SIGKILL): the daemon must remove its record.
        killed = prod.procs[0]
        records = glob.glob(f"/dev/shm/gpustitch.*.{killed.pid}.*")
        check(len(records) == 1, f"expected one record of pid {killed.pid}: {records}")
        killed.kill()
        killed.wait()
        prod.procs = prod.procs[1:]
        prod.stop()
        prod = None
        wait_for(f"the daemon to remove {records[0]} of the killed producer",
                 lambda: (not os.path.exists(records[0]), records[0]))
        print("record of a SIGKILLed producer removed by the daemon (reap)")

        def gone():
            _, samples = parse_exposition(d.scrape())
            left = {l["pid"] for n, l, v in samples if l.get("pid") in pids}
            return not left, left
        wait_for("the exited producers to leave /metrics", gone)
        print("exited producers disappear from /metrics")
    finally:
        if prod:
            prod.stop()
        rc = d.stop()
    check(rc == 0, f"gpustitchd exited {rc} on SIGTERM")
    print("SIGTERM: daemon exits 0")


INSTALL_SCRIPT = r"""
set -u
W=$1; DEB=$2; OUT=$3; LIB=$4; CLI=$5; DAEMON=$6; SOCKET=$7
for d in usr etc var; do
  mkdir -p "$W/$d-upper" "$W/$d-work"
  mount -t overlay overlay -o "lowerdir=/$d,upperdir=$W/$d-upper,workdir=$W/$d-work" "/$d" || exit 90
done
mount -t tmpfs tmpfs /run || exit 90
dpkg -i "$DEB" >"$OUT/dpkg-i.log" 2>&1 || { echo "dpkg -i failed" >&2; cat "$OUT/dpkg-i.log" >&2; exit 1; }
getent passwd gpustitch >"$OUT/user" || true
stat -c '%U %a' /run/gpustitch >"$OUT/rundir" 2>&1 || true
ls /etc/systemd/system/multi-user.target.wants/ >"$OUT/wants" 2>&1 || true
if [ -x "$DAEMON" ]; then
  "$DAEMON" >"$OUT/daemon.log" 2>&1 &
  daemon=$!
  i=0; while [ ! -S "$SOCKET" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
fi
"$CLI" doctor --json >"$OUT/doctor.json" 2>"$OUT/doctor.err"
echo $? >"$OUT/doctor.rc"
if [ -x "$DAEMON" ]; then
  kill "$daemon"; wait "$daemon"
  echo $? >"$OUT/daemon.rc"
fi
# Node-wide preloading, then removal: prerm must take the entry out.
echo "$LIB" >>/etc/ld.so.preload
dpkg -r gpustitch >"$OUT/dpkg-r.log" 2>&1 || { echo "dpkg -r failed" >&2; cat "$OUT/dpkg-r.log" >&2; exit 1; }
cat /etc/ld.so.preload >"$OUT/preload-after-remove" 2>/dev/null || true
for f in "$LIB" "$DAEMON" "$CLI" /etc/gpustitch/gpustitchd.conf; do
  [ -e "$f" ] && echo "$f" >>"$OUT/after-remove"
done
dpkg -P gpustitch >"$OUT/dpkg-P.log" 2>&1 || { echo "dpkg -P failed" >&2; cat "$OUT/dpkg-P.log" >&2; exit 1; }
[ -e /etc/gpustitch ] && echo /etc/gpustitch >>"$OUT/after-purge"
exit 0
"""


def step_install(c):
    if os.geteuid() != 0 or subprocess.run(["unshare", "--mount", "true"],
                                           capture_output=True).returncode != 0:
        raise Skip("needs root and mount namespaces (unshare -m) to install the package into "
                   "overlays of /usr, /etc and /var")
    work = os.path.realpath(c.work)
    if any(work == d or work.startswith(d + "/") for d in ("/usr", "/etc", "/var", "/run")):
        raise Skip(f"the build directory {work} lies under a directory this test overlays")
    L = c.layout
    sandbox = tempfile.mkdtemp(dir=c.work)
    out = os.path.join(sandbox, "out")
    os.makedirs(out)
    script = os.path.join(sandbox, "install.sh")
    with open(script, "w") as fh:
        fh.write(INSTALL_SCRIPT)
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", script, sandbox,
                        c.deb(), out, L["preload"], L["cli"], L["daemon"], L["socket"]],
                       text=True, capture_output=True, timeout=240)
    check(r.returncode != 90, f"could not set up the overlays: {r.stderr}")
    check(r.returncode == 0, f"install script failed ({r.returncode}):\n{r.stdout}{r.stderr}")

    def read(name):
        path = os.path.join(out, name)
        return open(path).read() if os.path.exists(path) else ""

    check(read("user").startswith(L["user"] + ":"),
          f"postinst did not create the user {L['user']}: {read('user')!r}\n{read('dpkg-i.log')}")
    check(read("rundir").split() == [L["user"], "755"],
          f"{L['runtime_dir']} is {read('rundir')!r}, expected owner {L['user']} mode 755")
    check("gpustitchd.service" in read("wants").split(),
          f"the unit was not enabled (multi-user.target.wants: {read('wants')!r})")
    print(f"dpkg -i: user {L['user']} created, {L['runtime_dir']} made, unit enabled, nothing "
          f"started (no systemd)")

    try:
        doctor = json.loads(read("doctor.json") or "{}")
    except json.JSONDecodeError:
        doctor = {}
    checks = {ch["check"]: ch for ch in doctor.get("checks", [])}
    full = all(t in c.targets for t in ("gpustitch_preload", "gpustitchd"))
    if "installation" in checks and not full:
        print("note: preload library or daemon not built on this checkout: the installed doctor's "
              "verdict is not checked")
    elif "installation" in checks:
        inst = checks["installation"]
        check(inst["status"] == "ok",
              f"gpustitch doctor on the installed system: installation {inst['status']}:\n" +
              "\n".join(inst["details"]) + f"\ndaemon log:\n{read('daemon.log')}")
        print(f"gpustitch doctor (installed, daemon running): installation ok, "
              f"{len(inst['details'])} items:")
        for line in inst["details"]:
            print(f"    {line}")
    else:
        print(f"note: this CLI's doctor has no installation check (doctor.h absent); it said: "
              f"{sorted(checks)} {read('doctor.err').strip()}")
    if "gpustitchd" in c.targets:
        check(read("daemon.rc").strip() == "0", f"installed gpustitchd exited "
                                                f"{read('daemon.rc')} on SIGTERM:\n"
                                                f"{read('daemon.log')}")

    check("libgpustitch" not in read("preload-after-remove"),
          f"dpkg -r left the library in /etc/ld.so.preload: {read('preload-after-remove')!r}")
    left = read("after-remove").split()
    check(left == [L["daemon_conf"]],
          f"after dpkg -r expected only the conffiles to remain, found {left}")
    check(not read("after-purge").strip(), "dpkg -P left /etc/gpustitch")
    print("dpkg -r: binaries and library gone, /etc/ld.so.preload entry removed, conffiles kept; "
          "dpkg -P: /etc/gpustitch gone")


STEPS = {"build": step_build, "contents": step_contents, "scripts": step_scripts,
         "unit": step_unit, "manifests": step_manifests, "metrics": step_metrics,
         "e2e": step_e2e, "install": step_install}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=sorted(STEPS))
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--layout", required=True, help="JSON object of installed paths")
    ap.add_argument("--targets", default="", help="built targets, ;-separated")
    ap.add_argument("--producer", default="")
    ap.add_argument("--cuda-doubles", default="",
                    help="LD_LIBRARY_PATH with the CUDA runtime/driver test doubles")
    ap.add_argument("--daemon", default="", help="the built (not installed) gpustitchd")
    ap.add_argument("--deb-arch", default="",
                    help="the package's Debian architecture (default: dpkg's, the build machine)")
    ap.add_argument("--emulator", default="",
                    help="a cross build's emulator (CMAKE_CROSSCOMPILING_EMULATOR), for the CLI")
    a = ap.parse_args()
    try:
        STEPS[a.step](Ctx(a))
    except Skip as e:
        print(f"SKIPPED: {e}")
        return SKIP
    except Fail as e:
        print(f"FAILED: {e}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
