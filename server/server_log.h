// The server's log categories ("server": data path and job lifecycle;
// "coordinator": admission, barriers, strategy changes, aborts).
#pragma once

#include "common/log.h"

namespace bytecomp::server {

BC_LOG_CATEGORY(LogServer, "server");
BC_LOG_CATEGORY(LogCoord, "coordinator");

}  // namespace bytecomp::server
