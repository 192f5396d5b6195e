#include "planner/trace.h"

#include <charconv>
#include <cstdio>
#include <sstream>

namespace bytecomp::planner {

namespace {
std::string json_escape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", ch);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out;
}
}  // namespace

std::string Timeline::chrome_trace_json() const {
  std::ostringstream os;
  os.precision(12);
  os << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  const char* tracks[] = {"GPU compression", "CPU compression pool", "intra-node link",
                          "inter-node link", "inter-node link (receive)"};
  bool first = true;
  auto sep = [&] {
    if (!first) os << ",\n";
    first = false;
  };
  sep();
  os << R"({"ph":"M","pid":0,"tid":9,"name":"thread_name","args":{"name":"GPU backward"}})";
  for (int r = 0; r < kResources; ++r) {
    sep();
    os << R"({"ph":"M","pid":0,"tid":)" << r << R"(,"name":"thread_name","args":{"name":")"
       << tracks[r] << "\"}}";
  }
  // Events are most of the text: appended with to_chars (shortest exact
  // form) rather than through the stream, which formats doubles slowly.
  std::string buf;
  buf.reserve(events.size() * 160);
  auto num = [&buf](double v) {
    char b[32];
    auto [end, ec] = std::to_chars(b, b + sizeof b, v);
    if (ec == std::errc()) buf.append(b, end);
    else buf += '0';
  };
  for (const TraceEvent& e : events) {
    if (!first) buf += ",\n";
    first = false;
    buf += R"({"ph":"X","pid":0,"tid":)";
    buf += std::to_string(e.compute ? 9 : static_cast<int>(e.resource));
    buf += R"(,"name":")";
    buf += json_escape(e.name);
    buf += R"(","cat":")";
    const std::string what = json_escape(e.what);
    buf += what;
    buf += R"(","ts":)";
    num(e.start_us);
    buf += R"(,"dur":)";
    num(e.end_us - e.start_us);
    buf += R"(,"args":{"op":")";
    buf += what;
    buf += "\"}}";
  }
  os << buf;
  os << "],\"otherData\":{\"iteration_us\":" << iteration_us
     << ",\"backward_end_us\":" << backward_end_us << ",\"comm_end_us\":" << comm_end_us
     << "}}\n";
  return os.str();
}

}  // namespace bytecomp::planner
