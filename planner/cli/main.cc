#include <iostream>

#include "common/log.h"
#include "planner/cli/cli.h"

int main(int argc, char** argv) {
  bytecomp::log::configure_from_env();
  return bytecomp::planner::run_cli({argv + 1, argv + argc}, std::cout, std::cerr);
}
