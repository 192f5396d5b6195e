// Security checks of issue 18 with a second user: the control socket refuses
// a client of another user unless control.allow_other_users, and a job's
// shared memory is not readable by another user. Needs root (to create the
// users, removed again by every exit path of the test); skipped otherwise.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <sys/stat.h>

#include <cerrno>
#include <functional>

#include "client/ipc/protocol.h"
#include "harness.h"

namespace bctest {
namespace {

namespace ipc = bytecomp::ipc;

// A system user made for the test and deleted with it.
class TempUser {
 public:
  explicit TempUser(const std::string& tag)
      : name_("bcsec" + tag + std::to_string(::getpid() % 100000)) {
    const std::string cmd = "useradd --system --no-create-home --shell /usr/sbin/nologin " +
                            name_ + " >/dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0) return;
    if (const passwd* pw = ::getpwnam(name_.c_str())) {
      uid_ = pw->pw_uid;
      gid_ = pw->pw_gid;
      ok_ = true;
    }
  }
  ~TempUser() {
    if (ok_) (void)std::system(("userdel " + name_ + " >/dev/null 2>&1").c_str());
  }
  TempUser(const TempUser&) = delete;
  TempUser& operator=(const TempUser&) = delete;
  bool ok() const { return ok_; }
  uid_t uid() const { return uid_; }
  gid_t gid() const { return gid_; }

 private:
  std::string name_;
  bool ok_ = false;
  uid_t uid_ = 0;
  gid_t gid_ = 0;
};

bool become(const TempUser& u) {
  return ::setgroups(0, nullptr) == 0 && ::setgid(u.gid()) == 0 && ::setuid(u.uid()) == 0;
}

// Runs `fn` in a child process as `u`; its return value is the exit status.
// Killed (status -1) after 10 s.
int run_as(const TempUser& u, const std::function<int()>& fn) {
  const pid_t pid = ::fork();
  if (pid == 0) std::_Exit(become(u) ? fn() : 99);
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  for (;;) {
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      return -1;
    }
    std::this_thread::sleep_for(5ms);
  }
}

// As the calling user: HELLO to the daemon, then the type of its answer
// (as an exit status: 2 WELCOME, 6 ERROR; 90+ for a failure to talk).
int hello(const std::string& socket, const std::string& want_text = "") {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::strncpy(a.sun_path, socket.c_str(), sizeof a.sun_path - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return 90;
  const auto msg = ipc::encode(ipc::Hello{"sec", 0, 1, 0, 1, "test"});
  // A refused client may find the connection closed already (the daemon
  // refuses at accept, before HELLO): its ERROR is still there to read.
  (void)::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL);
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 5000) != 1) return 92;
  std::vector<uint8_t> buf(ipc::kMaxMessageBytes);
  const ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
  if (n <= 0) return 93;
  try {
    const ipc::Decoded d = ipc::decode({buf.data(), static_cast<size_t>(n)});
    if (d.type == ipc::MsgType::kError && !want_text.empty() &&
        std::get<ipc::ErrorMsg>(d.msg).message.find(want_text) == std::string::npos)
      return 94;
    return static_cast<int>(d.type);
  } catch (const std::exception&) {
    return 95;
  }
}

// bytecompd as user `u` (the test's DaemonEnv starts it as the caller).
std::unique_ptr<Process> daemon_as(const TempUser& u, DaemonEnv& env, int n) {
  if (::chown(env.dir().c_str(), u.uid(), u.gid()) != 0) {
    ADD_FAILURE() << "chown " << env.dir() << ": " << std::strerror(errno);
    return nullptr;
  }
  const fs::path log = env.dir() / ("daemon-as-user" + std::to_string(n) + ".log");
  std::vector<std::string> argv{build_root() + "/daemon/bytecompd", "--config",
                                (env.dir() / "daemon.yaml").string()};
  // Process execs directly, so the user is switched by setpriv (util-linux).
  std::vector<std::string> wrapped{"/usr/bin/setpriv", "--reuid=" + std::to_string(u.uid()),
                                   "--regid=" + std::to_string(u.gid()), "--clear-groups"};
  wrapped.insert(wrapped.end(), argv.begin(), argv.end());
  auto p = std::make_unique<Process>(wrapped, log, std::vector<std::string>{"BYTECOMP_LOG=info"});
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!can_connect(env.socket())) {
    if (std::chrono::steady_clock::now() > deadline || p->wait(0ms)) {
      ADD_FAILURE() << "bytecompd as user " << u.uid() << " did not come up: " << p->output();
      return nullptr;
    }
    std::this_thread::sleep_for(5ms);
  }
  return p;
}

class Security : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to create a second user";
    if (!fs::exists("/usr/bin/setpriv")) GTEST_SKIP() << "needs setpriv (util-linux)";
    a_ = std::make_unique<TempUser>("a");
    b_ = std::make_unique<TempUser>("b");
    if (!a_->ok() || !b_->ok()) GTEST_SKIP() << "useradd failed";
  }
  std::unique_ptr<TempUser> a_, b_;
};

TEST_F(Security, ControlSocketRefusesAnotherUserUnlessAllowed) {
  DaemonEnv env("sec");
  {
    auto d = daemon_as(*a_, env, 0);
    ASSERT_TRUE(d);
    const std::string& sock = env.socket();
    // The daemon's own user is welcome; another user is refused by name.
    EXPECT_EQ(run_as(*a_, [&] { return hello(sock); }), static_cast<int>(ipc::MsgType::kWelcome));
    EXPECT_EQ(run_as(*b_, [&] { return hello(sock, "may not use this bytecompd"); }),
              static_cast<int>(ipc::MsgType::kError));
    // The refusal's reason arrives also when HELLO was sent before the
    // daemon accepted the connection (it is then unread when the daemon
    // closes): the daemon is stopped while the client connects and sends.
    d->signal(SIGSTOP);
    std::thread resume([&] {
      std::this_thread::sleep_for(300ms);
      d->signal(SIGCONT);
    });
    EXPECT_EQ(run_as(*b_, [&] { return hello(sock, "may not use this bytecompd"); }),
              static_cast<int>(ipc::MsgType::kError));
    resume.join();
    d->signal(SIGTERM);
    ASSERT_TRUE(d->wait(10s));
    EXPECT_NE(d->output().find("user " + std::to_string(b_->uid()) + " may not use this bytecompd"),
              std::string::npos)
        << d->output();
  }
  {
    std::ofstream(env.dir() / "daemon.yaml")
        << "version: 1\ncontrol:\n  socket: " << env.socket()
        << "\n  allow_other_users: true\n  setup_timeout_ms: 5000\nshm:\n  instance: "
        << env.instance() << "\nscheduler:\n  threads: 1\n";
    auto d = daemon_as(*a_, env, 1);
    ASSERT_TRUE(d);
    EXPECT_EQ(run_as(*b_, [&] { return hello(env.socket()); }),
              static_cast<int>(ipc::MsgType::kWelcome));
    d->signal(SIGTERM);
    EXPECT_TRUE(d->wait(10s));
  }
}

TEST_F(Security, JobSharedMemoryIsNotReadableByAnotherUser) {
  DaemonEnv env("secshm");
  env.start();  // as root: it hands each job's segment to the job's user
  // A one-rank job of user A that starts and then never pushes, so its
  // segment stays while we look at it.
  std::vector<std::string> argv{"/usr/bin/setpriv", "--reuid=" + std::to_string(a_->uid()),
                                "--regid=" + std::to_string(a_->gid()), "--clear-groups",
                                build_root() + "/tests/daemon/bc_worker", env.socket(), "shmjob",
                                "0", "1", "1000000", "f32:1024", "--stall"};
  Process worker(argv, env.dir() / "worker.log");
  std::vector<std::string> segs;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while ((segs = shm_entries(env.shm_prefix())).empty() &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(5ms);
  ASSERT_EQ(segs.size(), 1u) << worker.output() << env.daemon().output();
  const std::string path = "/dev/shm/" + segs[0];
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, a_->uid());
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  // The job's user can open it; another user cannot, not even to read.
  auto try_open = [&](int flags) {
    const int fd = ::open(path.c_str(), flags);
    if (fd >= 0) {
      ::close(fd);
      return 0;
    }
    return errno == EACCES ? 13 : 1;
  };
  EXPECT_EQ(run_as(*a_, [&] { return try_open(O_RDWR); }), 0);
  EXPECT_EQ(run_as(*b_, [&] { return try_open(O_RDONLY); }), 13);
  EXPECT_EQ(run_as(*b_, [&] { return try_open(O_RDWR); }), 13);
}

}  // namespace
}  // namespace bctest
