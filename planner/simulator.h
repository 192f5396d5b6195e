// The planner's cost model and timeline simulator F(S) (paper section 4.3),
// in three parts:
//   chains.h     options -> operation chains on the machine's resources
//                (Problem, Op, chain_latency)
//   evaluator.h  the incremental simulator over those chains (Evaluator)
//   trace.h      the simulated timeline and its Chrome trace (Timeline)
// Include this header for all three. See docs/planner.md.
#pragma once

#include "planner/chains.h"
#include "planner/evaluator.h"
#include "planner/trace.h"
