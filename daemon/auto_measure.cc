// What the auto tuner measures and how it turns measurements into a profile
// (daemon/auto_tuner.h): OS probes (local endpoints, process CPU time, host
// id), the pure profile math over phase records, compressor micro-benchmarks,
// and the atomic run-directory writes.
#include "daemon/auto_tuner.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "common/log.h"
#include "compress/compressor.h"
#include "daemon/engine.h"
#include "planner/strategy/strategy.h"

namespace bytecomp::daemon {

using Clock = std::chrono::steady_clock;
using strategy::CompressorMeasure;
using strategy::LinearFit;
using strategy::NodeProfile;

namespace {

double thread_cpu_us() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) / 1e3;
}

}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

bool endpoint_is_local(const std::string& endpoint) {
  const size_t scheme = endpoint.find("://");
  if (scheme == std::string::npos) return false;
  const std::string proto = endpoint.substr(0, scheme);
  if (proto == "ipc" || proto == "inproc") return true;
  std::string host = endpoint.substr(scheme + 3);
  const size_t colon = host.rfind(':');
  if (colon != std::string::npos && host.find(']') == std::string::npos) host.resize(colon);
  if (!host.empty() && host.front() == '[') {
    const size_t close = host.find(']');
    if (close == std::string::npos) return false;
    host = host.substr(1, close - 1);
  }
  in_addr v4{};
  in6_addr v6{};
  const bool is4 = inet_pton(AF_INET, host.c_str(), &v4) == 1;
  const bool is6 = !is4 && inet_pton(AF_INET6, host.c_str(), &v6) == 1;
  if (!is4 && !is6) return false;
  if (is4 && (ntohl(v4.s_addr) >> 24) == 127) return true;
  if (is6 && IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool local = false;
  for (ifaddrs* a = list; a && !local; a = a->ifa_next) {
    if (!a->ifa_addr) continue;
    if (is4 && a->ifa_addr->sa_family == AF_INET)
      local = reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr == v4.s_addr;
    else if (is6 && a->ifa_addr->sa_family == AF_INET6)
      local = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, &v6,
                          sizeof v6) == 0;
  }
  freeifaddrs(list);
  return local;
}

std::optional<double> process_cpu_us(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!f || !std::getline(f, text)) return std::nullopt;
  // The command name (field 2) may hold spaces and parentheses: fields
  // are counted from after its last ')'; utime and stime are fields 14, 15.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream in(text.substr(close + 1));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int k = 3; k <= 15 && in >> field; ++k) {
    try {
      if (k == 14) utime = std::stoull(field);
      if (k == 15) stime = std::stoull(field);
    } catch (const std::exception&) {
      return std::nullopt;
    }
    if (k == 15) {
      const long hz = ::sysconf(_SC_CLK_TCK);
      return static_cast<double>(utime + stime) * 1e6 / static_cast<double>(hz > 0 ? hz : 100);
    }
  }
  return std::nullopt;
}

std::optional<double> host_busy_cpu_us(std::string_view stat_text) {
  // The aggregate line: "cpu  user nice system idle iowait irq softirq
  // steal guest guest_nice" in clock ticks. Busy is everything but idle and
  // iowait; steal is CPU the hypervisor gave to someone else, as lost to
  // this host's work as another process's; guest time is already in user
  // and nice.
  const size_t eol = stat_text.find('\n');
  const std::string line(stat_text.substr(0, eol));
  std::istringstream in(line);
  std::string tag;
  if (!(in >> tag) || tag != "cpu") return std::nullopt;
  unsigned long long v[8] = {};
  for (int k = 0; k < 8; ++k) {
    std::string field;
    if (!(in >> field)) {
      if (k < 4) return std::nullopt;  // older kernels stop after iowait/irq/...
      break;
    }
    try {
      size_t used = 0;
      v[k] = std::stoull(field, &used);
      if (used != field.size()) return std::nullopt;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  const unsigned long long busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
  const long hz = ::sysconf(_SC_CLK_TCK);
  return static_cast<double>(busy) * 1e6 / static_cast<double>(hz > 0 ? hz : 100);
}

std::optional<double> host_busy_cpu_us() {
  std::ifstream f("/proc/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return std::nullopt;
  return host_busy_cpu_us(line);
}

std::string host_id() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!f || !std::getline(f, id)) return "";
  return id;
}

std::vector<size_t> probe_order(size_t servers, uint32_t rank) {
  std::vector<size_t> order;
  for (size_t i = 0; i < servers; ++i) order.push_back((rank + 1 + i) % servers);
  return order;
}

std::vector<IterationSample> iteration_samples(const std::vector<PhaseRecord>& records,
                                               const std::vector<uint32_t>& partitions) {
  struct Iter {
    size_t records = 0;
    uint64_t end = 0;
    std::vector<uint64_t> ready;
  };
  size_t expected = 0;
  for (uint32_t p : partitions) expected += p;
  std::map<uint64_t, Iter> by;
  for (const PhaseRecord& r : records) {
    if (r.tensor >= partitions.size()) continue;
    Iter& it = by[r.iteration];
    if (it.ready.empty()) it.ready.assign(partitions.size(), 0);
    ++it.records;
    it.end = std::max(it.end, r.at(Phase::kCopiedOut));
    uint64_t& rd = it.ready[r.tensor];
    const uint64_t all = r.at(Phase::kAllRanks);
    if (all != 0 && (rd == 0 || all < rd)) rd = all;
  }
  std::vector<IterationSample> out;
  for (auto it = by.begin(); it != by.end(); ++it) {
    auto prev = by.find(it->first - 1);
    if (it->first == 0 || prev == by.end()) continue;
    const Iter& cur = it->second;
    if (cur.records != expected || prev->second.records != expected) continue;
    const uint64_t start = prev->second.end;
    if (cur.end <= start) continue;
    IterationSample s;
    s.iteration = it->first;
    s.iteration_us = static_cast<double>(cur.end - start) / 1e3;
    s.ready_us.reserve(cur.ready.size());
    for (uint64_t rd : cur.ready)
      s.ready_us.push_back(rd > start ? static_cast<double>(rd - start) / 1e3 : 0.0);
    out.push_back(std::move(s));
  }
  return out;
}

LinearFit reduce_fit(const std::vector<PhaseRecord>& records, const std::vector<uint64_t>& elements,
                     const std::vector<uint64_t>& last_elements,
                     const std::vector<uint32_t>& partitions) {
  std::vector<std::pair<double, double>> pts;
  for (const PhaseRecord& r : records) {
    if (r.tensor >= partitions.size()) continue;
    const uint64_t a = r.at(Phase::kStart), b = r.at(Phase::kReduced);
    if (a == 0 || b < a) continue;
    const uint64_t n =
        r.partition + 1 == partitions[r.tensor] ? last_elements[r.tensor] : elements[r.tensor];
    pts.emplace_back(static_cast<double>(n), static_cast<double>(b - a) / 1e3);
  }
  return strategy::fit_linear(pts);
}

NodeProfile profile_of(const std::vector<IterationSample>& samples,
                       const std::vector<std::string>& names,
                       const std::vector<uint64_t>& elements) {
  NodeProfile p;
  std::vector<double> its;
  for (const IterationSample& s : samples) its.push_back(s.iteration_us);
  p.iteration_us = median(its);
  p.iterations = samples.size();
  p.first_iteration = samples.empty() ? 0 : samples.front().iteration;
  for (size_t t = 0; t < names.size(); ++t) {
    std::vector<double> r;
    for (const IterationSample& s : samples)
      if (t < s.ready_us.size()) r.push_back(s.ready_us[t]);
    p.tensors.push_back({names[t], elements[t], median(r)});
  }
  return p;
}

CompressorMeasure measure_compressor(const std::string& spec, const std::vector<uint64_t>& sizes,
                                     int reps) {
  CompressorMeasure m;
  m.spec = spec;
  auto c = compress::make_compressor(compress::parse_compressor_spec(spec));
  std::mt19937 rng(12345);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<std::pair<double, double>> cp, dp, wire;
  for (uint64_t n : sizes) {
    if (n == 0) continue;
    std::vector<float> in(n), out(n);
    for (float& x : in) x = nd(rng);
    const size_t cap = c->max_compressed_bytes(n);
    std::vector<uint64_t> words((cap + 7) / 8);
    std::span<std::byte> buf(reinterpret_cast<std::byte*>(words.data()), cap);
    auto state = c->make_state(n);
    std::vector<double> ct, dt;
    size_t len = 0;
    for (int r = 0; r < reps; ++r) {
      compress::CompressContext ctx;
      ctx.iteration = static_cast<uint64_t>(r);
      ctx.shared_seed = n;
      double t0 = thread_cpu_us();
      len = c->compress(compress::ConstTensorView(in.data(), n), buf, *state, ctx);
      ct.push_back(thread_cpu_us() - t0);
      t0 = thread_cpu_us();
      c->decompress({buf.data(), len}, compress::TensorView::cpu(out.data(), n), false, ctx);
      dt.push_back(thread_cpu_us() - t0);
    }
    cp.emplace_back(static_cast<double>(n), median(ct));
    dp.emplace_back(static_cast<double>(n), median(dt));
    wire.emplace_back(static_cast<double>(n), static_cast<double>(len));
  }
  m.compress = strategy::fit_linear(cp);
  m.decompress = strategy::fit_linear(dp);
  const LinearFit w = strategy::fit_linear(wire);
  m.bytes_per_element = std::max(0.0, w.b_us_per_melem / 1048576.0);
  m.fixed_bytes = std::max(0.0, w.a_us);
  return m;
}

std::string write_file_atomic(const std::string& dir, const std::string& name,
                              const std::string& text) {
  const std::string path = dir + "/" + name;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);  // a failure shows at mkstemp
  char host[64] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "host");
  for (char* h = host; *h; ++h)
    if (*h == '/') *h = '_';
  // ".<name>.<host>.<pid>.XXXXXX": hidden, and unique across writers.
  std::string tmp = dir + "/." + name + "." + host + "." + std::to_string(::getpid()) + ".XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) return "cannot write " + path + ": creating " + tmp + ": " + std::strerror(errno);
  (void)::fchmod(fd, 0644);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? std::strerror(errno) : "short write";
      ::close(fd);
      ::unlink(tmp.c_str());
      return "cannot write " + path + ": " + why;
    }
    done += static_cast<size_t>(n);
  }
  if (::close(fd) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return "cannot write " + path + ": " + why;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    return "cannot write " + path + ": " + why;
  }
  return "";
}

}  // namespace bytecomp::daemon
