// A simulated timeline and its Chrome trace (Perfetto / chrome://tracing).
// Plain values; thread-compatible.
#pragma once

#include <string>
#include <vector>

#include "planner/chains.h"

namespace bytecomp::planner {

struct TraceEvent {
  std::string name;
  std::string what;
  Resource resource;
  bool compute = false;
  double start_us = 0, end_us = 0;
};

struct Timeline {
  double iteration_us = 0;
  double backward_end_us = 0;   // relative to backward start
  double comm_end_us = 0;       // last decompression / collective
  std::vector<TraceEvent> events;
  // Chrome trace JSON (Perfetto / chrome://tracing).
  std::string chrome_trace_json() const;
};

}  // namespace bytecomp::planner
