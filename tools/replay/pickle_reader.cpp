// read_pickle: a stack machine over the plain-data subset of the pickle protocol. See
// pickle_reader.h for the subset and why it is enough.
#include "pickle_reader.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <unordered_map>

namespace gpustitch::replay {

bool PickleValue::as_int(std::int64_t* out) const noexcept {
  if (const auto* i = std::get_if<std::int64_t>(&v)) {
    *out = *i;
    return true;
  }
  if (const auto* b = std::get_if<bool>(&v)) {
    *out = *b ? 1 : 0;
    return true;
  }
  return false;
}

const PickleValue* PickleValue::get(std::string_view key) const noexcept {
  const Dict* d = as_dict();
  if (d == nullptr) return nullptr;
  for (const auto& [k, val] : *d)
    if (const std::string* s = k->as_str(); s != nullptr && *s == key) return val.get();
  return nullptr;
}

namespace {

class Reader {
 public:
  explicit Reader(std::string_view bytes) : in_(bytes) {}

  PickleRef run(std::string* why) {
    try {
      return loop();
    } catch (const Error& e) {
      if (why) *why = e.what + " at byte " + std::to_string(e.offset);
      return nullptr;
    }
  }

 private:
  struct Error {
    std::string what;
    std::size_t offset;
  };
  // A stack slot is a value or a MARK.
  struct Slot {
    std::shared_ptr<PickleValue> value;  // null: MARK
  };

  [[noreturn]] void fail(const std::string& what) const { throw Error{what, op_at_}; }

  std::string_view take(std::size_t n) {
    if (in_.size() - pos_ < n) fail("truncated pickle");
    std::string_view s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::uint64_t le(std::size_t n) {
    std::string_view s = take(n);
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i)
      v |= static_cast<std::uint64_t>(static_cast<unsigned char>(s[i])) << (8 * i);
    return v;
  }
  std::string_view line() {
    std::size_t end = in_.find('\n', pos_);
    if (end == std::string_view::npos) fail("truncated pickle");
    std::string_view s = in_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }

  static std::shared_ptr<PickleValue> make(decltype(PickleValue::v) v) {
    auto p = std::make_shared<PickleValue>();
    p->v = std::move(v);
    return p;
  }
  void push(std::shared_ptr<PickleValue> v) { stack_.push_back({std::move(v)}); }
  std::shared_ptr<PickleValue> pop() {
    if (stack_.empty() || !stack_.back().value) fail("stack underflow");
    auto v = std::move(stack_.back().value);
    stack_.pop_back();
    return v;
  }
  std::shared_ptr<PickleValue>& top() {
    if (stack_.empty() || !stack_.back().value) fail("stack underflow");
    return stack_.back().value;
  }
  // Pops everything above the topmost MARK, and the MARK.
  std::vector<std::shared_ptr<PickleValue>> pop_mark() {
    std::size_t m = stack_.size();
    while (m > 0 && stack_[m - 1].value) --m;
    if (m == 0) fail("no MARK on the stack");
    std::vector<std::shared_ptr<PickleValue>> items;
    for (std::size_t i = m; i < stack_.size(); ++i) items.push_back(std::move(stack_[i].value));
    stack_.resize(m - 1);
    return items;
  }
  static std::int64_t signed_le(std::string_view bytes, bool* big) {
    // Two's complement, little-endian, any length (LONG1/LONG4).
    if (bytes.empty()) return 0;
    *big = bytes.size() > 8;
    std::uint64_t v = 0;
    std::size_t n = std::min<std::size_t>(bytes.size(), 8);
    for (std::size_t i = 0; i < n; ++i)
      v |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
    if (n < 8 && (static_cast<unsigned char>(bytes[n - 1]) & 0x80)) v |= ~0ull << (8 * n);
    return static_cast<std::int64_t>(v);
  }
  void add_to_list(std::shared_ptr<PickleValue>& target,
                   std::vector<std::shared_ptr<PickleValue>> items) {
    auto* list = std::get_if<PickleValue::List>(&target->v);
    if (list == nullptr) fail("APPEND to a value that is not a list");
    for (auto& i : items) list->push_back(std::move(i));
  }
  void add_to_dict(std::shared_ptr<PickleValue>& target,
                   std::vector<std::shared_ptr<PickleValue>> items) {
    auto* dict = std::get_if<PickleValue::Dict>(&target->v);
    if (dict == nullptr) fail("SETITEM on a value that is not a dict");
    if (items.size() % 2) fail("odd number of items for SETITEMS");
    for (std::size_t i = 0; i < items.size(); i += 2)
      dict->emplace_back(std::move(items[i]), std::move(items[i + 1]));
  }
  void memo_put(std::uint64_t index) { memo_[index] = top(); }
  void memo_get(std::uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail("memo entry " + std::to_string(index) + " not defined");
    push(it->second);
  }

  PickleRef loop() {
    while (pos_ < in_.size()) {
      op_at_ = pos_;
      auto op = static_cast<unsigned char>(in_[pos_++]);
      switch (op) {
        case 0x80:  // PROTO
          take(1);
          break;
        case 0x95:  // FRAME: the length is a hint only
          take(8);
          break;
        case '.': {  // STOP
          auto v = pop();
          return v;
        }
        case '(':  // MARK
          stack_.push_back({nullptr});
          break;
        case '}':
          push(make(PickleValue::Dict{}));
          break;
        case ']':
          push(make(PickleValue::List{}));
          break;
        case ')':  // EMPTY_TUPLE
          push(make(PickleValue::List{}));
          break;
        case 0x8f:  // EMPTY_SET
          push(make(PickleValue::List{}));
          break;
        case 'd': {  // DICT
          auto items = pop_mark();
          auto d = make(PickleValue::Dict{});
          add_to_dict(d, std::move(items));
          push(d);
          break;
        }
        case 'l':     // LIST
        case 't':     // TUPLE
        case 0x91: {  // FROZENSET
          auto items = pop_mark();
          auto l = make(PickleValue::List{});
          add_to_list(l, std::move(items));
          push(l);
          break;
        }
        case 0x85:    // TUPLE1
        case 0x86:    // TUPLE2
        case 0x87: {  // TUPLE3
          std::size_t n = op - 0x84u;
          if (stack_.size() < n) fail("stack underflow");
          std::vector<std::shared_ptr<PickleValue>> items(n);
          for (std::size_t i = n; i-- > 0;) items[i] = pop();
          auto l = make(PickleValue::List{});
          add_to_list(l, std::move(items));
          push(l);
          break;
        }
        case 'a': {  // APPEND
          auto v = pop();
          add_to_list(top(), {std::move(v)});
          break;
        }
        case 'e':     // APPENDS
        case 0x90: {  // ADDITEMS (sets)
          auto items = pop_mark();
          add_to_list(top(), std::move(items));
          break;
        }
        case 's': {  // SETITEM
          auto v = pop();
          auto k = pop();
          add_to_dict(top(), {std::move(k), std::move(v)});
          break;
        }
        case 'u': {  // SETITEMS
          auto items = pop_mark();
          add_to_dict(top(), std::move(items));
          break;
        }
        case 'X':  // BINUNICODE
        case 'B':  // BINBYTES
        case 'T':  // BINSTRING
          push(make(std::string(take(le(4)))));
          break;
        case 0x8c:  // SHORT_BINUNICODE
        case 'C':   // SHORT_BINBYTES
        case 'U':   // SHORT_BINSTRING
          push(make(std::string(take(le(1)))));
          break;
        case 0x8d:  // BINUNICODE8
        case 0x8e:  // BINBYTES8
        case 0x96:  // BYTEARRAY8
          push(make(std::string(take(le(8)))));
          break;
        case 'V':  // UNICODE (raw-unicode-escape; plain ASCII in practice)
          push(make(std::string(line())));
          break;
        case 'K':  // BININT1
          push(make(static_cast<std::int64_t>(le(1))));
          break;
        case 'M':  // BININT2
          push(make(static_cast<std::int64_t>(le(2))));
          break;
        case 'J':  // BININT
          push(make(static_cast<std::int64_t>(static_cast<std::int32_t>(le(4)))));
          break;
        case 'I':    // INT (text; "01"/"00" are the protocol 0 booleans)
        case 'L': {  // LONG (text, trailing L)
          std::string text(line());
          if (!text.empty() && text.back() == 'L') text.pop_back();
          if (op == 'I' && text == "01") {
            push(make(true));
          } else if (op == 'I' && text == "00") {
            push(make(false));
          } else {
            try {
              push(make(static_cast<std::int64_t>(std::stoll(text))));
            } catch (...) {
              fail("bad integer '" + text + "'");
            }
          }
          break;
        }
        case 0x8a:    // LONG1
        case 0x8b: {  // LONG4
          std::size_t n = op == 0x8a ? le(1) : le(4);
          bool big = false;
          auto v = make(signed_le(take(n), &big));
          v->big = big;
          push(v);
          break;
        }
        case 'G': {  // BINFLOAT: big-endian IEEE 754
          std::string_view s = take(8);
          std::uint64_t bits = 0;
          for (char c : s) bits = (bits << 8) | static_cast<unsigned char>(c);
          double d;
          std::memcpy(&d, &bits, sizeof d);
          push(make(d));
          break;
        }
        case 'F': {  // FLOAT (text)
          std::string text(line());
          try {
            push(make(std::stod(text)));
          } catch (...) {
            fail("bad float '" + text + "'");
          }
          break;
        }
        case 0x88:
          push(make(true));
          break;
        case 0x89:
          push(make(false));
          break;
        case 'N':
          push(make(PickleValue::None{}));
          break;
        case 'p': {  // PUT (text index)
          std::string text(line());
          try {
            memo_put(std::stoull(text));
          } catch (const Error&) {
            throw;
          } catch (...) {
            fail("bad memo index");
          }
          break;
        }
        case 'q':  // BINPUT
          memo_put(le(1));
          break;
        case 'r':  // LONG_BINPUT
          memo_put(le(4));
          break;
        case 0x94:  // MEMOIZE
          memo_put(memo_.size());
          break;
        case 'g': {  // GET (text index)
          std::string text(line());
          try {
            memo_get(std::stoull(text));
          } catch (const Error&) {
            throw;
          } catch (...) {
            fail("bad memo index");
          }
          break;
        }
        case 'h':  // BINGET
          memo_get(le(1));
          break;
        case 'j':  // LONG_BINGET
          memo_get(le(4));
          break;
        case '0':  // POP
          if (stack_.empty()) fail("stack underflow");
          stack_.pop_back();
          break;
        case '2':  // DUP
          push(top());
          break;
        case '1':  // POP_MARK
          pop_mark();
          break;
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", op);
          fail(std::string("unsupported pickle opcode ") + hex +
               " (not plain data: classes or code)");
        }
      }
    }
    op_at_ = pos_;
    fail("truncated pickle (no STOP)");
  }

  std::string_view in_;
  std::size_t pos_ = 0, op_at_ = 0;
  std::vector<Slot> stack_;
  std::unordered_map<std::uint64_t, std::shared_ptr<PickleValue>> memo_;
};

}  // namespace

PickleRef read_pickle(std::string_view bytes, std::string* why) {
  return Reader(bytes).run(why);
}

}  // namespace gpustitch::replay
