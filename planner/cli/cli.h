// bytecomp-plan: command-line front end of the planner (docs/planner.md).
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace bytecomp::planner {

// Runs the CLI with arguments (without the program name); returns the exit
// status. Errors are printed to `err` as one line naming what was wrong.
int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

// Directory holding profiles/ and clusters/ (BYTECOMP_PLANNER_DATA, else the
// source tree's planner/).
std::string planner_data_dir();

}  // namespace bytecomp::planner
