#!/usr/bin/env python3
# Writes gpustitch-dashboard.json (the Grafana dashboard over gpustitchd's Prometheus metrics) to
# stdout. Edit this file, not the JSON, then run:
#   packaging/grafana/generate_dashboard.py > packaging/grafana/gpustitch-dashboard.json
# The packaging tests check that the two agree and that every metric used is one the daemon exports.
import json
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance",user=~"$user",command=~"$command"'
NODE = 'instance=~"$instance"'
panels = []
pid = [0]
def nid():
    pid[0] += 1
    return pid[0]
def target(expr, legend, ref, instant=False, fmt=None):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t["instant"] = True; t["range"] = False
    if fmt: t["format"] = fmt
    return t
def row(title, y):
    panels.append({"type": "row", "title": title, "id": nid(), "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
def stat(title, expr, unit, x, y, w=4, desc=""):
    panels.append({"type": "stat", "title": title, "id": nid(), "datasource": DS, "description": desc,
                   "gridPos": {"h": 4, "w": w, "x": x, "y": y},
                   "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                   "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                               "colorMode": "value", "graphMode": "area", "textMode": "auto"},
                   "targets": [target(expr, "", "A")]})
def ts(title, targets, unit, x, y, w=12, h=8, desc="", extra=None, draw="line"):
    defaults = {"unit": unit, "custom": {"drawStyle": draw, "lineWidth": 1, "fillOpacity": 10 if draw == "line" else 80,
                                          "showPoints": "never", "spanNulls": False}}
    if extra: defaults.update(extra)
    panels.append({"type": "timeseries", "title": title, "id": nid(), "datasource": DS, "description": desc,
                   "gridPos": {"h": h, "w": w, "x": x, "y": y},
                   "fieldConfig": {"defaults": defaults, "overrides": []},
                   "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                               "tooltip": {"mode": "multi", "sort": "desc"}},
                   "targets": [target(e, l, chr(65 + i)) for i, (e, l) in enumerate(targets)]})
# Labels as dcgm-exporter's (gpu = the GPU's index, UUID, modelName, Hostname), so panels join
# with DCGM dashboards; gpu is absent for devices the driver does not list (MIG, simulated).
PROC = "{{instance}} pid {{pid}} {{command}} (gpu {{gpu}} {{UUID}})"
GPU = "{{instance}} gpu {{gpu}} {{modelName}} {{UUID}}"

y = 0
row("Overview", y); y += 1
stat("Processes", f'sum(gpustitch_processes{{{NODE}}})', "none", 0, y, desc="Processes publishing gpustitch statistics.")
stat("Reserved", f'sum(gpustitch_reserved_bytes{{{SEL}}})', "bytes", 4, y, desc="Physical GPU memory held by gpustitch pools.")
stat("Allocated", f'sum(gpustitch_allocated_bytes{{{SEL}}})', "bytes", 8, y, desc="Memory in live allocations.")
stat("Fragmentation (worst process)", f'max(gpustitch_fragmentation_ratio{{{SEL}}})', "percentunit", 12, y,
     desc="1 - allocated/reserved of the most fragmented process.")
stat("OOMs (range)", f'sum(increase(gpustitch_oom_total{{{SEL}}}[$__range]))', "none", 16, y,
     desc="Out-of-memory errors reported to programs over the dashboard's time range.")
stat("Stitches (range)", f'sum(increase(gpustitch_stitches_total{{{SEL}}}[$__range]))', "none", 20, y,
     desc="Allocations served by stitching scattered free pieces into one range: each one an OOM a plain caching allocator would have raised or a fresh cudaMalloc it would have needed.")
y += 4

row("Fragmentation", y); y += 1
ts("Fragmentation per process", [(f'gpustitch_fragmentation_ratio{{{SEL}}}', PROC)], "percentunit", 0, y,
   desc="1 - allocated/reserved, the figure PyTorch users quote. High values with a falling largest possible allocation mean fragmentation is hurting.",
   extra={"min": 0, "max": 1})
ts("Reserved vs allocated per process", [
    (f'gpustitch_reserved_bytes{{{SEL}}}', "reserved " + PROC),
    (f'gpustitch_allocated_bytes{{{SEL}}}', "allocated " + PROC)], "bytes", 12, y,
   desc="The gap between the two is cached memory (free inside the pool).")
y += 8
ts("Largest possible allocation per process", [
    (f'gpustitch_largest_possible_bytes{{{SEL}}}', "possible " + PROC),
    (f'gpustitch_largest_free_block_bytes{{{SEL}}}', "free block " + PROC)], "bytes", 0, y,
   desc="largest possible: the biggest allocation that would succeed now (with stitching). largest free block: the biggest one a plain caching allocator could serve from its cache. The difference is what stitching recovers.")
ts("Cached and pending per process", [
    (f'gpustitch_cached_bytes{{{SEL}}}', "cached " + PROC),
    (f'gpustitch_pending_bytes{{{SEL}}}', "pending " + PROC)], "bytes", 12, y,
   desc="cached: reserved but not allocated. pending: freed but waiting for device work before reuse.")
y += 8

row("Events", y); y += 1
ts("Out-of-memory errors", [(f'sum by (instance, pid, command, gpu, UUID) (increase(gpustitch_oom_total{{{SEL}}}[$__rate_interval]))', PROC)],
   "none", 0, y, draw="bars", desc="Out-of-memory errors returned to programs, per interval.")
ts("Stitches", [
    (f'sum by (instance, pid, command, gpu, UUID) (rate(gpustitch_stitches_total{{{SEL}}}[$__rate_interval]))', "stitches/s " + PROC)],
   "ops", 12, y, desc="Allocations served by stitching.")
y += 8
ts("Stitched bytes", [
    (f'sum by (instance, pid, command, gpu, UUID) (rate(gpustitch_stitched_bytes_total{{{SEL}}}[$__rate_interval]))', PROC)],
   "Bps", 0, y, desc="Bytes per second served by stitched ranges.")
ts("Trims", [
    (f'sum by (instance, pid, command, gpu, UUID) (rate(gpustitch_trimmed_bytes_total{{{SEL}}}[$__rate_interval]))', "trimmed " + PROC),
    (f'sum by (instance, pid, command, gpu, UUID) (rate(gpustitch_trims_total{{{SEL}}}[$__rate_interval]))', "trim passes/s " + PROC)],
   "Bps", 12, y, desc="Cached memory handed back to the driver (release threshold, caps, cooperative release).")
y += 8
ts("Allocation rate and how it was served", [
    (f'sum by (instance, pid, command) (rate(gpustitch_allocations_total{{{SEL}}}[$__rate_interval]))', "allocs " + "{{instance}} pid {{pid}} {{command}}"),
    (f'sum by (instance, pid, command) (rate(gpustitch_frees_total{{{SEL}}}[$__rate_interval]))', "frees " + "{{instance}} pid {{pid}} {{command}}"),
    (f'sum by (instance, pid, command) (rate(gpustitch_cache_hits_total{{{SEL}}}[$__rate_interval]))', "cache hits " + "{{instance}} pid {{pid}} {{command}}"),
    (f'sum by (instance, pid, command) (rate(gpustitch_fresh_allocations_total{{{SEL}}}[$__rate_interval]))', "fresh " + "{{instance}} pid {{pid}} {{command}}")],
   "ops", 0, y, w=24)
y += 8
# Under PyTorch the thread that allocates is the one that launches kernels: the pool's driver
# time there is time the GPU may wait for (docs/performance-history.md, "The allocating thread's
# driver calls, by kind").
ts("Time in the driver's memory API", [
    (f'sum by (instance, pid, command) (rate(gpustitch_driver_seconds_total{{{SEL}}}[$__rate_interval]))', "{{instance}} pid {{pid}} {{command}}")],
   "percentunit", 0, y,
   desc="Share of wall time the pool spent in cuMemCreate/Map/SetAccess/Unmap/Release, all its threads together.")
ts("Driver memory-API calls", [
    (f'sum by (instance, pid, command) (rate(gpustitch_driver_calls_total{{{SEL}}}[$__rate_interval]))', "{{instance}} pid {{pid}} {{command}}")],
   "ops", 12, y, desc="Calls per second the pool made into the driver's memory API (fresh memory, moves, splits, trims).")
y += 8

row("Devices", y); y += 1
ts("Device memory", [
    (f'max by (instance, gpu, UUID, modelName) (gpustitch_device_free_bytes{{{NODE}}})', "free " + GPU),
    (f'max by (instance, gpu, UUID, modelName) (gpustitch_device_total_bytes{{{NODE}}})', "total " + GPU),
    (f'sum by (instance, gpu, UUID, modelName) (gpustitch_reserved_bytes{{{NODE}}})', "gpustitch reserved " + GPU)],
   "bytes", 0, y, desc="Driver-reported free and total memory per GPU (one series per GPU, whatever the number of processes on it), against what gpustitch pools hold on it.")
ts("Peaks per process", [
    (f'gpustitch_peak_reserved_bytes{{{SEL}}}', "peak reserved " + PROC),
    (f'gpustitch_peak_allocated_bytes{{{SEL}}}', "peak allocated " + PROC)], "bytes", 12, y)
y += 8
panels.append({"type": "table", "title": "Processes now", "id": nid(), "datasource": DS,
               "gridPos": {"h": 10, "w": 24, "x": 0, "y": y},
               "fieldConfig": {"defaults": {}, "overrides": [
                   {"matcher": {"id": "byName", "options": "Value #A"}, "properties": [{"id": "displayName", "value": "reserved"}, {"id": "unit", "value": "bytes"}]},
                   {"matcher": {"id": "byName", "options": "Value #B"}, "properties": [{"id": "displayName", "value": "allocated"}, {"id": "unit", "value": "bytes"}]},
                   {"matcher": {"id": "byName", "options": "Value #C"}, "properties": [{"id": "displayName", "value": "fragmentation"}, {"id": "unit", "value": "percentunit"}]},
                   {"matcher": {"id": "byName", "options": "Value #D"}, "properties": [{"id": "displayName", "value": "largest possible"}, {"id": "unit", "value": "bytes"}]},
                   {"matcher": {"id": "byName", "options": "Value #E"}, "properties": [{"id": "displayName", "value": "OOMs"}]}]},
               "transformations": [{"id": "merge", "options": {}},
                                   {"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True, "job": True}}}],
               "targets": [target(f'gpustitch_reserved_bytes{{{SEL}}}', "", "A", True, "table"),
                           target(f'gpustitch_allocated_bytes{{{SEL}}}', "", "B", True, "table"),
                           target(f'gpustitch_fragmentation_ratio{{{SEL}}}', "", "C", True, "table"),
                           target(f'gpustitch_largest_possible_bytes{{{SEL}}}', "", "D", True, "table"),
                           target(f'gpustitch_oom_total{{{SEL}}}', "", "E", True, "table")]})

def var(name, label, query):
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1}
dash = {
    "title": "gpustitch",
    "uid": "gpustitch-overview",
    "description": "GPU memory pools of processes running with libgpustitch.so, from gpustitchd's Prometheus endpoint.",
    "tags": ["gpustitch", "gpu"],
    "timezone": "browser",
    "schemaVersion": 39,
    "version": 1,
    "editable": True,
    "graphTooltip": 1,
    "refresh": "30s",
    "time": {"from": "now-6h", "to": "now"},
    "templating": {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        var("instance", "Node", "label_values(gpustitch_processes, instance)"),
        var("user", "User", 'label_values(gpustitch_reserved_bytes{instance=~"$instance"}, user)'),
        var("command", "Command", 'label_values(gpustitch_reserved_bytes{instance=~"$instance",user=~"$user"}, command)'),
    ]},
    "annotations": {"list": []},
    "panels": panels,
}
print(json.dumps(dash, indent=2))
