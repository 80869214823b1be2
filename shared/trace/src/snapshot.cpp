// PyTorch snapshot export: live blocks -> segments/blocks -> pickle. See snapshot.h for the
// structure, how segments are derived and the request channel.
#include "gpustitch/trace/snapshot.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "gpustitch/trace/pickle_writer.h"

namespace gpustitch::trace {

std::uint64_t snapshot_stream(Stream s) noexcept {
  return s == kAnyStream ? 0 : s;
}

SnapshotData build_snapshot(const std::vector<LiveBlock>& blocks, int device_count,
                            std::size_t granularity) {
  if (granularity == 0) granularity = 2 * MiB;
  SnapshotData data;
  int devices = std::max(device_count, 1);
  for (const auto& b : blocks) devices = std::max(devices, b.device + 1);
  data.device_traces.resize(static_cast<std::size_t>(devices));

  std::vector<const LiveBlock*> sorted;
  sorted.reserve(blocks.size());
  for (const auto& b : blocks) sorted.push_back(&b);
  std::sort(sorted.begin(), sorted.end(), [](const LiveBlock* a, const LiveBlock* b) {
    return a->device != b->device ? a->device < b->device : a->ptr < b->ptr;
  });

  SnapshotSegment* seg = nullptr;
  std::uint64_t seg_end = 0, cursor = 0;
  bool all_small = true;
  auto close_segment = [&] {
    if (seg == nullptr) return;
    if (cursor < seg_end) {
      seg->blocks.push_back({cursor, seg_end - cursor, 0, "inactive", {}});
    }
    seg->total_size = seg_end - seg->address;
    seg->segment_type = all_small ? "small" : "large";
    seg = nullptr;
  };
  for (const LiveBlock* b : sorted) {
    std::uint64_t size = std::max<std::uint64_t>(b->size, 1);
    std::uint64_t start = b->ptr / granularity * granularity;
    std::uint64_t end = align_up(b->ptr + size, granularity);
    if (seg == nullptr || b->device != seg->device || start >= seg_end) {
      close_segment();
      data.segments.emplace_back();
      seg = &data.segments.back();
      seg->device = b->device;
      seg->address = start;
      seg->stream = snapshot_stream(b->stream);
      seg_end = end;
      cursor = start;
      all_small = true;
    }
    seg_end = std::max(seg_end, end);
    if (b->ptr > cursor) seg->blocks.push_back({cursor, b->ptr - cursor, 0, "inactive", {}});
    std::uint64_t bstart = std::max<std::uint64_t>(b->ptr, cursor);
    std::uint64_t bend = std::max<std::uint64_t>(b->ptr + size, bstart);
    SnapshotBlock blk{bstart, bend - bstart, b->size, "active_allocated", {}};
    for (const auto& f : b->frames) blk.frames.push_back(f);
    seg->blocks.push_back(std::move(blk));
    seg->allocated_size += bend - bstart;
    seg->active_size += bend - bstart;
    seg->requested_size += b->size;
    if (b->size > 1 * MiB) all_small = false;
    if (b->served_by == ServedBy::stitched) seg->is_expandable = true;
    cursor = bend;
  }
  close_segment();
  return data;
}

SnapshotData build_snapshot_from_segments(
    const std::vector<MappedSegment>& mapped, int device_count,
    const std::function<std::vector<SnapshotFrame>(DevPtr)>& frames_for) {
  SnapshotData data;
  int devices = std::max(device_count, 1);
  for (const auto& s : mapped) devices = std::max(devices, s.device + 1);
  data.device_traces.resize(static_cast<std::size_t>(devices));
  // Whole runs: ranges that touch become one segment (snapshot.h says why).
  std::vector<const MappedSegment*> order;
  order.reserve(mapped.size());
  for (const auto& s : mapped) order.push_back(&s);
  std::sort(order.begin(), order.end(), [](const MappedSegment* a, const MappedSegment* b) {
    return a->device != b->device ? a->device < b->device : a->base < b->base;
  });
  // A run is "small" when its chunks are all it holds (free memory beside them does not count).
  auto small_or_empty = [](const MappedSegment& s) {
    return s.small || std::all_of(s.blocks.begin(), s.blocks.end(), [](const MappedBlock& b) {
             return b.state == MappedBlock::State::free;
           });
  };
  std::vector<MappedSegment> segments;
  for (const MappedSegment* s : order) {
    if (!segments.empty() && segments.back().device == s->device &&
        segments.back().base + segments.back().size == s->base) {
      MappedSegment& run = segments.back();
      run.small = small_or_empty(run) && small_or_empty(*s) && (run.small || s->small);
      run.size += s->size;
      run.stitched = run.stitched || s->stitched;
      run.blocks.insert(run.blocks.end(), s->blocks.begin(), s->blocks.end());
      continue;
    }
    segments.push_back(*s);
  }
  for (const auto& s : segments) {
    SnapshotSegment seg;
    seg.device = s.device;
    seg.address = s.base;
    seg.total_size = s.size;
    seg.stream = 0;
    seg.is_expandable = s.stitched;
    bool all_small = true;
    for (const auto& b : s.blocks) {
      SnapshotBlock blk;
      blk.address = b.ptr;
      blk.size = b.size;
      switch (b.state) {
        case MappedBlock::State::live:
          blk.state = "active_allocated";
          break;
        case MappedBlock::State::pending:
          blk.state = "active_pending_free";
          break;
        case MappedBlock::State::free:
          blk.state = "inactive";
          break;
      }
      if (b.state != MappedBlock::State::free) {
        blk.requested_size = b.requested;
        seg.active_size += b.size;
        if (b.size > 1 * MiB) all_small = false;
      }
      if (b.state == MappedBlock::State::live) {
        seg.allocated_size += b.size;
        seg.requested_size += b.requested;
        if (frames_for) blk.frames = frames_for(b.ptr);
      }
      seg.blocks.push_back(std::move(blk));
    }
    seg.segment_type = s.small || (all_small && s.size <= 2 * MiB) ? "small" : "large";
    data.segments.push_back(std::move(seg));
  }
  return data;
}

SnapshotData snapshot_from_trace(const Trace& trace, std::size_t upto, std::size_t granularity,
                                 std::size_t max_trace_entries) {
  std::size_t n = upto == 0 ? trace.events.size() : std::min(upto, trace.events.size());
  // Live blocks keyed by pointer; a pointer may be live twice in a trace whose free was recorded
  // after the next allocation of the same address (threads racing), so keep them in order.
  std::map<std::pair<int, std::uint64_t>, std::deque<LiveBlock>> live;
  std::vector<std::deque<SnapshotTraceEntry>> traces(
      static_cast<std::size_t>(trace.device_count()));
  auto push = [&](int device, SnapshotTraceEntry e) {
    auto& q = traces[static_cast<std::size_t>(device)];
    q.push_back(std::move(e));
    while (q.size() > max_trace_entries) q.pop_front();
  };
  for (std::size_t i = 0; i < n; ++i) {
    const TraceEvent& ev = trace.events[i];
    auto key = std::make_pair(ev.device, ev.ptr);
    auto time_us = static_cast<std::uint64_t>(ev.time_s * 1e6);
    Stream stream = static_cast<Stream>(ev.stream);
    if (ev.action == TraceAction::allocate) {
      LiveBlock b;
      b.ptr = ev.ptr;
      b.size = ev.size;
      b.device = ev.device;
      b.stream = stream;
      b.served_by = ev.served_by.value_or(ServedBy::fresh);
      live[key].push_back(std::move(b));
      push(ev.device, {"alloc", ev.ptr, ev.size, snapshot_stream(stream), time_us, 0});
    } else {
      auto it = live.find(key);
      if (it == live.end()) continue;  // allocated before the trace started
      std::uint64_t size = it->second.front().size;
      it->second.pop_front();
      if (it->second.empty()) live.erase(it);
      push(ev.device, {"free_requested", ev.ptr, size, snapshot_stream(stream), time_us, 0});
      push(ev.device, {"free_completed", ev.ptr, size, snapshot_stream(stream), time_us, 0});
    }
  }
  std::vector<LiveBlock> blocks;
  for (auto& [key, q] : live)
    for (auto& b : q) blocks.push_back(std::move(b));
  SnapshotData data = build_snapshot(blocks, trace.device_count(), granularity);
  for (std::size_t d = 0; d < traces.size() && d < data.device_traces.size(); ++d)
    data.device_traces[d].assign(traces[d].begin(), traces[d].end());
  return data;
}

namespace {
void write_frames(PickleWriter& w, const std::vector<SnapshotFrame>& frames) {
  w.begin_list();
  for (const auto& f : frames) {
    w.begin_dict();
    w.str_entry("filename", f.filename);
    w.int_entry("line", f.line);
    w.str_entry("name", f.name);
    w.end_dict();
  }
  w.end_list();
}
}  // namespace

std::string snapshot_pickle(const SnapshotData& data) {
  PickleWriter w;
  w.begin_dict();
  w.key("segments");
  w.begin_list();
  for (const auto& s : data.segments) {
    w.begin_dict();
    w.int_entry("device", s.device);
    w.uint_entry("address", s.address);
    w.uint_entry("total_size", s.total_size);
    w.uint_entry("allocated_size", s.allocated_size);
    w.uint_entry("active_size", s.active_size);
    w.uint_entry("requested_size", s.requested_size);
    w.uint_entry("stream", s.stream);
    w.str_entry("segment_type", s.segment_type);
    w.key("segment_pool_id");
    w.begin_tuple2();
    w.integer(0);
    w.integer(0);
    w.end_tuple2();
    w.bool_entry("is_expandable", s.is_expandable);
    w.empty_list_entry("frames");
    w.key("blocks");
    w.begin_list();
    for (const auto& b : s.blocks) {
      w.begin_dict();
      w.uint_entry("address", b.address);
      w.uint_entry("size", b.size);
      w.uint_entry("requested_size", b.requested_size);
      w.str_entry("state", b.state);
      w.key("frames");
      write_frames(w, b.frames);
      w.end_dict();
    }
    w.end_list();
    w.end_dict();
  }
  w.end_list();
  w.key("device_traces");
  w.begin_list();
  for (const auto& entries : data.device_traces) {
    w.begin_list();
    for (const auto& e : entries) {
      w.begin_dict();
      w.str_entry("action", e.action);
      if (e.action != "oom") {
        w.uint_entry("addr", e.addr);
      }
      w.key("frames");
      write_frames(w, e.frames);
      w.uint_entry("size", e.size);
      w.uint_entry("stream", e.stream);
      w.uint_entry("time_us", e.time_us);
      if (e.action == "oom") {
        w.uint_entry("device_free", e.device_free);
      }
      w.end_dict();
    }
    w.end_list();
  }
  w.end_list();
  w.key("allocator_settings");
  w.begin_dict();
  w.str_entry("backend", "gpustitch");
  w.end_dict();
  w.end_dict();
  return w.finish();
}

bool write_pytorch_snapshot(const SnapshotData& data, const std::string& path, std::string* why) {
  std::string bytes = snapshot_pickle(data);
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (why) *why = "cannot create " + tmp + ": " + std::strerror(errno);
    return false;
  }
  const char* p = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (why) *why = "cannot write " + tmp + ": " + std::strerror(w < 0 ? errno : ENOSPC);
      ::close(fd);
      ::unlink(tmp.c_str());
      return false;
    }
    p += w;
    left -= static_cast<std::size_t>(w);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    if (why) *why = "cannot rename to " + path + ": " + std::strerror(errno);
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

// --- SnapshotRequests ------------------------------------------------------------------------

namespace {

bool private_directory(const std::string& dir) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) return false;
  return S_ISDIR(st.st_mode) && st.st_uid == ::getuid() && (st.st_mode & 022) == 0;
}

bool read_small_file(const std::string& path, std::string* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::stringstream ss;
  ss << in.rdbuf();
  *out = ss.str();
  while (!out->empty() && (out->back() == '\n' || out->back() == '\r')) out->pop_back();
  return true;
}

bool write_small_file(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

}  // namespace

namespace {

// The rendezvous directory of a process whose XDG_RUNTIME_DIR is xdg (null or relative: none).
std::string directory_for(const char* xdg) {
  if (xdg != nullptr && xdg[0] == '/') return std::string(xdg) + "/gpustitch";
  return "/tmp/gpustitch-" + std::to_string(::getuid());
}

// XDG_RUNTIME_DIR in the environment process pid started with (/proc/PID/environ, readable for
// the same user). nullopt: the environment could not be read; "" : the variable is not set.
std::optional<std::string> target_xdg(int pid) {
  if (pid == ::getpid()) {  // ourselves: what we poll with, set at run time or not
    const char* own = std::getenv("XDG_RUNTIME_DIR");
    return std::string(own ? own : "");
  }
  std::ifstream in("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  if (!in) return std::nullopt;
  std::string entry;
  std::size_t read = 0;
  while (std::getline(in, entry, '\0')) {
    read += entry.size() + 1;
    if (read > (1u << 20)) break;  // an environment is far smaller; do not read without end
    if (entry.rfind("XDG_RUNTIME_DIR=", 0) == 0) return entry.substr(16);
  }
  return std::string();
}

}  // namespace

std::string SnapshotRequests::directory(bool create) {
  std::string dir = directory_for(std::getenv("XDG_RUNTIME_DIR"));
  if (create && ::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return {};
  return private_directory(dir) ? dir : std::string{};
}

bool SnapshotRequests::request(int pid, const std::string& out_path, unsigned timeout_ms,
                               std::string* why) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) {
    if (why) *why = "no process " + std::to_string(pid);
    return false;
  }
  // The process polls the directory of its own environment, not ours: ask there. Where its
  // environment cannot be read, ask in both places it could be polling.
  std::vector<std::string> dirs;
  if (auto xdg = target_xdg(pid)) {
    dirs.push_back(directory_for(xdg->c_str()));
  } else {
    dirs.push_back(directory_for(std::getenv("XDG_RUNTIME_DIR")));
    dirs.push_back(directory_for(nullptr));
  }
  if (dirs.size() == 2 && dirs[0] == dirs[1]) dirs.pop_back();
  std::vector<std::string> bases;
  std::string last_error = "cannot use the private request directory " + dirs.front();
  for (const auto& dir : dirs) {
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) continue;
    if (!private_directory(dir)) continue;
    std::string base = dir + "/snapshot-" + std::to_string(pid);
    ::unlink((base + ".done").c_str());
    if (!write_small_file(base + ".request", out_path + "\n")) {
      last_error = "cannot write " + base + ".request: " + std::strerror(errno);
      continue;
    }
    bases.push_back(base);
  }
  if (bases.empty()) {
    if (why) *why = last_error;
    return false;
  }
  auto withdraw = [&] {
    for (const auto& base : bases) ::unlink((base + ".request").c_str());
  };
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::string done;
  while (std::chrono::steady_clock::now() < deadline) {
    for (const auto& base : bases) {
      if (!read_small_file(base + ".done", &done)) continue;
      ::unlink((base + ".done").c_str());
      withdraw();
      if (done == "ok") return true;
      if (why) *why = done;
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Withdraw the request unless the process has just taken it.
  withdraw();
  if (why)
    *why = "process " + std::to_string(pid) + " did not answer within " +
           std::to_string(timeout_ms) +
           " ms (is it running under gpustitch, with publishing on, as the same user?)";
  return false;
}

bool SnapshotRequests::poll(const std::function<SnapshotData()>& make_data) noexcept {
  try {
    // Never destroyed: the publisher thread polls until the process ends, and may still be here
    // while exit() runs the static destructors (a function-local std::string was freed under it).
    static const std::string& dir = *new std::string(directory(false));
    if (dir.empty()) {
      // The directory may be created after the process started: look again, cheaply.
      std::string now = directory(false);
      if (now.empty()) return false;
    }
    const std::string d = dir.empty() ? directory(false) : dir;
    std::string base = d + "/snapshot-" + std::to_string(::getpid());
    struct stat st;
    if (::stat((base + ".request").c_str(), &st) != 0) return false;
    if (st.st_uid != ::getuid() || !private_directory(d)) return false;
    if (::rename((base + ".request").c_str(), (base + ".taken").c_str()) != 0) return false;
    std::string out;
    bool have = read_small_file(base + ".taken", &out);
    ::unlink((base + ".taken").c_str());
    std::string why;
    bool ok = false;
    if (!have || out.empty() || out[0] != '/') {
      why = "error: the request holds no absolute output path";
    } else {
      try {
        ok = write_pytorch_snapshot(make_data(), out, &why);
      } catch (const std::exception& e) {
        why = e.what();  // e.g. out of host memory: the requester is told, not left waiting
      }
      if (!ok) why = "error: " + why;
    }
    write_small_file(base + ".done", ok ? "ok" : why);
    return ok;
  } catch (...) {
    return false;
  }
}

}  // namespace gpustitch::trace
