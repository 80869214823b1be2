// A minimal Python pickle (protocol 2) writer for plain data: dict, list, tuple, str, int, float,
// bool, None. Only the opcodes that pytorch.org/memory_viz's JavaScript unpickler reads are used
// (PROTO, EMPTY_DICT, EMPTY_LIST, MARK, SETITEMS, APPENDS, TUPLE2, BINUNICODE, BININT1, BININT2,
// BININT, LONG1, BINFLOAT, NEWTRUE, NEWFALSE, NONE, STOP), so the same bytes load in Python's
// pickle and in the viewer.
//
// Usage is a stream of calls mirroring the value's structure:
//   PickleWriter w;  w.begin_dict();  w.key("segments");  w.begin_list(); ... w.end_list();
//   w.end_dict();  std::string bytes = w.finish();
// Containers are emitted in batches of up to 1000 items, as Python's own pickler does.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace gpustitch::trace {

class PickleWriter {
 public:
  PickleWriter();

  void begin_dict();
  void end_dict();
  void begin_list();
  void end_list();
  // A two-element tuple of the next two values (e.g. PyTorch's segment_pool_id).
  void begin_tuple2();
  void end_tuple2();

  void key(std::string_view k) { str(k); }
  void str(std::string_view s);
  void integer(std::int64_t v);
  void uinteger(std::uint64_t v);
  void real(double v);
  void boolean(bool v);
  void none();

  // A dict entry: key then value.
  void str_entry(std::string_view k, std::string_view v) {
    key(k);
    str(v);
  }
  void int_entry(std::string_view k, std::int64_t v) {
    key(k);
    integer(v);
  }
  void uint_entry(std::string_view k, std::uint64_t v) {
    key(k);
    uinteger(v);
  }
  void bool_entry(std::string_view k, bool v) {
    key(k);
    boolean(v);
  }
  void empty_list_entry(std::string_view k) {
    key(k);
    begin_list();
    end_list();
  }

  // Appends STOP and returns the pickle. The writer must be balanced (every begin ended).
  std::string finish();

 private:
  enum class Kind { dict, list, tuple2 };
  struct Frame {
    Kind kind;
    std::size_t items = 0;  // values pushed since the last MARK (dict: keys + values)
  };
  void value_pushed();
  void flush_batch(Frame& f);
  std::string out_;
  std::vector<Frame> stack_;
};

}  // namespace gpustitch::trace
