"""The emulated cluster scripts/chaos and scripts/soak run on.

Four network namespaces on one bridge (bytecomp_harness.netns): node 0 and node 1
each run a bytecompd (node ids 100, 101, peer endpoint for allgather
tensors) and the training ranks of a job; server 0 (the coordinator) and
server 1 each have a namespace of their own, so a node's link can fail
without taking a server along and a server can fail alone.

Every process is started here, with `setpriv --pdeathsig TERM` so that a
SIGKILLed script still takes them along, and its output is kept line by
line with arrival times (what the chaos checks read). `stop()` ends every
process, removes the job segments of both daemons' instances, the
namespaces and the temporary directory; it never raises.
"""

import os
import stat
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from bytecomp.run import _can_connect, find_build_root, shm_segments, wait_bounded

from bytecomp_harness import netns
from bytecomp_harness.procs import cluster_yaml, program, python_env, wait_up, write_file

SERVER_PORT = 9100
PEER_PORT = 9300
DAEMON_ID_BASE = 100
NODES = 2
SERVERS = 2
_SETPRIV = shutil.which("setpriv")


class FaultNetError(Exception):
    """The cluster could not be started (the message says which part and why)."""


class Proc:
    """A child process in a namespace whose output lines are kept with their
    arrival time (time.monotonic())."""

    def __init__(self, label, argv, env, echo=None):
        self.label = label
        if _SETPRIV:
            argv = [_SETPRIV, "--pdeathsig", "TERM", "--"] + list(argv)
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.lines = []            # [(monotonic, text)]
        self.echo = echo
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        try:
            for raw in iter(self.proc.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                with self._lock:
                    self.lines.append((time.monotonic(), line))
                    del self.lines[:-2000]
                if self.echo:
                    self.echo("[%s] %s" % (self.label, line))
        except (OSError, ValueError):
            pass

    def first(self, prefixes, since=0.0):
        """(time, line) of the first line starting with one of `prefixes`
        that arrived at or after `since`, or None."""
        if self.proc.poll() is not None:
            # Exited: its last lines may still be in the pipe.
            self._reader.join(2.0)
        with self._lock:
            for t, line in self.lines:
                if t >= since and line.startswith(prefixes):
                    return t, line
        return None

    def last(self, prefix):
        with self._lock:
            for t, line in reversed(self.lines):
                if line.startswith(prefix):
                    return t, line
        return None

    def tail(self, n=8):
        with self._lock:
            return [line for _, line in self.lines[-n:]]

    @property
    def returncode(self):
        return self.proc.poll()

    def alive(self):
        return self.proc.poll() is None

    def signal(self, sig):
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout):
        return wait_bounded(self.proc, timeout)

    def end(self, grace=3.0):
        """SIGCONT + SIGTERM, then SIGKILL after `grace` s; bounded waits."""
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGTERM):
                self.signal(sig)
            if self.wait(grace) is None:
                self.signal(signal.SIGKILL)
                self.wait(5.0)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._reader.join(2.0)

    def fd_count(self):
        try:
            return len(os.listdir("/proc/%d/fd" % self.pid))
        except OSError:
            return None

    def rss_kib(self):
        try:
            with open("/proc/%d/status" % self.pid) as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return None


class FaultNet:
    """Two nodes, two servers, each in its own namespace (module docstring)."""

    def __init__(self, heartbeat_ms=500, peer_timeout_ms=1500, request_ms=4000,
                 admission_ms=10000, strategy_text=None, build_root=None, echo=None,
                 log_level="warn", partition_bytes="64KiB"):
        self.heartbeat_ms = heartbeat_ms
        self.peer_timeout_ms = peer_timeout_ms
        self.request_ms = request_ms
        self.admission_ms = admission_ms
        self.strategy_text = strategy_text
        self.partition_bytes = partition_bytes
        self.build_root = find_build_root(build_root)
        self.echo = echo
        self.log_level = log_level
        self.net = netns.Cluster(NODES + SERVERS)
        self.tmp = None
        self.servers = [None] * SERVERS
        self.daemons = [None] * NODES
        self.instances = ["%sn%d" % (self.net.tag, n) for n in range(NODES)]
        self.restarts = 0
        self._programs = {}

    # -- where things are ----------------------------------------------------
    @staticmethod
    def server_ns(k):
        return NODES + k

    def server_address(self, k):
        return "tcp://%s:%d" % (self.net.address(self.server_ns(k)), SERVER_PORT)

    def socket(self, n):
        return os.path.join(self.tmp, "node%d" % n, "bytecompd.sock")

    def ns_name(self, index):
        return self.net.names[index]

    # -- configuration --------------------------------------------------------
    def cluster_yaml(self):
        return cluster_yaml(self.partition_bytes, [self.server_address(k) for k in range(SERVERS)],
                            [DAEMON_ID_BASE + n for n in range(NODES)],
                            admission_ms=self.admission_ms, request_ms=self.request_ms,
                            setup_ms=self.request_ms, heartbeat_ms=self.heartbeat_ms,
                            peer_timeout_ms=self.peer_timeout_ms)

    def server_yaml(self, k):
        return ("version: 1\nserver: {node_id: %d, cluster_file: %s, engine_threads: 1}\n"
                "transport: {io_threads: 1, handler_threads: 1, heartbeat_interval_ms: %d, "
                "peer_timeout_ms: %d}\nlogging: {levels: \"%s\"}\n"
                % (k, self.cluster_file, self.heartbeat_ms, self.peer_timeout_ms,
                   self.log_level))

    def daemon_yaml(self, n):
        nodes = ", ".join(str(DAEMON_ID_BASE + k) for k in range(NODES))
        strategy = ("strategy:\n  file: %s\n" % self.strategy_file) if self.strategy_file \
            else ""
        return ("version: 1\n"
                "control:\n  socket: %s\n  socket_mode: 384\n  setup_timeout_ms: 10000\n"
                "shm:\n  instance: %s\n"
                "scheduler:\n  threads: 1\n  partition_bytes: %s\n"
                "internode:\n  cluster_file: %s\n  node_id: %d\n  nodes: [%s]\n"
                "  peer_listen: \"tcp://%s:%d\"\n%s"
                "logging:\n  levels: \"%s\"\n"
                % (self.socket(n), self.instances[n], self.partition_bytes, self.cluster_file,
                   DAEMON_ID_BASE + n, nodes, self.net.address(n), PEER_PORT, strategy,
                   self.log_level))

    def env(self):
        env = python_env(dict(os.environ))
        env["BYTECOMP_LOG"] = self.log_level
        env["BYTECOMP_RUN_ID"] = self.net.tag
        env["PYTHONUNBUFFERED"] = "1"
        env["OMP_NUM_THREADS"] = "1"
        if self.build_root:
            env["BYTECOMP_BUILD_ROOT"] = self.build_root
        return env

    # -- lifecycle --------------------------------------------------------------
    def start(self):
        why = netns.check_permission()
        if why:
            raise FaultNetError("cannot build the emulated cluster: " + why)
        netns.remove_stale()
        self._programs = {
            "server": program("bytecomp-server", self.build_root, "server", FaultNetError),
            "daemon": program("bytecompd", self.build_root, "daemon", FaultNetError)}
        self.tmp = tempfile.mkdtemp(prefix="bytecomp-chaos-")
        self.net.create()
        self.cluster_file = write_file(self.tmp, "cluster.yaml", self.cluster_yaml())
        self.strategy_file = (write_file(self.tmp, "strategy.yaml", self.strategy_text)
                              if self.strategy_text else None)
        for k in range(SERVERS):
            self.start_server(k)
        for n in range(NODES):
            self.start_daemon(n)
        return self

    def start_server(self, k, timeout=20.0):
        cfg = write_file(self.tmp, "server%d/server.yaml" % k, self.server_yaml(k))
        ready = os.path.join(self.tmp, "server%d" % k, "ready")
        try:
            os.unlink(ready)
        except FileNotFoundError:
            pass
        p = Proc("server %d" % k, self.net.exec_prefix(self.server_ns(k)) +
                 [self._programs["server"], "--config", cfg, "--ready-file", ready], self.env(),
                 self.echo)
        self.servers[k] = p
        self._wait_up(p, lambda: os.path.exists(ready), "write " + ready, timeout)
        return p

    def start_daemon(self, n, timeout=20.0):
        cfg = write_file(self.tmp, "node%d/daemon.yaml" % n, self.daemon_yaml(n))
        p = Proc("daemon %d" % n, self.net.exec_prefix(n) + [self._programs["daemon"],
                                                            "--config", cfg],
                 self.env(), self.echo)
        self.daemons[n] = p
        sock = self.socket(n)
        self._wait_up(p, lambda: _can_connect(sock), "open " + sock, timeout)
        return p

    @staticmethod
    def _wait_up(p, ready, what, timeout):
        wait_up(p, ready, what, timeout, FaultNetError, output=lambda q: " | ".join(q.tail()),
                poll=0.02)

    def services(self):
        return [p for p in self.servers + self.daemons if p is not None]

    def worker(self, label, node, job, local_rank, local_size, num_nodes, extra):
        argv = ["/usr/bin/python3", "-m", "bytecomp_harness.chaos_worker",
                "--socket", self.socket(node), "--job", job, "--local-rank", str(local_rank),
                "--local-size", str(local_size), "--node-rank", str(node),
                "--num-nodes", str(num_nodes)] + list(extra)
        return Proc(label, self.net.exec_prefix(node) + argv, self.env(), self.echo)

    def segments(self):
        out = []
        for inst in self.instances:
            out += shm_segments(inst)
        return out

    def stray_sockets(self):
        """Socket files under the run's directory other than the live
        daemons' control sockets."""
        keep = {self.socket(n) for n in range(NODES)
                if self.daemons[n] is not None and self.daemons[n].alive()}
        out = []
        for root, _dirs, files in os.walk(self.tmp):
            for f in files:
                path = os.path.join(root, f)
                try:
                    if stat.S_ISSOCK(os.lstat(path).st_mode) and path not in keep:
                        out.append(path)
                except OSError:
                    pass
        return out

    def listeners(self, index):
        """Listening TCP ports in namespace `index`."""
        p = subprocess.run(["ss", "-N", self.ns_name(index), "-Hltn"], capture_output=True,
                           text=True, timeout=10)
        if p.returncode != 0:
            # Older ss without -N: run it inside the namespace.
            p = subprocess.run(self.net.exec_prefix(index) + ["ss", "-Hltn"],
                               capture_output=True, text=True, timeout=10)
        ports = set()
        for line in p.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 4:
                ports.add(int(parts[3].rsplit(":", 1)[1]))
        return ports

    def stop(self):
        for p in self.daemons + self.servers:
            if p is not None:
                try:
                    p.end(10.0)
                except Exception:  # noqa: BLE001 - the rest must still be stopped
                    pass
        for name in self.segments() if self.tmp else []:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
        self.net.remove()
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
