// Test helper: PyTorch memory snapshots written the way torch.cuda.memory._dump_snapshot() writes
// them, pickle.dump with protocol 4: PROTO 4, FRAME, EMPTY_DICT/EMPTY_LIST with MEMOIZE after
// every container and string, SHORT_BINUNICODE, BINGET for strings seen before (the pickler's
// memo), BININT1/BININT2/BININT/LONG1 integers, MARK ... SETITEMS/APPENDS batches. The content
// is the snapshot's: segments with blocks, and device_traces with alloc / free_requested /
// free_completed / segment_alloc entries (addr, action, size, stream, time_us, frames).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace gpustitch::test {

struct FixtureEntry {
  std::string action;
  std::uint64_t addr = 0, size = 0, stream = 0, time_us = 0;
};

struct FixtureBlock {
  std::uint64_t address = 0, size = 0, requested_size = 0;
  std::string state;  // active_allocated | inactive
};

struct FixtureSegment {
  std::uint64_t address = 0, total_size = 0;
  std::vector<FixtureBlock> blocks;
};

class Protocol4Pickler {
 public:
  std::string dump_snapshot(const std::vector<FixtureSegment>& segments,
                            const std::vector<std::vector<FixtureEntry>>& device_traces) {
    out_ = "\x80\x04";
    std::string body;
    std::swap(out_, body);
    dict_begin();
    str("segments");
    list_begin();
    for (const auto& seg : segments) {
      dict_begin();
      str("device"), integer(0);
      str("address"), integer(seg.address);
      str("total_size"), integer(seg.total_size);
      str("stream"), integer(0);
      str("segment_type"), str("large");
      str("blocks");
      list_begin();
      for (const auto& b : seg.blocks) {
        dict_begin();
        str("address"), integer(b.address);
        str("size"), integer(b.size);
        str("requested_size"), integer(b.requested_size);
        str("state"), str(b.state);
        str("frames"), list_begin(), list_end();
        dict_end();
      }
      list_end();
      dict_end();
    }
    list_end();
    str("device_traces");
    list_begin();
    for (const auto& entries : device_traces) {
      list_begin();
      for (const auto& e : entries) {
        dict_begin();
        str("action"), str(e.action);
        str("addr"), integer(e.addr);
        str("frames"), list_begin(), list_end();
        str("size"), integer(e.size);
        str("stream"), integer(e.stream);
        str("time_us"), integer(e.time_us);
        dict_end();
      }
      list_end();
    }
    list_end();
    dict_end();
    out_ += '.';
    // One FRAME around the body, as the pickler frames its output.
    std::string framed = body;
    framed += '\x95';
    for (int i = 0; i < 8; ++i) framed += static_cast<char>((out_.size() >> (8 * i)) & 0xff);
    return framed + out_;
  }

 private:
  // Containers get one MARK ... SETITEMS/APPENDS batch (the tests stay under 1000 items).
  void memoize() {
    out_ += '\x94';
    ++memo_count_;
  }
  void dict_begin() {
    out_ += '}';
    memoize();
    out_ += '(';
  }
  void dict_end() { out_ += 'u'; }
  int list_begin() {
    out_ += ']';
    memoize();
    out_ += '(';
    return 0;
  }
  void list_end() { out_ += 'e'; }
  int str(const std::string& s) {
    auto it = memo_.find(s);
    if (it != memo_.end()) {
      if (it->second < 256) {
        out_ += 'h';
        out_ += static_cast<char>(it->second);
      } else {
        out_ += 'j';
        for (int i = 0; i < 4; ++i) out_ += static_cast<char>((it->second >> (8 * i)) & 0xff);
      }
      return 0;
    }
    out_ += '\x8c';
    out_ += static_cast<char>(s.size());
    out_ += s;
    memo_[s] = memo_count_;
    memoize();
    return 0;
  }
  int integer(std::uint64_t v) {
    if (v < 256) {
      out_ += 'K';
      out_ += static_cast<char>(v);
    } else if (v < 65536) {
      out_ += 'M';
      for (int i = 0; i < 2; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
    } else if (v < 0x80000000ull) {
      out_ += 'J';
      for (int i = 0; i < 4; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
    } else {
      out_ += '\x8a';
      out_ += '\x08';
      for (int i = 0; i < 8; ++i) out_ += static_cast<char>((v >> (8 * i)) & 0xff);
    }
    return 0;
  }
  std::string out_;
  std::map<std::string, std::uint64_t> memo_;
  std::uint64_t memo_count_ = 0;
};

}  // namespace gpustitch::test
