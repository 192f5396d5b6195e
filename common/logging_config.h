// The `logging:` section every program's config file shares:
//
//   logging:
//     levels: "info,transport=debug"   # same syntax as BYTECOMP_LOG
//
// Applies the levels, then BYTECOMP_LOG (which wins). Throws ConfigError
// located at the key for a bad spec.
#pragma once

#include "common/config.h"

namespace bytecomp::config {

void apply_logging_section(Reader& root);

}  // namespace bytecomp::config
