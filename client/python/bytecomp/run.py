"""bytecomp-run: a complete local ByteComp cluster for development and CI.

    bytecomp-run [options] [--] COMMAND [ARGS...]
    bytecomp-run --nodes 2 --nproc-per-node 2 train.py --epochs 3

Starts, in a private temporary directory:
  - for more than one node, --servers parameter servers (bytecomp-server,
    default 1) on ephemeral loopback ports, server 0 coordinating, and the
    cluster file naming them,
  - one bytecompd per emulated node, each with its own control socket and
    shared-memory namespace, running the --strategy file if given, and for
    more than one node the `internode` section (cluster file, node id
    100 + node rank, the nodes in rank order),
  - N training processes per node running COMMAND (a *.py first argument
    runs under this Python), with RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, GROUP_RANK and BYTECOMP_* set (bytecomp.env).
Every process started carries BYTECOMP_RUN_ID=<job id> in its environment.
Every output line is forwarded with a prefix ("[rank 3] ", "[daemon 1] ",
"[server 0] ").
The first process to fail decides the exit status; the others get
--grace seconds to notice (their bytecomp calls raise) and are then
terminated. Every process started is stopped and every shared-memory
segment of the cluster's daemons removed on the way out, also on Ctrl-C,
SIGTERM and on errors; every wait is bounded.

Exit status: 0 when every training process exited 0; otherwise the first
failing process's exit code (128+N for signal N); 2 for usage errors; 130
after Ctrl-C; 124 when --time-limit ran out.
"""

import argparse
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_PYTHON_ROOT = os.path.dirname(_PKG_DIR)                      # client/python
_SOURCE_ROOT = os.path.dirname(os.path.dirname(_PYTHON_ROOT))  # repository root


class LaunchError(Exception):
    """The cluster could not be started (message says which part and why)."""


def _signal_name(sig):
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "signal %d" % sig


def describe_status(code):
    if code is None:
        return "still running"
    if code < 0:
        return "killed by %s" % _signal_name(-code)
    return "exit code %d" % code


def exit_code_of(code):
    return 128 - code if code < 0 else code


def wait_bounded(proc, timeout):
    """proc.wait() for at most `timeout` seconds: its exit status, or None."""
    try:
        return proc.wait(timeout=max(0.0, timeout))
    except subprocess.TimeoutExpired:
        return None


def with_pythonpath(env, *dirs):
    """Puts `dirs` in front of env's PYTHONPATH (kept behind them); returns env."""
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join(list(dirs) + ([pp] if pp else []))
    return env


def find_build_root(explicit=None):
    for cand in (explicit, os.environ.get("BYTECOMP_BUILD_ROOT"),
                 os.path.join(_SOURCE_ROOT, "build")):
        if cand and os.path.isfile(os.path.join(cand, "daemon", "bytecompd")):
            return os.path.abspath(cand)
    return None


def find_program(name, build_root, subdir):
    if build_root:
        p = os.path.join(build_root, subdir, name)
        if os.access(p, os.X_OK):
            return p
    return shutil.which(name)


_SETPRIV = shutil.which("setpriv")  # util-linux, essential on Debian


class _Output:
    """Forwards child output line by line with a prefix. One thread per
    stream; writes are serialised by a lock so lines never interleave."""

    def __init__(self, out):
        self._out = out
        self._lock = threading.Lock()
        self._threads = []

    def follow(self, stream, prefix):
        t = threading.Thread(target=self._pump, args=(stream, prefix), daemon=True)
        t.start()
        self._threads.append(t)

    def _pump(self, stream, prefix):
        try:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                self.write(prefix + line)
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    def write(self, line):
        with self._lock:
            try:
                self._out.write(line + "\n")
                self._out.flush()
            except (OSError, ValueError):
                pass

    def drain(self, timeout):
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class _Child:
    """A started process (its own process group, so signals reach its whole
    tree) and a thread that reports its exit to the cluster's queue."""

    def __init__(self, label, argv, env, cwd, output, events, prefix):
        self.label = label
        if _SETPRIV:
            # If the launcher itself is SIGKILLed (no cleanup runs), the
            # kernel sends its children SIGTERM: daemons still remove their
            # segments and workers end. (preexec_fn is unsafe with threads.)
            argv = [_SETPRIV, "--pdeathsig", "TERM", "--"] + list(argv)
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        output.follow(self.proc.stdout, prefix)
        self._waiter = threading.Thread(target=self._wait, args=(events,), daemon=True)
        self._waiter.start()

    def _wait(self, events):
        code = self.proc.wait()
        events.put((self, code))

    @property
    def returncode(self):
        return self.proc.returncode

    def signal(self, sig):
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def wait(self, timeout):
        return wait_bounded(self.proc, timeout)


def _stop(children, sig, grace):
    """Signals every live child's process group, waits up to `grace` seconds,
    then SIGKILLs what is left (and waits, bounded, for that too)."""
    live = [c for c in children if c.returncode is None]
    for c in live:
        c.signal(sig)
    deadline = time.monotonic() + grace
    for c in live:
        c.wait(deadline - time.monotonic())
    for c in live:
        if c.returncode is None:
            c.signal(signal.SIGKILL)
            c.wait(5.0)
    # A process group may outlive its leader (e.g. DataLoader workers).
    for c in children:
        try:
            os.killpg(c.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _can_connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def shm_segments(instance):
    prefix = "bytecomp.%s." % instance
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


class _Interrupted(Exception):
    def __init__(self, sig):
        super().__init__(_signal_name(sig))
        self.sig = sig


def _cluster_supported(nodes, build_root, server=None):
    """Why a cluster of `nodes` emulated nodes cannot be started with these
    binaries, or None. More than one node needs bytecomp-server (the
    daemons' inter-node path goes through parameter servers)."""
    if nodes == 1:
        return None
    exe = server or find_program("bytecomp-server", build_root, "server")
    if not exe or not os.access(exe, os.X_OK):
        return ("--nodes %d needs bytecomp-server (the daemons' inter-node path goes through "
                "parameter servers) and it was not found%s: build the project (meson compile "
                "-C build), set BYTECOMP_BUILD_ROOT, or pass --bytecomp-server PATH" %
                (nodes, " at %s" % exe if exe else ""))
    return None


# Node ids of the emulated nodes' daemons in the cluster file.
_DAEMON_ID_BASE = 100


class Cluster:
    def __init__(self, args, command, out=sys.stdout):
        self.args = args
        self.command = command
        self.output = _Output(out)
        self.events = queue.Queue()
        self.daemons = []
        self.servers = []
        self.workers = []
        self.instances = []
        self.tmp = None
        self.stopping = False
        self.build_root = find_build_root(args.build_root)
        self.job = args.job_id or "run%d" % os.getpid()

    def log(self, msg):
        self.output.write("bytecomp-run: " + msg)

    # -- start -------------------------------------------------------------
    def _daemon_env(self):
        env = dict(os.environ)
        env.setdefault("BYTECOMP_LOG", "warn")
        env["BYTECOMP_RUN_ID"] = self.job
        return env

    def _wait_up(self, children, ready, what):
        """Waits (bounded by --daemon-timeout) until ready(child) for each."""
        deadline = time.monotonic() + self.args.daemon_timeout
        for child in children:
            while not ready(child):
                if child.returncode is not None:
                    raise LaunchError("%s exited during startup (%s); its output is above" %
                                      (child.label, describe_status(child.returncode)))
                if time.monotonic() > deadline:
                    raise LaunchError("%s did not %s within %.0f s" %
                                      (child.label, what(child), self.args.daemon_timeout))
                time.sleep(0.02)

    def _cluster_yaml(self, coordinator):
        """The cluster file: server 0 (the coordinator) at `coordinator`, the
        other servers on ephemeral ports (they report theirs to it)."""
        a = self.args
        timeout_ms = a.timeout_ms or 30000
        servers = "".join('    - {id: %d, address: "%s"}\n' %
                          (i, coordinator if i == 0 else "tcp://127.0.0.1:0")
                          for i in range(a.servers))
        daemons = "".join("    - {id: %d}\n" % (_DAEMON_ID_BASE + n) for n in range(a.nodes))
        # request_ms bounds a pull waiting for the other nodes: the same bound
        # the training processes put on their waits (BYTECOMP_TIMEOUT_MS).
        return ("version: 1\ncluster:\n  coordinator: 0\n  partition_bytes: %s\n"
                "  servers:\n%s  daemons:\n%s"
                "  timeouts: {admission_ms: %d, request_ms: %d, setup_ms: 10000}\n"
                "transport: {heartbeat_interval_ms: 200, peer_timeout_ms: 2000}\n"
                % (a.partition_bytes, servers, daemons, int(a.start_timeout * 1000),
                   timeout_ms))

    def start_servers(self):
        """Starts --servers parameter servers (only for more than one node):
        server 0 binds an ephemeral port and coordinates; the others report
        their ephemeral ports to it. Returns the daemons' cluster file."""
        server = self.args.bytecomp_server or find_program("bytecomp-server", self.build_root,
                                                           "server")
        why = _cluster_supported(self.args.nodes, self.build_root, server)
        if why:
            raise LaunchError(why)
        d = os.path.join(self.tmp, "servers")
        os.makedirs(d)
        coordinator = "tcp://127.0.0.1:0"
        for i in range(self.args.servers):
            cluster = os.path.join(d, "cluster%d.yaml" % i)
            with open(cluster, "w") as f:
                f.write(self._cluster_yaml(coordinator))
            cfg = os.path.join(d, "server%d.yaml" % i)
            with open(cfg, "w") as f:
                f.write("version: 1\nserver: {node_id: %d, cluster_file: %s, "
                        "engine_threads: %d}\n"
                        "transport: {io_threads: 1, handler_threads: 1, "
                        "heartbeat_interval_ms: 200, peer_timeout_ms: 2000}\n"
                        % (i, cluster, self.args.daemon_threads))
            ready = os.path.join(d, "ready%d" % i)
            try:
                child = _Child("server %d" % i, [server, "--config", cfg, "--ready-file", ready],
                               self._daemon_env(), None, self.output, self.events,
                               "[server %d] " % i)
            except OSError as e:
                raise LaunchError("cannot start bytecomp-server %s: %s" % (server, e.strerror))
            child.ready_file = ready
            self.servers.append(child)
            if i == 0:
                # The others and the daemons need the coordinator's real address.
                self._wait_up([child], lambda c: os.path.exists(c.ready_file),
                              lambda c: "write its address to " + c.ready_file)
                with open(ready) as f:
                    coordinator = f.read().strip()
        self._wait_up(self.servers, lambda c: os.path.exists(c.ready_file),
                      lambda c: "write its address to " + c.ready_file)
        path = os.path.join(self.tmp, "cluster.yaml")
        with open(path, "w") as f:
            f.write(self._cluster_yaml(coordinator))
        return path

    def start_daemons(self, cluster_file=None):
        bytecompd = self.args.bytecompd or find_program("bytecompd", self.build_root, "daemon")
        if not bytecompd:
            raise LaunchError("bytecompd not found: build the project (meson compile -C build), "
                              "set BYTECOMP_BUILD_ROOT, or pass --bytecompd PATH")
        if not os.access(bytecompd, os.X_OK):
            raise LaunchError("cannot start bytecompd %s: no such executable file" % bytecompd)
        nodes = self.args.nodes
        for n in range(nodes):
            d = os.path.join(self.tmp, "node%d" % n)
            os.makedirs(d)
            sock = os.path.join(d, "ctl.sock")
            instance = "run%dn%d" % (os.getpid(), n)
            cfg = os.path.join(d, "daemon.yaml")
            internode = ""
            if cluster_file:
                # peer_listen: strategies with inter: allgather run between
                # the daemons themselves (docs/daemon.md, "Peer allgather").
                internode = ("internode:\n  cluster_file: %s\n  node_id: %d\n  nodes: [%s]\n"
                             "  peer_listen: \"ipc://%s\"\n"
                             % (cluster_file, _DAEMON_ID_BASE + n,
                                ", ".join(str(_DAEMON_ID_BASE + k) for k in range(nodes)),
                                os.path.join(d, "peer.sock")))
            with open(cfg, "w") as f:
                f.write("version: 1\n"
                        "control:\n  socket: %s\n  socket_mode: 384\n"
                        "  setup_timeout_ms: %d\n"
                        "shm:\n  instance: %s\n"
                        "scheduler:\n  threads: %d\n"
                        "%s"
                        "strategy:\n  file: \"%s\"\n"
                        % (sock, int(self.args.start_timeout * 1000), instance,
                           self.args.daemon_threads, internode,
                           os.path.abspath(self.args.strategy) if self.args.strategy else ""))
            self.instances.append(instance)
            try:
                child = _Child("daemon %d" % n, [bytecompd, "--config", cfg],
                               self._daemon_env(), None, self.output, self.events,
                               "[daemon %d] " % n)
            except OSError as e:
                raise LaunchError("cannot start bytecompd %s: %s" % (bytecompd, e.strerror))
            child.socket = sock
            self.daemons.append(child)
        self._wait_up(self.daemons, lambda c: _can_connect(c.socket),
                      lambda c: "open " + c.socket)

    def _worker_argv(self):
        cmd = list(self.command)
        if cmd[0].endswith(".py"):
            cmd = [sys.executable, "-u"] + cmd
        return cmd

    def start_workers(self):
        nodes, per = self.args.nodes, self.args.nproc_per_node
        world = nodes * per
        job = self.job
        base = dict(os.environ)
        base["BYTECOMP_RUN_ID"] = job
        with_pythonpath(base, _PYTHON_ROOT)
        base["PYTHONUNBUFFERED"] = "1"
        if self.build_root:
            base["BYTECOMP_BUILD_ROOT"] = self.build_root
        if self.args.strategy:
            base["BYTECOMP_STRATEGY"] = os.path.abspath(self.args.strategy)
        if self.args.timeout_ms:
            base["BYTECOMP_TIMEOUT_MS"] = str(self.args.timeout_ms)
        base["BYTECOMP_START_TIMEOUT_MS"] = str(int(self.args.start_timeout * 1000))
        # Torch's own threads per process: the node's cores are shared by
        # every local process and the daemon.
        if "OMP_NUM_THREADS" not in base:
            base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, per)))
        argv = self._worker_argv()
        exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
        if not exe or not os.access(exe, os.X_OK):
            raise LaunchError("cannot start the training command: %r is not an executable "
                              "file or a program on PATH" % argv[0])
        for n in range(nodes):
            for lr in range(per):
                r = n * per + lr
                env = dict(base)
                env.update({
                    "RANK": str(r), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(per),
                    "GROUP_RANK": str(n), "BYTECOMP_NODE_RANK": str(n),
                    "BYTECOMP_JOB_ID": job,
                    "BYTECOMP_SOCKET": self.daemons[n].socket,
                })
                try:
                    child = _Child("rank %d" % r, argv, env, None, self.output, self.events,
                                   "[rank %d] " % r)
                except OSError as e:
                    raise LaunchError("cannot start %r: %s" % (argv[0], e.strerror))
                self.workers.append(child)

    # -- run ---------------------------------------------------------------
    def supervise(self):
        """Waits for the workers; returns the exit status."""
        deadline = (time.monotonic() + self.args.time_limit) if self.args.time_limit else None
        first = None
        grace_deadline = None
        finished = set()  # workers whose exit event was handled (one event each)
        while len(finished) < len(self.workers):
            now = time.monotonic()
            limits = [x for x in (deadline, grace_deadline) if x is not None]
            timeout = max(0.0, min(limits) - now) if limits else 1.0
            try:
                child, code = self.events.get(timeout=min(timeout, 1.0))
            except queue.Empty:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self.log("time limit of %.0f s reached: stopping the cluster" %
                             self.args.time_limit)
                    return first[1] if first else 124
                if grace_deadline is not None and now >= grace_deadline:
                    left = [w.label for w in self.workers if w.returncode is None]
                    self.log("%s still running %.0f s after %s failed: terminating them" %
                             (", ".join(left), self.args.grace, first[0]))
                    return first[1]
                continue
            if child in self.workers:
                finished.add(child)
                if code != 0 and first is None:
                    first = (child.label, exit_code_of(code))
                    self.log("%s failed first (%s)" % (child.label, describe_status(code)))
                    grace_deadline = time.monotonic() + self.args.grace
            else:
                # A daemon or server ended while training runs: the workers'
                # calls fail within their timeout; stop waiting for more.
                self.log("%s exited unexpectedly (%s)" % (child.label, describe_status(code)))
                if first is None:
                    first = (child.label, exit_code_of(code) or 1)
                    grace_deadline = time.monotonic() + self.args.grace
        return first[1] if first else 0

    def cleanup(self):
        """Stops everything, removes every segment; never raises, every wait bounded."""
        self.stopping = True
        _stop(self.workers, signal.SIGTERM, 5.0)
        # SIGTERM: the daemons abort their jobs and remove their segments.
        _stop(self.daemons, signal.SIGTERM, 10.0)
        _stop(self.servers, signal.SIGTERM, 10.0)
        self.output.drain(2.0)
        for inst in self.instances:
            for name in shm_segments(inst):
                self.log("removing leftover shared memory /dev/shm/%s" % name)
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
        if self.tmp and not self.args.keep_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def run(self):
        self.tmp = tempfile.mkdtemp(prefix="bytecomp-run-")
        try:
            cluster_file = self.start_servers() if self.args.nodes > 1 else None
            self.start_daemons(cluster_file)
            self.start_workers()
            return self.supervise()
        finally:
            self.cleanup()


def _parser():
    p = argparse.ArgumentParser(
        prog="bytecomp-run",
        description="Run a training script on a local ByteComp cluster: servers, one "
                    "bytecompd per emulated node and N training processes per node.",
        epilog="Example: bytecomp-run --nodes 1 --nproc-per-node 4 train.py --epochs 3")
    p.add_argument("--nodes", type=int, default=1, help="emulated nodes (default 1)")
    p.add_argument("--nproc-per-node", "-p", type=int, default=1,
                   help="training processes per node (default 1)")
    p.add_argument("--servers", type=int, default=1,
                   help="parameter servers when --nodes > 1 (default 1)")
    p.add_argument("--strategy", help="compression strategy file the daemons execute "
                   "(docs/strategy-format.md); also exported as BYTECOMP_STRATEGY")
    p.add_argument("--job-id", help="job name (default run<pid>)")
    p.add_argument("--timeout-ms", type=int, default=0,
                   help="BYTECOMP_TIMEOUT_MS for the workers (default: theirs, 30000)")
    p.add_argument("--start-timeout", type=float, default=60.0,
                   help="seconds for every process to join the job (default 60)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="stop everything after this many seconds (default: no limit)")
    p.add_argument("--grace", type=float, default=15.0,
                   help="seconds the others get to exit after the first failure (default 15)")
    p.add_argument("--daemon-timeout", type=float, default=15.0,
                   help="seconds a daemon may take to come up (default 15)")
    p.add_argument("--daemon-threads", type=int, default=1,
                   help="reduction threads per daemon (default 1)")
    p.add_argument("--build-root", help="meson build directory (default $BYTECOMP_BUILD_ROOT, "
                   "else build/ of this source tree, else installed programs)")
    p.add_argument("--bytecompd", help="path of bytecompd")
    p.add_argument("--bytecomp-server", help="path of bytecomp-server")
    p.add_argument("--partition-bytes", default="1MiB",
                   help="the servers' partition size (cluster.partition_bytes; default 1MiB)")
    p.add_argument("--keep-tmp", action="store_true",
                   help="keep the cluster's temporary directory (configs, sockets)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command")
    return p


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    command = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        p.error("no training command given")
    if args.nodes < 1 or args.nproc_per_node < 1 or args.servers < 1:
        p.error("--nodes, --nproc-per-node and --servers must be >= 1")
    if args.strategy and not os.path.isfile(args.strategy):
        p.error("--strategy %s: no such file" % args.strategy)

    cluster = Cluster(args, command)
    interrupted = []

    def on_signal(sig, _frame):
        if interrupted or cluster.stopping:
            return  # already stopping: let the bounded cleanup finish
        interrupted.append(sig)
        raise _Interrupted(sig)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM,
                                                    signal.SIGHUP)}
    try:
        code = cluster.run()
    except _Interrupted as e:
        cluster.log("%s: cluster stopped" % _signal_name(e.sig))
        code = 130 if e.sig == signal.SIGINT else 128 + e.sig
    except LaunchError as e:
        cluster.log("error: %s" % e)
        code = 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return code


if __name__ == "__main__":
    sys.exit(main())
