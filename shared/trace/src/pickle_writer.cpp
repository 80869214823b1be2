// PickleWriter: protocol 2 pickles of plain data. See pickle_writer.h.
//
// Containers: EMPTY_DICT/EMPTY_LIST, then batches "MARK items... SETITEMS/APPENDS". A batch is
// opened lazily with MARK before its first item and closed every 1000 items and at the end, so a
// container's items never depend on unbounded stack depth in the reader.
#include "gpustitch/trace/pickle_writer.h"

#include <cstring>

namespace gpustitch::trace {

namespace {
constexpr char PROTO = '\x80';
constexpr char STOP = '.';
constexpr char MARK = '(';
constexpr char EMPTY_DICT = '}';
constexpr char EMPTY_LIST = ']';
constexpr char SETITEMS = 'u';
constexpr char APPENDS = 'e';
constexpr char TUPLE2 = '\x86';
constexpr char BINUNICODE = 'X';
constexpr char BININT1 = 'K';
constexpr char BININT2 = 'M';
constexpr char BININT = 'J';
constexpr char LONG1 = '\x8a';
constexpr char BINFLOAT = 'G';
constexpr char NEWTRUE = '\x88';
constexpr char NEWFALSE = '\x89';
constexpr char NONE = 'N';
constexpr std::size_t kBatch = 1000;

void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
}  // namespace

PickleWriter::PickleWriter() {
  out_.push_back(PROTO);
  out_.push_back('\x02');
}

void PickleWriter::value_pushed() {
  if (stack_.empty()) return;
  Frame& f = stack_.back();
  if (f.kind == Kind::tuple2) {
    ++f.items;
    return;
  }
  ++f.items;
  std::size_t limit = f.kind == Kind::dict ? 2 * kBatch : kBatch;
  if (f.items >= limit && (f.kind == Kind::list || f.items % 2 == 0)) flush_batch(f);
}

void PickleWriter::flush_batch(Frame& f) {
  if (f.items == 0) return;
  out_.push_back(f.kind == Kind::dict ? SETITEMS : APPENDS);
  f.items = 0;
}

// Called before any value is written: opens the current container's batch with MARK.
#define GPUSTITCH_PICKLE_OPEN_BATCH()                                                      \
  do {                                                                                     \
    if (!stack_.empty() && stack_.back().kind != Kind::tuple2 && stack_.back().items == 0) \
      out_.push_back(MARK);                                                                \
  } while (0)

void PickleWriter::begin_dict() {
  GPUSTITCH_PICKLE_OPEN_BATCH();
  out_.push_back(EMPTY_DICT);
  stack_.push_back({Kind::dict});
}

void PickleWriter::end_dict() {
  Frame f = stack_.back();
  flush_batch(f);
  stack_.pop_back();
  value_pushed();
}

void PickleWriter::begin_list() {
  GPUSTITCH_PICKLE_OPEN_BATCH();
  out_.push_back(EMPTY_LIST);
  stack_.push_back({Kind::list});
}

void PickleWriter::end_list() {
  Frame f = stack_.back();
  flush_batch(f);
  stack_.pop_back();
  value_pushed();
}

void PickleWriter::begin_tuple2() {
  GPUSTITCH_PICKLE_OPEN_BATCH();
  stack_.push_back({Kind::tuple2});
}

void PickleWriter::end_tuple2() {
  out_.push_back(TUPLE2);
  stack_.pop_back();
  value_pushed();
}

void PickleWriter::str(std::string_view s) {
  GPUSTITCH_PICKLE_OPEN_BATCH();
  out_.push_back(BINUNICODE);
  put_le(out_, s.size(), 4);
  out_.append(s.data(), s.size());
  value_pushed();
}

void PickleWriter::integer(std::int64_t v) {
  GPUSTITCH_PICKLE_OPEN_BATCH();
  if (v >= 0 && v < 256) {
    out_.push_back(BININT1);
    put_le(out_, static_cast<std::uint64_t>(v), 1);
  } else if (v >= 0 && v < 65536) {
    out_.push_back(BININT2);
    put_le(out_, static_cast<std::uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_.push_back(BININT);
    put_le(out_,
           static_cast<std::uint64_t>(static_cast<std::uint32_t>(static_cast<std::int32_t>(v))), 4);
  } else {
    // LONG1: little-endian two's complement, shortest form.
    std::string bytes;
    std::uint64_t u = static_cast<std::uint64_t>(v);
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
    while (bytes.size() > 1) {
      char last = bytes.back(), prev = bytes[bytes.size() - 2];
      if ((last == 0 && !(prev & 0x80)) || (last == '\xff' && (prev & 0x80))) {
        bytes.pop_back();
      } else {
        break;
      }
    }
    out_.push_back(LONG1);
    out_.push_back(static_cast<char>(bytes.size()));
    out_ += bytes;
  }
  value_pushed();
}

void PickleWriter::uinteger(std::uint64_t v) {
  if (v <= static_cast<std::uint64_t>(INT64_MAX)) {
    integer(static_cast<std::int64_t>(v));
    return;
  }
  GPUSTITCH_PICKLE_OPEN_BATCH();
  // Needs 9 bytes so the top bit does not read as a sign.
  out_.push_back(LONG1);
  out_.push_back('\x09');
  put_le(out_, v, 8);
  out_.push_back('\x00');
  value_pushed();
}

void PickleWriter::real(double v) {
  GPUSTITCH_PICKLE_OPEN_BATCH();
  out_.push_back(BINFLOAT);
  std::uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  value_pushed();
}

void PickleWriter::boolean(bool v) {
  GPUSTITCH_PICKLE_OPEN_BATCH();
  out_.push_back(v ? NEWTRUE : NEWFALSE);
  value_pushed();
}

void PickleWriter::none() {
  GPUSTITCH_PICKLE_OPEN_BATCH();
  out_.push_back(NONE);
  value_pushed();
}

std::string PickleWriter::finish() {
  out_.push_back(STOP);
  return std::move(out_);
}

}  // namespace gpustitch::trace
