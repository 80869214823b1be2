// terminal_text, terminal_json: see terminal_text.h.
#include "terminal_text.h"

#include <cstdint>

namespace gpustitch::cli {
namespace {

// Decodes one UTF-8 sequence at text[i]. Returns its length (0: not valid UTF-8 there) and the
// code point in *cp. Overlong forms, surrogates and values above U+10FFFF are invalid.
std::size_t decode(std::string_view text, std::size_t i, std::uint32_t* cp) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  std::size_t len;
  std::uint32_t v, min;
  if ((b0 & 0xe0) == 0xc0) {
    len = 2, v = b0 & 0x1f, min = 0x80;
  } else if ((b0 & 0xf0) == 0xe0) {
    len = 3, v = b0 & 0x0f, min = 0x800;
  } else if ((b0 & 0xf8) == 0xf0) {
    len = 4, v = b0 & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (text.size() - i < len) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xc0) != 0x80) return 0;
    v = (v << 6) | (byte(i + k) & 0x3f);
  }
  if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
  *cp = v;
  return len;
}

bool acted_on(std::uint32_t cp) {
  return cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp <= 0x9f) || (cp >= 0x202a && cp <= 0x202e) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

std::string terminal_text(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    std::uint32_t cp = 0;
    const std::size_t len = decode(text, i, &cp);
    if (len == 0) {
      out += '?';
      ++i;
      continue;
    }
    if (acted_on(cp))
      out += '?';
    else
      out.append(text.substr(i, len));
    i += len;
  }
  return out;
}

std::string terminal_json(std::string_view dumped) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(dumped.size());
  for (std::size_t i = 0; i < dumped.size(); ++i) {
    const auto b = static_cast<unsigned char>(dumped[i]);
    // U+0080-U+009F is C2 80-C2 9F; C2 is never a continuation byte, so this is always a start.
    if (b == 0xc2 && i + 1 < dumped.size()) {
      const auto next = static_cast<unsigned char>(dumped[i + 1]);
      if (next >= 0x80 && next <= 0x9f) {
        out += "\\u00";
        out += kHex[next >> 4];
        out += kHex[next & 15];
        ++i;
        continue;
      }
    }
    // U+202A-U+202E is E2 80 AA-AE, U+2066-U+2069 is E2 81 A6-A9 (E2 is never a continuation).
    if (b == 0xe2 && i + 2 < dumped.size()) {
      const auto b1 = static_cast<unsigned char>(dumped[i + 1]);
      const auto b2 = static_cast<unsigned char>(dumped[i + 2]);
      if ((b1 == 0x80 && b2 >= 0xaa && b2 <= 0xae) || (b1 == 0x81 && b2 >= 0xa6 && b2 <= 0xa9)) {
        const unsigned cp = 0x2000u + ((b1 & 0x3fu) << 6) + (b2 & 0x3fu);
        out += "\\u";
        out += kHex[(cp >> 12) & 15];
        out += kHex[(cp >> 8) & 15];
        out += kHex[(cp >> 4) & 15];
        out += kHex[cp & 15];
        i += 2;
        continue;
      }
    }
    out += dumped[i];
  }
  return out;
}

}  // namespace gpustitch::cli
