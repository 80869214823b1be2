// read_pytorch_snapshot: device_traces -> trace::Trace, with the ring's truncation reconstructed.
// See snapshot_trace.h.
#include "snapshot_trace.h"

#include <algorithm>
#include <deque>
#include <map>

#include "pickle_reader.h"

namespace gpustitch::replay {

bool looks_like_pickle(std::string_view bytes) noexcept {
  return !bytes.empty() && static_cast<unsigned char>(bytes[0]) == 0x80;
}

namespace {

std::uint64_t uint_field(const PickleValue& entry, std::string_view key, bool* ok) {
  const PickleValue* v = entry.get(key);
  std::int64_t i = 0;
  if (v == nullptr || !v->as_int(&i)) {
    *ok = false;
    return 0;
  }
  return static_cast<std::uint64_t>(i);
}

}  // namespace

bool read_pytorch_snapshot(std::string_view bytes, trace::Trace* out, SnapshotImport* report,
                           std::string* why) {
  auto fail = [&](const std::string& what) {
    if (why) *why = what;
    return false;
  };
  std::string perr;
  PickleRef root = read_pickle(bytes, &perr);
  if (!root) return fail("not a readable pickle: " + perr);
  if (root->as_dict() == nullptr) return fail("not a PyTorch memory snapshot (not a dict)");
  const PickleValue* traces = root->get("device_traces");
  if (traces == nullptr || traces->as_list() == nullptr)
    return fail(
        "a PyTorch memory snapshot without device_traces (record with "
        "torch.cuda.memory._record_memory_history() before _dump_snapshot())");

  SnapshotImport rep;
  trace::Trace tr;
  tr.has_header = true;
  // Blocks live at the snapshot and reserved bytes at the end, per device, from the segments.
  std::map<int, std::vector<std::pair<std::uint64_t, std::uint64_t>>> live_at_end;  // addr, size
  std::map<int, std::uint64_t> reserved_end;
  if (const PickleValue* segs = root->get("segments"); segs && segs->as_list()) {
    for (const auto& seg : *segs->as_list()) {
      bool ok = true;
      int device = static_cast<int>(uint_field(*seg, "device", &ok));
      if (!ok) device = 0;
      ok = true;
      std::uint64_t total = uint_field(*seg, "total_size", &ok);
      if (ok) {
        reserved_end[device] += total;
        rep.has_segment_record = true;
      }
      const PickleValue* blocks = seg->get("blocks");
      if (blocks == nullptr || blocks->as_list() == nullptr) continue;
      for (const auto& b : *blocks->as_list()) {
        const PickleValue* state = b->get("state");
        if (state == nullptr || state->as_str() == nullptr ||
            *state->as_str() != "active_allocated")
          continue;
        ok = true;
        std::uint64_t addr = uint_field(*b, "address", &ok);
        std::uint64_t size = uint_field(*b, "requested_size", &ok);
        if (!ok || size == 0) {
          ok = true;
          size = uint_field(*b, "size", &ok);
        }
        if (ok) live_at_end[device].emplace_back(addr, size);
      }
    }
  }

  const auto& devices = *traces->as_list();
  std::vector<trace::TraceEvent> events, prefix;
  std::uint64_t recorded_peak = 0;
  for (std::size_t d = 0; d < devices.size(); ++d) {
    const auto* entries = devices[d]->as_list();
    if (entries == nullptr)
      return fail("device_traces[" + std::to_string(d) + "] is not a list of events");
    const int device = static_cast<int>(d);
    bool has_completed = false;
    for (const auto& e : *entries) {
      const PickleValue* a = e->get("action");
      if (a && a->as_str() && *a->as_str() == "free_completed") has_completed = true;
    }
    std::map<std::uint64_t, std::deque<std::uint64_t>> live;  // addr -> sizes, oldest first
    std::int64_t seg_delta = 0, seg_delta_peak = 0;
    double first_time = -1;
    for (std::size_t i = 0; i < entries->size(); ++i) {
      const PickleValue& e = *(*entries)[i];
      const PickleValue* a = e.get("action");
      if (a == nullptr || a->as_str() == nullptr)
        return fail("device_traces[" + std::to_string(d) + "][" + std::to_string(i) +
                    "] has no action");
      const std::string& action = *a->as_str();
      ++rep.entries;
      bool ok = true;
      std::uint64_t addr = uint_field(e, "addr", &ok);
      std::uint64_t size = uint_field(e, "size", &ok);
      bool ok_time = true;
      double t = static_cast<double>(uint_field(e, "time_us", &ok_time)) / 1e6;
      if (!ok_time) t = static_cast<double>(i);  // older snapshots: entry order as time
      if (first_time < 0) first_time = t;
      if (action == "segment_alloc" || action == "segment_map") {
        seg_delta += static_cast<std::int64_t>(size);
        seg_delta_peak = std::max(seg_delta_peak, seg_delta);
        rep.has_segment_record = true;
        continue;
      }
      if (action == "segment_free" || action == "segment_unmap") {
        seg_delta -= static_cast<std::int64_t>(size);
        rep.has_segment_record = true;
        continue;
      }
      if (action == "oom") {
        ++rep.recorded_ooms;
        continue;
      }
      bool is_alloc = action == "alloc";
      bool is_free = action == "free_completed" || action == "free" ||
                     (action == "free_requested" && !has_completed);
      if (!is_alloc && !is_free) continue;  // snapshot markers, free_requested, others
      if (!ok)
        return fail("device_traces[" + std::to_string(d) + "][" + std::to_string(i) + "] (" +
                    action + ") lacks addr or size");
      trace::TraceEvent ev;
      ev.line = i + 1;
      ev.time_s = t;
      ev.ptr = addr;
      ev.size = size;
      bool ok_stream = true;
      ev.stream = uint_field(e, "stream", &ok_stream);
      ev.device = device;
      if (is_alloc) {
        ev.action = trace::TraceAction::allocate;
        live[addr].push_back(size);
        ++rep.allocs;
      } else {
        ev.action = trace::TraceAction::free;
        ++rep.frees;
        auto it = live.find(addr);
        if (it == live.end()) {
          // Allocated before the record began: live from its start.
          trace::TraceEvent alloc = ev;
          alloc.action = trace::TraceAction::allocate;
          alloc.line = 0;
          prefix.push_back(alloc);
          ++rep.lost_allocs;
          rep.lost_alloc_bytes += size;
        } else {
          it->second.pop_front();
          if (it->second.empty()) live.erase(it);
        }
      }
      events.push_back(ev);
    }
    for (const auto& [addr, size] : live_at_end[device]) {
      auto it = live.find(addr);
      if (it != live.end()) {
        it->second.pop_front();
        if (it->second.empty()) live.erase(it);
        continue;
      }
      trace::TraceEvent alloc;
      alloc.action = trace::TraceAction::allocate;
      alloc.ptr = addr;
      alloc.size = size;
      alloc.device = device;
      prefix.push_back(alloc);
      ++rep.unrecorded_live;
      rep.unrecorded_live_bytes += size;
    }
    // Reconstructed allocs happen when the device's record starts.
    for (auto& p : prefix)
      if (p.device == device) p.time_s = first_time < 0 ? 0 : first_time;
    // Reserved over the record: the end value minus the changes still to come.
    std::int64_t end = static_cast<std::int64_t>(reserved_end[device]);
    std::int64_t start = std::max<std::int64_t>(0, end - seg_delta);
    recorded_peak += static_cast<std::uint64_t>(std::max(end, start + seg_delta_peak));
    rep.reserved_at_snapshot += reserved_end[device];
  }
  rep.recorded_peak_reserved = recorded_peak;
  std::stable_sort(
      events.begin(), events.end(),
      [](const trace::TraceEvent& a, const trace::TraceEvent& b) { return a.time_s < b.time_s; });
  tr.events = std::move(prefix);
  tr.events.insert(tr.events.end(), events.begin(), events.end());
  *out = std::move(tr);
  if (report) *report = rep;
  return true;
}

}  // namespace gpustitch::replay
