#include "planner/trace.h"

#include <charconv>
#include <cstdio>
#include <string_view>

namespace bytecomp::planner {

namespace {
void append_escaped(std::string& out, std::string_view s) {
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
}
}  // namespace

std::string Timeline::chrome_trace_json() const {
  // The online planner writes one with every decision, and events are
  // most of it: one string appended in place (no stream, which formats
  // doubles slowly and copies the text twice), times at nanosecond
  // resolution.
  std::string out;
  out.reserve(512 + events.size() * 200);
  auto num = [&out](double v, bool fixed) {
    char b[64];
    auto [end, ec] = fixed ? std::to_chars(b, b + sizeof b, v, std::chars_format::fixed, 3)
                           : std::to_chars(b, b + sizeof b, v, std::chars_format::general, 12);
    if (ec == std::errc()) out.append(b, end);
    else out += '0';
  };
  out += "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  out += R"({"ph":"M","pid":0,"tid":9,"name":"thread_name","args":{"name":"GPU backward"}})";
  const char* tracks[] = {"GPU compression", "CPU compression pool", "intra-node link",
                          "inter-node link", "inter-node link (receive)"};
  for (int r = 0; r < kResources; ++r) {
    out += ",\n";
    out += R"({"ph":"M","pid":0,"tid":)";
    out += static_cast<char>('0' + r);
    out += R"(,"name":"thread_name","args":{"name":")";
    out += tracks[r];
    out += "\"}}";
  }
  for (const TraceEvent& e : events) {
    out += ",\n";
    out += R"({"ph":"X","pid":0,"tid":)";
    out += static_cast<char>('0' + (e.compute ? 9 : static_cast<int>(e.resource)));
    out += R"(,"name":")";
    append_escaped(out, e.name);
    out += R"(","cat":")";
    append_escaped(out, e.what);
    out += R"(","ts":)";
    num(e.start_us, true);
    out += R"(,"dur":)";
    num(e.end_us - e.start_us, true);
    out += R"(,"args":{"op":")";
    append_escaped(out, e.what);
    out += "\"}}";
  }
  out += "],\"otherData\":{\"iteration_us\":";
  num(iteration_us, false);
  out += ",\"backward_end_us\":";
  num(backward_end_us, false);
  out += ",\"comm_end_us\":";
  num(comm_end_us, false);
  out += "}}\n";
  return out;
}

}  // namespace bytecomp::planner
