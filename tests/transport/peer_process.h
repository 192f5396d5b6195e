// Runs tests/transport/transport_peer as a child process (fork/exec) and
// reads the endpoint it listens on. The child lives until this object closes
// its stdin (or kill() sends SIGKILL); the destructor always reaps it.
//
// Thread-safety: neither; one test thread owns each PeerProcess.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace bytecomp::transport::testing {

// Directory of the running executable (the peer binary is built beside it).
inline std::string self_dir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("readlink /proc/self/exe failed");
  std::string p(buf, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/'));
}

class PeerProcess {
 public:
  PeerProcess(const std::string& config_path, NodeId node,
              const std::vector<std::pair<NodeId, std::string>>& connect = {},
              const std::string& stderr_path = {}) {
    std::vector<std::string> args = {self_dir() + "/transport_peer", "--config", config_path,
                                     "--node", std::to_string(node)};
    for (auto& [id, addr] : connect) {
      args.push_back("--connect");
      args.push_back(std::to_string(id) + "=" + addr);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0)
      throw std::runtime_error("pipe2 failed");
    int err_fd = -1;
    if (!stderr_path.empty())
      err_fd = open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      // Only async-signal-safe calls until exec.
      dup2(in[0], 0);
      dup2(out[1], 1);
      if (err_fd >= 0) dup2(err_fd, 2);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    if (err_fd >= 0) close(err_fd);
    stdin_ = in[1];
    stdout_ = out[0];
    address_ = read_address();
  }
  ~PeerProcess() { stop(); }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }

  void kill9() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      reap(std::chrono::seconds(10));
    }
  }

  // Graceful: close stdin, wait a while, then SIGKILL.
  void stop() {
    if (stdin_ >= 0) close(stdin_);
    stdin_ = -1;
    if (pid_ > 0 && !reap(std::chrono::seconds(10))) kill9();
    if (stdout_ >= 0) close(stdout_);
    stdout_ = -1;
  }

  // Exit status after stop()/kill9(); -1 when unknown.
  int exit_status() const { return status_; }

 private:
  bool reap(std::chrono::milliseconds within) {
    auto until = std::chrono::steady_clock::now() + within;
    while (pid_ > 0) {
      int st = 0;
      pid_t r = waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        status_ = st;
        pid_ = -1;
        return true;
      }
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return true;
  }

  std::string read_address() {
    std::string line;
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (line.find('\n') == std::string::npos) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        kill9();
        throw std::runtime_error("transport_peer did not report its address within 20 s");
      }
      pollfd p{stdout_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[512];
      ssize_t n = read(stdout_, buf, sizeof buf);
      if (n <= 0) {
        kill9();
        throw std::runtime_error("transport_peer exited before reporting its address (status " +
                                 std::to_string(status_) + ")");
      }
      line.append(buf, static_cast<size_t>(n));
    }
    line = line.substr(0, line.find('\n'));
    if (line.rfind("ADDR ", 0) != 0) throw std::runtime_error("transport_peer said: " + line);
    return line.substr(5);
  }

  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  int status_ = -1;
  std::string address_;
};

}  // namespace bytecomp::transport::testing
