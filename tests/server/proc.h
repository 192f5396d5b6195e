// Child processes for the server tests: fork/exec with stdout/stderr to
// files, bounded waits, and a destructor that always kills and reaps.
//
// Thread-safety: neither; one test thread owns each Process.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace bytecomp::server::testing {

inline std::string self_dir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("readlink /proc/self/exe failed");
  std::string p(buf, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/'));
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class Process {
 public:
  // `env` entries ("NAME=value") are added to (or replace in) the child's
  // environment.
  Process(std::vector<std::string> args, const std::string& out_path, const std::string& err_path,
          std::vector<std::string> env = {})
      : out_path_(out_path), err_path_(err_path) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e) {
      std::string v(*e);
      bool replaced = false;
      for (const std::string& x : env)
        replaced |= v.substr(0, v.find('=') + 1) == x.substr(0, x.find('=') + 1);
      if (!replaced) envs.push_back(v);
    }
    for (const std::string& x : env) envs.push_back(x);
    std::vector<char*> envp;
    for (auto& e : envs) envp.push_back(e.data());
    envp.push_back(nullptr);
    int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (out < 0 || err < 0) throw std::runtime_error("cannot open " + out_path);
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      // A test binary that dies (crash, sanitizer halt) takes its children
      // with it instead of leaving servers behind.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      dup2(out, 1);
      dup2(err, 2);
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    close(out);
    close(err);
  }
  ~Process() { kill(SIGKILL); }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  bool running() {
    if (pid_ <= 0) return false;
    int st = 0;
    pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = st;
      pid_ = -1;
      return false;
    }
    return true;
  }
  // Waits for exit; false on timeout (the process keeps running).
  bool wait(std::chrono::milliseconds within) {
    auto until = std::chrono::steady_clock::now() + within;
    while (running()) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }
  void kill(int sig) {
    if (pid_ > 0) {
      ::kill(pid_, sig);
      if (sig == SIGKILL) wait(std::chrono::seconds(10));
    }
  }
  // Exit code, or -signal, or -1000 while running.
  int exit_code() const {
    if (pid_ > 0) return -1000;
    if (WIFEXITED(status_)) return WEXITSTATUS(status_);
    if (WIFSIGNALED(status_)) return -WTERMSIG(status_);
    return -999;
  }
  std::string out() const { return read_file(out_path_); }
  std::string err() const { return read_file(err_path_); }
  // Waits until stdout contains `text`.
  bool wait_for_output(const std::string& text, std::chrono::milliseconds within) {
    auto until = std::chrono::steady_clock::now() + within;
    while (out().find(text) == std::string::npos) {
      if (std::chrono::steady_clock::now() >= until || !running()) return out().find(text) != std::string::npos;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

 private:
  pid_t pid_ = -1;
  int status_ = 0;
  std::string out_path_, err_path_;
};

}  // namespace bytecomp::server::testing
