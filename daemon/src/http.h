// The metrics endpoint's HTTP side, apart from the sockets (server.cpp) so that the request
// parser and the routing can be fuzzed and tested on bytes: GET or HEAD /metrics answers the
// Prometheus text, anything else 404. One request per connection, no body accepted.
#pragma once

// Boost 1.74's Asio uses std::exchange without including <utility> in C++20 mode.
#include <utility>

#include <boost/beast/http.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "process_table.h"

namespace gpustitch::daemon {

using HttpRequest = boost::beast::http::request<boost::beast::http::empty_body>;
using HttpResponse = boost::beast::http::response<boost::beast::http::string_body>;
using HttpParser = boost::beast::http::request_parser<boost::beast::http::empty_body>;

// The limits every request is parsed under: 8 KiB of headers, no body.
void limit_http_parser(HttpParser& parser);

// The answer to one parsed request.
HttpResponse http_respond(const HttpRequest& request, const ProcessTable& table);

// bytes as one request: the serialized answer, or nullopt when the parser refuses them (the
// connection is then closed without an answer).
std::optional<std::string> http_answer(std::string_view bytes, const ProcessTable& table);

}  // namespace gpustitch::daemon
