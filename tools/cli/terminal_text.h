// Text from outside the CLI (records, daemon answers and error strings, trace lines, another
// process's reply) made safe to print on a terminal.
//
// A terminal acts on control characters wherever they appear: ESC (0x1b) starts a sequence that
// can retitle the window, move the cursor, clear the screen or, on some terminals, answer with
// text typed into the shell; so does the 8-bit CSI, both as the raw byte 0x9B and as U+009B
// encoded in UTF-8 (C2 9B), which a check for bytes below 0x20 misses. terminal_text() decodes
// UTF-8 and replaces with '?':
//   - C0 controls (U+0000-U+001F, tab included: tables are aligned with spaces) and DEL (U+007F);
//   - C1 controls (U+0080-U+009F), CSI among them;
//   - the bidirectional overrides and isolates (U+202A-U+202E, U+2066-U+2069), which reorder
//     what follows them on screen;
//   - every byte that is not part of valid UTF-8 (a lone 0x9B among them), one '?' per byte.
// Everything else, non-ASCII letters included, is kept; the result is never longer than the input.
//
// terminal_json() is the JSON text printed by --json with U+0080-U+009F and the bidirectional
// controls above written as \u escapes: the same document for a parser, and nothing a terminal
// acts on (JSON already escapes C0).
#pragma once

#include <string>
#include <string_view>

namespace gpustitch::cli {

std::string terminal_text(std::string_view text);
std::string terminal_json(std::string_view dumped);

}  // namespace gpustitch::cli
