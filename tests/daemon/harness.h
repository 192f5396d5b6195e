// Test harness: real bytecompd and bc_worker processes in a private
// temporary directory. Every process started is killed and reaped when its
// handle goes away, so a failing test leaves no process behind.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace bctest {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

inline std::string build_root() {
  const char* b = std::getenv("BYTECOMP_BUILD_ROOT");
  return b != nullptr ? b : ".";
}

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A child process with stdout+stderr in a file.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const fs::path& log,
          const std::vector<std::string>& env = {})
      : log_(log) {
    pid_ = ::fork();
    if (pid_ == 0) {
      for (const auto& kv : env) {
        const auto eq = kv.find('=');
        ::setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 1);
      }
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> a;
      for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
      a.push_back(nullptr);
      ::execv(a[0], a.data());
      std::_Exit(127);
    }
  }
  ~Process() {
    if (pid_ > 0 && !status_) {
      ::kill(pid_, SIGKILL);
      int st;
      ::waitpid(pid_, &st, 0);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) const { ::kill(pid_, sig); }
  // Exit status (or 128+signal), nullopt if still running after `timeout`.
  std::optional<int> wait(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!status_) {
      int st = 0;
      const pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) return std::nullopt;
      std::this_thread::sleep_for(5ms);
    }
    return status_;
  }
  std::string output() const { return read_file(log_); }
  // Waits until the output contains `text`.
  bool wait_output(const std::string& text, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (output().find(text) != std::string::npos) return true;
      if (status_ || ::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        return output().find(text) != std::string::npos;
      }
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
  fs::path log_;
};

inline bool can_connect(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// Segments in /dev/shm whose name starts with `prefix`.
inline std::vector<std::string> shm_entries(const std::string& prefix) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator("/dev/shm")) {
    const std::string n = e.path().filename().string();
    if (n.rfind(prefix, 0) == 0) out.push_back(n);
  }
  return out;
}

// True once no segment with `prefix` is left (the daemon tears a job down
// just after its clients see the end, so give it a moment).
inline bool no_shm_left(const std::string& prefix,
                        std::chrono::milliseconds timeout = std::chrono::seconds(3)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!shm_entries(prefix).empty()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// A private directory, a daemon config and the daemon process.
// Waits up to 10 s for the `nth` strategy change `daemon` announced
// ("applies on every node from iteration N") and returns N, or -1 (a
// failure is added) when it did not come.
inline int64_t announced_change(const Process& daemon, size_t nth) {
  const std::regex re("applies on every node from iteration ([0-9]+)");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string log = daemon.output();
    size_t k = 0;
    for (auto m = std::sregex_iterator(log.begin(), log.end(), re); m != std::sregex_iterator(); ++m)
      if (++k == nth) return std::stoll((*m)[1]);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "strategy change " << nth << " not announced: " << daemon.output();
  return -1;
}

class DaemonEnv {
 public:
  explicit DaemonEnv(const std::string& tag, const std::string& extra_yaml = "") {
    dir_ = fs::temp_directory_path() /
           ("bcd-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    fs::create_directories(dir_);
    socket_ = (dir_ / "ctl.sock").string();
    instance_ = "t" + std::to_string(::getpid()) + "x" + std::to_string(counter()++);
    write_config(extra_yaml);
  }
  // Stops the daemon gracefully (SIGTERM: it aborts jobs and removes their
  // segments), then insists that nothing of this instance is left.
  ~DaemonEnv() {
    if (daemon_) {
      daemon_->signal(SIGTERM);
      (void)daemon_->wait(std::chrono::seconds(10));
      daemon_.reset();
    }
    for (const auto& n : shm_entries(shm_prefix())) {
      ADD_FAILURE() << "left in /dev/shm: " << n;
      fs::remove("/dev/shm/" + n);
    }
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  void write_config(const std::string& extra_yaml, const std::string& scheduler = "") {
    std::ofstream(dir_ / "daemon.yaml")
        << "version: 1\ncontrol:\n  socket: " << socket_
        << "\n  setup_timeout_ms: 5000\nshm:\n  instance: " << instance_
        << "\nscheduler:\n  threads: 1\n" << scheduler << extra_yaml;
  }

  // Starts bytecompd and waits until its socket answers.
  // `env` may set BYTECOMP_LOG; the default is info.
  void start(std::vector<std::string> env = {}) {
    bool levels = false;
    for (const auto& kv : env) levels |= kv.rfind("BYTECOMP_LOG=", 0) == 0;
    if (!levels) env.push_back("BYTECOMP_LOG=info");
    daemon_ = std::make_unique<Process>(
        std::vector<std::string>{build_root() + "/daemon/bytecompd", "--config",
                                 (dir_ / "daemon.yaml").string()},
        dir_ / ("daemon" + std::to_string(starts_++) + ".log"),
        env);
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!can_connect(socket_)) {
      if (std::chrono::steady_clock::now() > deadline || daemon_->wait(0ms)) {
        throw std::runtime_error("bytecompd did not come up: " + daemon_->output());
      }
      std::this_thread::sleep_for(5ms);
    }
  }

  std::unique_ptr<Process> worker(const std::string& job, int rank, int size, int iters,
                                  const std::string& spec,
                                  const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv{build_root() + "/tests/daemon/bc_worker", socket_, job,
                                  std::to_string(rank), std::to_string(size),
                                  std::to_string(iters), spec};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return std::make_unique<Process>(
        argv, dir_ / (job + "-r" + std::to_string(rank) + "-" + std::to_string(counter()++) +
                      ".log"));
  }

  Process& daemon() { return *daemon_; }
  void drop_daemon() { daemon_.reset(); }
  const std::string& socket() const { return socket_; }
  const std::string& instance() const { return instance_; }
  std::string shm_prefix() const { return "bytecomp." + instance_ + "."; }
  const fs::path& dir() const { return dir_; }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  fs::path dir_;
  std::string socket_;
  std::string instance_;
  int starts_ = 0;
  std::unique_ptr<Process> daemon_;
};

}  // namespace bctest
