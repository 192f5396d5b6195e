#include "common/logging_config.h"

#include "common/log.h"

namespace bytecomp::config {

void apply_logging_section(Reader& root) {
  Reader logging = root.section("logging");
  std::string levels;
  logging.get("levels", levels);
  logging.finish();
  if (!levels.empty()) {
    try {
      log::configure(levels);
    } catch (const Error& e) {
      logging.fail("levels", e.what(),
                   "comma-separated [category=]level, levels trace|debug|info|warn|error|off");
    }
  }
  log::configure_from_env();
}

}  // namespace bytecomp::config
