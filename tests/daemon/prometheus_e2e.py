#!/usr/bin/env python3
"""A real Prometheus scraping gpustitchd, and every PromQL expression we ship evaluated through it.

  prometheus_e2e.py --source-dir S --daemon D --producer P --preload L --cuda-libs DIRS

Checks, in order:
  1. promtool: `check rules` and `test rules` on packaging/prometheus/gpustitch-rules.yml and its
     unit tests, `check config` on the generated configuration and on the static job of
     packaging/prometheus/gpustitch-scrape.yml (Debian's Prometheus is built without Kubernetes
     service discovery, so the file's kubernetes_sd job cannot be checked with its promtool).
  2. gpustitchd (metrics on a free loopback port) and three CUDA programs (preload_producer under
     libgpustitch.so, simulated backend) with known figures, on two simulated GPUs that a made-up
     driver list names GPU 0 and GPU 1:
        A  GPU 0  256 + 128 MiB live
        B  GPU 1  64 MiB live, one out-of-memory error (SIGUSR2) once Prometheus watches
        C  GPU 0  1 GiB live, 6 GiB allocated and freed (cached: fragmentation above 0.8)
  3. Prometheus (scrape and rule evaluation every second, storage in a scratch directory) with
     the rules file, a job for gpustitchd and one for a port where nothing listens (daemon down).
  4. Every expression in the Grafana dashboard (panel targets and template variables) and in the
     rules file, through /api/v1/query (label_values() through /api/v1/label/../values): the
     series (by pid or GPU) and values each must give. An expression without an expectation here
     fails the test, so a new panel or rule cannot go untested. Finally /api/v1/alerts: the
     out-of-memory alert fires for B, fragmentation and daemon-down are pending (their `for`).

Exit status 0 passed, 1 failed, 77 skipped: Prometheus is not installed (tools/install-deps.sh
installs it). With GPUSTITCH_REQUIRE_PROMETHEUS=1 (CI sets it) a missing Prometheus fails.
"""
import argparse
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
import urllib.parse
import urllib.request

SKIP = 77
MiB = 1 << 20
GiB = 1 << 30
CAPACITY_MB = 16384


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what, f, timeout=30.0, poll=0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = f()
            if last:
                return last
        except (OSError, ValueError, KeyError) as e:
            last = e
        time.sleep(poll)
    raise Failure(f"timed out waiting for {what} (last: {last!r})")


def parse_exposition(text):
    """{(name, frozenset(labels)): value} of a text exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$', line)
        check(m, f"unparsable exposition line: {line}")
        labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), frozenset(labels.items()))] = float(m.group(3))
    return out


class Prometheus:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def api(self, path, **params):
        url = f"{self.base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        answer = json.loads(http_get(url))
        check(answer.get("status") == "success", f"{path} {params}: {answer}")
        return answer["data"]

    def query(self, expr):
        data = self.api("/api/v1/query", query=expr)
        check(data["resultType"] == "vector", f"{expr}: result type {data['resultType']}")
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]


# ---- what the producers are known to hold ------------------------------------------------------

class Truth:
    """The producers' known figures, and the daemon's own exposition for what the pool decides
    (reserved, cached, largest blocks: gauges that stay put while the producers are idle)."""

    def __init__(self, pids, gpu_of, oom_pid, frag_pid, exposition, instance, dead_instance, user):
        self.pids, self.gpu_of, self.oom_pid, self.frag_pid = pids, gpu_of, oom_pid, frag_pid
        self.instance, self.dead_instance, self.user = instance, dead_instance, user
        self.allocated = {pids["A"]: 384 * MiB, pids["B"]: 64 * MiB, pids["C"]: 1024 * MiB}
        self.per_pid = {}  # metric -> {pid: value}
        self.per_gpu = {}  # metric -> {gpu: value}
        self.commands = set()
        for (name, labels), v in exposition.items():
            l = dict(labels)
            if "pid" in l:
                self.per_pid.setdefault(name, {})[l["pid"]] = v
                self.commands.add(l["command"])
            elif "gpu" in l:
                self.per_gpu.setdefault(name, {})[l["gpu"]] = v

    def pid_values(self, metric):
        return self.per_pid[metric]


def by(result, label):
    out = {}
    for metric, value in result:
        key = metric.get(label, "")
        check(key not in out, f"two series with {label}={key}: {result}")
        out[key] = value
    return out


def close(a, b, rel=1e-6):
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def expect_per_pid(t, metric):
    def f(result):
        got = by(result, "pid")
        want = t.pid_values(metric)
        check(set(got) == set(want), f"pids {sorted(got)}, want {sorted(want)}")
        for pid, v in want.items():
            check(close(got[pid], v), f"pid {pid}: {got[pid]}, want {v}")
        for metric_labels, _ in result:
            check(metric_labels.get("gpu") == t.gpu_of[metric_labels["pid"]],
                  f"pid {metric_labels['pid']} labelled gpu {metric_labels.get('gpu')}")
        return f"{len(got)} processes, as exported"
    return f


def expect_single(value_of):
    def f(result):
        check(len(result) == 1, f"{len(result)} series, want 1: {result}")
        want = value_of()
        check(close(result[0][1], want), f"{result[0][1]}, want {want}")
        return f"{result[0][1]:g}"
    return f


def expect_counter_change(t, oom=False):
    """increase()/rate() per process over the whole run: only B's OOM counter moved."""
    def f(result):
        got = by(result, "pid")
        check(set(got) == set(t.allocated), f"pids {sorted(got)}, want {sorted(t.allocated)}")
        for pid, v in got.items():
            if oom and pid == t.oom_pid:
                check(v > 0, f"pid {pid}: {v}, want > 0 (its OOM)")
            else:
                check(v == 0, f"pid {pid}: {v}, want 0 (idle)")
        return "only the OOM moved" if oom else "all idle: 0"
    return f


def expectations(t):
    """(panel title, refId) / variable / alert -> checker of the query's result."""
    a, b, c = t.pids["A"], t.pids["B"], t.pids["C"]
    pid = t.pid_values
    reserved_on = lambda g: sum(v for p, v in pid("gpustitch_reserved_bytes").items()
                                if t.gpu_of[p] == g)

    def allocated_exact(result):
        got = by(result, "pid")
        check(got == {p: float(v) for p, v in t.allocated.items()},
              f"allocated {got}, want {t.allocated}")
        return "exactly what each producer allocated"

    def device_memory(metric, want_of):
        def f(result):
            got = by(result, "gpu")
            check(set(got) == {"0", "1"}, f"GPUs {sorted(got)}, want 0 and 1 (one series each)")
            for g in got:
                check(close(got[g], want_of(g)), f"gpu {g}: {got[g]}, want {want_of(g)}")
            names = {m.get("modelName") for m, _ in result}
            check(names == {"NVIDIA H200"}, f"modelName {names}")
            return "one series per GPU"
        return f

    def oom_alert(result):
        check([m["pid"] for m, _ in result] == [b], f"series {result}, want pid {b} only")
        check(result[0][1] >= 1, f"increase {result[0][1]}, want >= 1")
        return f"pid {b}: {result[0][1]:.2f}"

    def frag_alert(result):
        check([m["pid"] for m, _ in result] == [c], f"series {result}, want pid {c} only")
        want = pid("gpustitch_fragmentation_ratio")[c]
        check(close(result[0][1], want) and want > 0.8, f"{result[0][1]}, want {want} > 0.8")
        return f"pid {c}: {result[0][1]:.3f}"

    def daemon_down(result):
        check([(m["instance"], v) for m, v in result] == [(t.dead_instance, 0.0)],
              f"series {result}, want {t.dead_instance} only")
        return t.dead_instance

    frag = pid("gpustitch_fragmentation_ratio")
    return {
        ("Processes", "A"): expect_single(lambda: 3),
        ("Reserved", "A"): expect_single(lambda: sum(pid("gpustitch_reserved_bytes").values())),
        ("Allocated", "A"): expect_single(lambda: sum(t.allocated.values())),
        ("Fragmentation (worst process)", "A"): expect_single(lambda: frag[c]),
        ("OOMs (range)", "A"): lambda r: (check(len(r) == 1 and r[0][1] >= 1, f"{r}"), "≥ 1")[1],
        ("Stitches (range)", "A"): expect_single(lambda: 0),
        ("Fragmentation per process", "A"): expect_per_pid(t, "gpustitch_fragmentation_ratio"),
        ("Reserved vs allocated per process", "A"): expect_per_pid(t, "gpustitch_reserved_bytes"),
        ("Reserved vs allocated per process", "B"): allocated_exact,
        ("Largest possible allocation per process", "A"):
            expect_per_pid(t, "gpustitch_largest_possible_bytes"),
        ("Largest possible allocation per process", "B"):
            expect_per_pid(t, "gpustitch_largest_free_block_bytes"),
        ("Cached and pending per process", "A"): expect_per_pid(t, "gpustitch_cached_bytes"),
        ("Cached and pending per process", "B"): expect_per_pid(t, "gpustitch_pending_bytes"),
        ("Out-of-memory errors", "A"): expect_counter_change(t, oom=True),
        ("Stitches", "A"): expect_counter_change(t),
        ("Stitched bytes", "A"): expect_counter_change(t),
        ("Trims", "A"): expect_counter_change(t),
        ("Trims", "B"): expect_counter_change(t),
        ("Allocation rate and how it was served", "A"): expect_counter_change(t),
        ("Allocation rate and how it was served", "B"): expect_counter_change(t),
        ("Allocation rate and how it was served", "C"): expect_counter_change(t),
        ("Allocation rate and how it was served", "D"): expect_counter_change(t),
        # The OOM's allocation tried the driver (and trimmed) inside the window; the rest idle.
        ("Time in the driver's memory API", "A"): expect_counter_change(t, oom=True),
        ("Driver memory-API calls", "A"): expect_counter_change(t, oom=True),
        ("Device memory", "A"):
            device_memory("free", lambda g: t.per_gpu["gpustitch_device_free_bytes"][g]),
        ("Device memory", "B"): device_memory("total", lambda g: CAPACITY_MB * MiB),
        ("Device memory", "C"): device_memory("reserved", reserved_on),
        ("Peaks per process", "A"): expect_per_pid(t, "gpustitch_peak_reserved_bytes"),
        ("Peaks per process", "B"): expect_per_pid(t, "gpustitch_peak_allocated_bytes"),
        ("Processes now", "A"): expect_per_pid(t, "gpustitch_reserved_bytes"),
        ("Processes now", "B"): allocated_exact,
        ("Processes now", "C"): expect_per_pid(t, "gpustitch_fragmentation_ratio"),
        ("Processes now", "D"): expect_per_pid(t, "gpustitch_largest_possible_bytes"),
        ("Processes now", "E"): expect_per_pid(t, "gpustitch_oom_total"),
        "var:instance": {t.instance},
        "var:user": {t.user},
        "var:command": t.commands,
        "alert:GpustitchOutOfMemory": oom_alert,
        "alert:GpustitchHighFragmentation": frag_alert,
        "alert:GpustitchDaemonDown": daemon_down,
    }


# Grafana's variables, as a dashboard with every value selected and a range covering the run.
GRAFANA = {"$instance": ".*", "$user": ".*", "$command": ".*", "$__range": "5m",
           "$__rate_interval": "5m"}


def grafana_expr(expr):
    for k in sorted(GRAFANA, key=len, reverse=True):
        expr = expr.replace(k, GRAFANA[k])
    check("$" not in expr, f"a Grafana variable this test does not know: {expr}")
    return expr


def shipped_expressions(source):
    """[(key, expr, kind)] of the dashboard and the rules file."""
    import yaml
    out = []
    dash = json.load(open(os.path.join(source, "packaging/grafana/gpustitch-dashboard.json")))
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            out.append(((panel["title"], target["refId"]), target["expr"], "query"))
    for var in dash["templating"]["list"]:
        if var.get("type") == "query":
            out.append((f"var:{var['name']}", var["query"]["query"], "label_values"))
    rules = yaml.safe_load(open(os.path.join(source, "packaging/prometheus/gpustitch-rules.yml")))
    for group in rules["groups"]:
        for rule in group["rules"]:
            out.append((f"alert:{rule['alert']}", rule["expr"], "query"))
    return out


def label_values(prom, query):
    m = re.fullmatch(r'label_values\((.*),\s*([a-zA-Z_]+)\)', query.strip())
    check(m, f"not a label_values() query: {query}")
    return set(prom.api(f"/api/v1/label/{m.group(2)}/values",
                        **{"match[]": grafana_expr(m.group(1))}))


# ---- the run ---------------------------------------------------------------------------------

def promtool_checks(promtool, source, work, config):
    prom_dir = os.path.join(source, "packaging/prometheus")
    import yaml
    scrape = yaml.safe_load(open(os.path.join(prom_dir, "gpustitch-scrape.yml")))
    static = {"scrape_configs": [j for j in scrape["scrape_configs"] if "static_configs" in j]}
    check(static["scrape_configs"], "gpustitch-scrape.yml has no static job")
    static_file = os.path.join(work, "scrape-static.yml")
    yaml.safe_dump(static, open(static_file, "w"))
    for args, cwd in ((["check", "rules", "gpustitch-rules.yml"], prom_dir),
                      (["test", "rules", "gpustitch-rules.test.yml"], prom_dir),
                      (["check", "config", config], work),
                      (["check", "config", static_file], work)):
        r = subprocess.run([promtool] + args, cwd=cwd, capture_output=True, text=True)
        check(r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}{r.stderr}")
        print(f"promtool {' '.join(args)}: ok")


def start_producer(args, env, specs, gpu_name):
    e = dict(os.environ)
    e.update(env)
    e["GPUSTITCH_CONF"] += f",sim_shared:{gpu_name}"
    p = subprocess.Popen([args.producer] + specs, env=e, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    check(line == f"READY {p.pid}", f"producer {specs}: {line!r}")
    return p


def run(args):
    prometheus = shutil.which("prometheus")
    promtool = shutil.which("promtool")
    if not prometheus or not promtool:
        why = "prometheus/promtool not installed (apt-get install prometheus; tools/install-deps.sh)"
        if os.environ.get("GPUSTITCH_REQUIRE_PROMETHEUS") == "1":
            raise Failure(why + ", and GPUSTITCH_REQUIRE_PROMETHEUS=1")
        print(f"SKIP: {why}")
        return SKIP
    version = subprocess.run([prometheus, "--version"], capture_output=True, text=True)
    print((version.stdout or version.stderr).splitlines()[0])
    work = tempfile.mkdtemp(prefix="gpustitch-prom-")
    children = []
    prefix = f"gstprom{os.getpid()}"
    sims = [f"{prefix}g0", f"{prefix}g1"]
    started = time.monotonic()
    try:
        metrics_port, prom_port, dead_port = free_port(), free_port(), free_port()
        gpus_dir = os.path.join(work, "gpus")
        conf = os.path.join(work, "gpustitchd.conf")
        with open(conf, "w") as f:
            f.write(f"socket = {work}/d.sock\nsample_interval_ms = 200\nrecord_prefix = {prefix}\n"
                    f"prometheus_port = {metrics_port}\nprometheus_address = 127.0.0.1\n"
                    f"nvidia_gpus_dir = {gpus_dir}\nhostname = prom-node\nlog_level = warn\n")
        daemon = subprocess.Popen([args.daemon, "--config", conf])
        children.append(daemon)
        env = {"LD_PRELOAD": args.preload, "LD_LIBRARY_PATH": args.cuda_libs,
               "GPUSTITCH_SHM_PREFIX": prefix,
               "GPUSTITCH_CONF": f"backend:sim,sim_devices:1,sim_capacity_mb:{CAPACITY_MB},"
                                 f"publish_interval_ms:50"}
        a = start_producer(args, env, ["0:262144", "0:131072"], sims[0])
        b = start_producer(args, env, ["0:65536"], sims[1])
        c = start_producer(args, env, ["0:1048576", "0:6291456:free"], sims[0])
        children += [a, b, c]
        pids = {"A": str(a.pid), "B": str(b.pid), "C": str(c.pid)}
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

        def exported():
            return parse_exposition(http_get(metrics_url))

        def uuids():
            u = {dict(l)["pid"]: dict(l)["UUID"] for (n, l), _ in exported().items()
                 if n == "gpustitch_allocated_bytes"}
            return u if set(u) == set(pids.values()) else None

        uuid_of = wait_for("the daemon to export the three producers", uuids)
        check(uuid_of[pids["A"]] == uuid_of[pids["C"]] != uuid_of[pids["B"]],
              f"simulated GPUs: {uuid_of}")
        # The driver's list names the two simulated GPUs (bus order: GPU 0, GPU 1).
        for g, (pid, bus) in enumerate(((pids["A"], "0000:10:00.0"), (pids["B"], "0000:20:00.0"))):
            os.makedirs(os.path.join(gpus_dir, bus))
            with open(os.path.join(gpus_dir, bus, "information"), "w") as f:
                f.write(f"Model: \t\t NVIDIA H200\nGPU UUID: \t {uuid_of[pid]}\n"
                        f"Bus Location: \t {bus}\nDevice Minor: \t {g}\n")
        daemon.send_signal(signal.SIGHUP)
        wait_for("the daemon to name the GPUs",
                 lambda: all(dict(l).get("gpu") for (n, l), _ in exported().items()
                             if n == "gpustitch_allocated_bytes"))
        gpu_of = {pids["A"]: "0", pids["B"]: "1", pids["C"]: "0"}

        rules = os.path.join(args.source_dir, "packaging/prometheus/gpustitch-rules.yml")
        config = os.path.join(work, "prometheus.yml")
        with open(config, "w") as f:
            f.write(f"""global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - {rules}
scrape_configs:
  - job_name: gpustitch
    static_configs:
      - targets: ['127.0.0.1:{metrics_port}']
  - job_name: gpustitch-down
    static_configs:
      - targets: ['127.0.0.1:{dead_port}']
""")
        promtool_checks(promtool, args.source_dir, work, config)
        server = subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={work}/data",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn",
             "--storage.tsdb.retention.time=1h"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        children.append(server)
        prom = Prometheus(prom_port)
        wait_for("Prometheus to be ready", lambda: "Ready" in http_get(f"{prom.base}/-/ready"))
        instance = f"127.0.0.1:{metrics_port}"
        # A few scrapes with B's OOM counter at 0, so that its rise is an increase.
        wait_for("3 scrapes", lambda: prom.query(
            f'count_over_time(gpustitch_oom_total{{pid="{pids["B"]}"}}[1m]) >= 3'))
        b.send_signal(signal.SIGUSR2)
        wait_for("B's OOM in Prometheus",
                 lambda: prom.query(f'gpustitch_oom_total{{pid="{pids["B"]}"}} == 1'))
        wait_for("2 more scrapes and a rule evaluation", lambda: prom.query(
            f'count_over_time(gpustitch_oom_total{{pid="{pids["B"]}"}}[1m]) >= 5'))
        time.sleep(2)
        truth = Truth(pids, gpu_of, pids["B"], pids["C"], exported(), instance,
                      f"127.0.0.1:{dead_port}", subprocess.run(
                          ["id", "-un"], capture_output=True, text=True).stdout.strip())
        check(truth.per_pid["gpustitch_fragmentation_ratio"][pids["C"]] > 0.8,
              f"C's fragmentation {truth.per_pid['gpustitch_fragmentation_ratio']}")
        for pid, v in truth.allocated.items():
            check(truth.per_pid["gpustitch_allocated_bytes"][pid] == v,
                  f"daemon: pid {pid} allocated {truth.per_pid['gpustitch_allocated_bytes'][pid]}")

        want = expectations(truth)
        shipped = shipped_expressions(args.source_dir)
        missing = [k for k, _, _ in shipped if k not in want]
        check(not missing, f"expressions without an expectation in this test: {missing}")
        stale = set(want) - {k for k, _, _ in shipped}
        check(not stale, f"expectations for expressions no longer shipped: {stale}")
        for key, expr, kind in shipped:
            try:
                if kind == "label_values":
                    got = label_values(prom, expr)
                    check(got == want[key], f"{sorted(got)}, want {sorted(want[key])}")
                    note = f"{sorted(got)}"
                else:
                    note = want[key](prom.query(grafana_expr(expr)))
            except Failure as e:
                raise Failure(f"{key}: {expr}\n  {e}")
            print(f"ok  {key}: {note}")

        alerts = {(al["labels"]["alertname"], al["state"], al["labels"].get("pid",
                   al["labels"].get("instance"))) for al in prom.api("/api/v1/alerts")["alerts"]}
        expected_alerts = {("GpustitchOutOfMemory", "firing", pids["B"]),
                           ("GpustitchHighFragmentation", "pending", pids["C"]),
                           ("GpustitchDaemonDown", "pending", f"127.0.0.1:{dead_port}")}
        check(alerts == expected_alerts, f"alerts {sorted(alerts)}, want {sorted(expected_alerts)}")
        print(f"ok  alerts: {sorted(alerts)}")
        print(f"passed: {len(shipped)} expressions in {time.monotonic() - started:.1f} s")
        return 0
    finally:
        for p in reversed(children):
            if p.poll() is None:
                p.kill()
            p.wait()
        for n in sims:
            try:
                os.unlink(f"/dev/shm/gpustitch-sim.{os.geteuid()}.{n}")
            except FileNotFoundError:
                pass
        for e in os.listdir("/dev/shm"):
            if e.startswith(prefix + "."):
                os.unlink(os.path.join("/dev/shm", e))
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--producer", required=True)
    ap.add_argument("--preload", required=True)
    ap.add_argument("--cuda-libs", required=True)
    args = ap.parse_args()
    try:
        return run(args)
    except Failure as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
