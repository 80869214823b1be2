#include "http.h"

#include <sstream>

#include "prometheus.h"

namespace gpustitch::daemon {
namespace http = boost::beast::http;

void limit_http_parser(HttpParser& parser) {
  parser.header_limit(8192);
  parser.body_limit(0);
}

HttpResponse http_respond(const HttpRequest& req, const ProcessTable& table) {
  HttpResponse res;
  res.version(req.version());
  res.keep_alive(false);
  std::string_view target(req.target().data(), req.target().size());
  bool head = req.method() == http::verb::head;
  if ((req.method() == http::verb::get || head) &&
      (target == "/metrics" || target.rfind("/metrics?", 0) == 0)) {
    res.result(http::status::ok);
    res.set(http::field::content_type, "text/plain; version=0.0.4; charset=utf-8");
    res.body() = format_prometheus(table);
    if (head) {
      // The length a GET would have, no body.
      res.content_length(res.body().size());
      res.body().clear();
      return res;
    }
  } else {
    res.result(http::status::not_found);
    res.set(http::field::content_type, "text/plain");
    res.body() = "gpustitchd: metrics are at /metrics\n";
  }
  res.prepare_payload();
  return res;
}

std::optional<std::string> http_answer(std::string_view bytes, const ProcessTable& table) {
  HttpParser parser;
  limit_http_parser(parser);
  parser.eager(true);
  boost::beast::error_code ec;
  std::size_t used = 0;
  while (used < bytes.size() && !parser.is_done()) {
    std::size_t n = parser.put(boost::asio::buffer(bytes.data() + used, bytes.size() - used), ec);
    if (ec == http::error::need_more) break;
    if (ec) return std::nullopt;
    if (n == 0) break;
    used += n;
  }
  if (!parser.is_done()) return std::nullopt;
  HttpResponse res = http_respond(parser.get(), table);
  std::ostringstream out;
  out << res.base();
  if (!(parser.get().method() == http::verb::head && res.result() == http::status::ok))
    out << res.body();
  return out.str();
}

}  // namespace gpustitch::daemon
