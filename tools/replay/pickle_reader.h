// A minimal Python pickle reader for plain data, enough for the memory snapshots PyTorch's
// torch.cuda.memory._dump_snapshot() writes (pickle.dump with the interpreter's default
// protocol, 4 or 5) and for gpustitch's own (protocol 2, pickle_writer.h).
//
// Debian ships no C++ unpickler, and a snapshot only holds dicts, lists, tuples, strings, bytes,
// ints, floats, bools and None, so this reads exactly that subset of the protocol: PROTO, FRAME,
// STOP, MARK, the EMPTY_/container-building opcodes (DICT, LIST, TUPLE*, SETITEM(S),
// APPEND(S), ADDITEMS for sets), the binary string/bytes forms, INT/LONG/BININT*, LONG1/LONG4,
// BINFLOAT/FLOAT, the booleans and NONE, and the memo (PUT/BINPUT/LONG_BINPUT/MEMOIZE,
// GET/BINGET/LONG_BINGET). Anything that would run code (GLOBAL, STACK_GLOBAL, REDUCE, BUILD,
// NEWOBJ, PERSID, ...) is rejected with the opcode and offset: a snapshot never needs it.
//
// Values are shared (a memo reference is the same node), so a list of 100,000 trace entries that
// repeat the same frame strings costs one string each.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace gpustitch::replay {

struct PickleValue;
using PickleRef = std::shared_ptr<const PickleValue>;

struct PickleValue {
  struct None {};
  using List = std::vector<PickleRef>;                        // list, tuple, set
  using Dict = std::vector<std::pair<PickleRef, PickleRef>>;  // in insertion order
  // Integers beyond 64 bits do not occur in snapshots; they are read as the low 64 bits with
  // `big` set.
  std::variant<None, bool, std::int64_t, double, std::string, List, Dict> v;
  bool big = false;

  bool is_none() const noexcept { return std::holds_alternative<None>(v); }
  const std::string* as_str() const noexcept { return std::get_if<std::string>(&v); }
  const List* as_list() const noexcept { return std::get_if<List>(&v); }
  const Dict* as_dict() const noexcept { return std::get_if<Dict>(&v); }
  // Integers (and bools, as Python treats them) as int64; false when the value is neither.
  bool as_int(std::int64_t* out) const noexcept;
  // A dict's value for a string key, or null.
  const PickleValue* get(std::string_view key) const noexcept;
};

// Parses one pickle. Returns null and sets *why (opcode, byte offset) when the bytes are not a
// pickle of plain data or are cut short.
PickleRef read_pickle(std::string_view bytes, std::string* why);

}  // namespace gpustitch::replay
