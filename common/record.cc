#include "common/record.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

namespace bytecomp {
namespace {

const char* record_dir() noexcept {
  static const char* dir = [] {
    const char* d = std::getenv("BYTECOMP_RECORD_INPUTS");
    return d && *d ? d : nullptr;
  }();
  return dir;
}

}  // namespace

bool recording_inputs() noexcept { return record_dir() != nullptr; }

void record_input_always(std::string_view target, const void* data, size_t size) noexcept {
  const char* dir = record_dir();
  if (!dir) return;
  try {
    static std::mutex mu;
    static std::map<std::string, int, std::less<>> written;
    std::string sub = std::string(dir) + "/" + std::string(target);
    {
      std::lock_guard lk(mu);
      if (written[sub] >= kMaxRecordsPerTarget) return;
    }
    ::mkdir(dir, 0700);
    ::mkdir(sub.c_str(), 0700);
    uint64_t h = 1469598103934665603ull;
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < size; ++i) h = (h ^ p[i]) * 1099511628211ull;
    char name[32];
    std::snprintf(name, sizeof name, "/%016llx", static_cast<unsigned long long>(h));
    const std::string path = sub + name;
    // O_EXCL: the same input seen twice (or by two processes) is written once.
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) return;
    {
      std::lock_guard lk(mu);
      ++written[sub];
    }
    size_t off = 0;
    while (off < size) {
      const ssize_t w = ::write(fd, p + off, size - off);
      if (w <= 0) break;
      off += static_cast<size_t>(w);
    }
    ::close(fd);
  } catch (...) {
    // Recording is a test aid: never let it disturb the decoder.
  }
}

}  // namespace bytecomp
