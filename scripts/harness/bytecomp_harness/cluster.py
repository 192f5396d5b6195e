"""ByteComp on an emulated multi-machine cluster, launched the way users
launch real machines (docs/cluster.md).

Every node is a network namespace (bytecomp_harness.netns) standing for one
machine. On each node, as on a real one:
  - `bytecomp-server --config server.yaml` (colocated, as BytePS deploys;
    server 0 on node 0 coordinates), or with servers="dedicated" the servers
    in server-only namespaces of their own,
  - `bytecompd --config daemon.yaml` whose `internode` section names the
    cluster file, its node id (100 + node rank) and the nodes in rank order,
  - the training processes, started by
    `torchrun --nnodes N --node_rank i --nproc_per_node P --master_addr
    <node 0> --master_port 29500 ...`, with BYTECOMP_SOCKET and
    BYTECOMP_JOB_ID in their environment (docs/torch.md, launch mode 2).
Every file lives in one temporary directory; every process is stopped and
every namespace removed on the way out (also on errors and signals).

Thread budget (the same for every process, so no system gets more CPU than
another): each training process OMP_NUM_THREADS=`threads` (default: the
machine's cores / training processes, at least 1); each daemon 1 reduction
thread besides its engine thread; each server 1 engine thread, 1 transport
I/O thread and 1 handler thread.
"""

import os
import queue
import shutil
import signal
import sys
import tempfile
import time

from bytecomp.run import (_Child, _Output, _can_connect, _stop, describe_status,
                          find_build_root, shm_segments)

from bytecomp_harness import netns
from bytecomp_harness.procs import cluster_yaml, program, python_env, wait_up, write_file

MASTER_PORT = 29500
SERVER_PORT = 9100
PEER_PORT = 9200
DAEMON_ID_BASE = 100


class ClusterError(Exception):
    """The cluster could not be started or a launch failed (message says why)."""


def default_threads(training_processes):
    return max(1, (os.cpu_count() or 1) // max(1, training_processes))


class NamespacedCluster:
    def __init__(self, nodes, nproc_per_node=1, servers="colocated", n_dedicated=1,
                 threads=None, build_root=None, out=sys.stdout, timeout_ms=180000,
                 start_timeout_s=120.0, partition_bytes="1MiB", keep_tmp=False,
                 peer_listen=True, link_window=None):
        if nodes < 1 or nproc_per_node < 1:
            raise ValueError("nodes and nproc_per_node must be >= 1 (got %d, %d)" %
                             (nodes, nproc_per_node))
        if servers not in ("colocated", "dedicated"):
            raise ValueError("servers=%r: expected 'colocated' or 'dedicated'" % (servers,))
        self.nodes = nodes
        self.per = nproc_per_node
        self.servers_mode = servers
        self.n_servers = nodes if servers == "colocated" else max(1, n_dedicated)
        self.threads = threads or default_threads(nodes * nproc_per_node)
        self.build_root = find_build_root(build_root)
        self.output = _Output(out)
        self.events = queue.Queue()
        self.timeout_ms = timeout_ms
        self.start_timeout_s = start_timeout_s
        self.partition_bytes = partition_bytes
        # The daemons' scheduler.link_window; None: the daemon's default.
        self.link_window = link_window
        self.keep_tmp = keep_tmp
        # Give each daemon a peer endpoint (internode.peer_listen on its
        # node's address): the daemons' allgather and ring need one.
        self.peer_listen = peer_listen
        extra = 0 if servers == "colocated" else self.n_servers
        self.net = netns.Cluster(nodes + extra)
        self.tmp = None
        self.servers = []
        self.daemons = []
        self.instances = []
        self.launches = 0

    def log(self, msg):
        self.output.write("bench-cluster: " + msg)

    # -- where things run ----------------------------------------------------
    def server_node(self, k):
        """Namespace index of server k."""
        return k if self.servers_mode == "colocated" else self.nodes + k

    def server_address(self, k):
        return "tcp://%s:%d" % (self.net.address(self.server_node(k)), SERVER_PORT)

    def master_addr(self):
        return self.net.address(0)

    # -- configuration files -------------------------------------------------
    def cluster_yaml(self):
        # Shaped links queue up to max_inflight_bytes per node: at 100 Mbit/s
        # that is seconds, so heartbeats and request deadlines are generous.
        return cluster_yaml(self.partition_bytes,
                            [self.server_address(k) for k in range(self.n_servers)],
                            [DAEMON_ID_BASE + n for n in range(self.nodes)],
                            admission_ms=int(self.start_timeout_s * 1000),
                            request_ms=self.timeout_ms, setup_ms=30000, heartbeat_ms=1000,
                            peer_timeout_ms=30000, local_ipc=True)

    def server_yaml(self, k, cluster_file):
        return ("version: 1\nserver: {node_id: %d, cluster_file: %s, engine_threads: 1}\n"
                "transport: {io_threads: 1, handler_threads: 1, heartbeat_interval_ms: 1000, "
                "peer_timeout_ms: 30000, local_ipc: true}\nlogging: {levels: warn}\n"
                % (k, cluster_file))

    def daemon_yaml(self, n, cluster_file, sock, instance):
        nodes = ", ".join(str(DAEMON_ID_BASE + k) for k in range(self.nodes))
        return ("version: 1\n"
                "control:\n  socket: %s\n  socket_mode: 384\n  setup_timeout_ms: %d\n"
                "shm:\n  instance: %s\n"
                "scheduler:\n  threads: 1\n  partition_bytes: %s\n%s"
                "internode:\n  cluster_file: %s\n  node_id: %d\n  nodes: [%s]\n%s"
                "logging:\n  levels: warn\n"
                % (sock, int(self.start_timeout_s * 1000), instance, self.partition_bytes,
                   "" if self.link_window is None else "  link_window: %d\n" % self.link_window,
                   cluster_file,
                   DAEMON_ID_BASE + n, nodes,
                   '  peer_listen: "tcp://%s:%d"\n' % (self.net.address(n), PEER_PORT)
                   if self.peer_listen else ""))

    def _service_env(self):
        env = dict(os.environ)
        env.setdefault("BYTECOMP_LOG", "warn")
        env["BYTECOMP_RUN_ID"] = self.net.tag
        return env

    def _start(self, label, ns_index, argv, env):
        try:
            return _Child(label, self.net.exec_prefix(ns_index) + argv, env, None, self.output,
                          self.events, "[%s] " % label)
        except OSError as e:
            raise ClusterError("cannot start %s (%s): %s" % (label, argv[0], e.strerror))

    # -- lifecycle -------------------------------------------------------------
    def start(self):
        """Creates the namespaces and starts every server and daemon."""
        why = netns.check_permission()
        if why:
            raise ClusterError("cannot build the emulated cluster: " + why)
        netns.remove_stale(self.log)
        server = program("bytecomp-server", self.build_root, "server", ClusterError)
        bytecompd = program("bytecompd", self.build_root, "daemon", ClusterError)
        self.tmp = tempfile.mkdtemp(prefix="bench-cluster-")
        self.net.create()
        cluster_file = write_file(self.tmp, "cluster.yaml", self.cluster_yaml())
        for k in range(self.n_servers):
            node = self.server_node(k)
            cfg = write_file(self.tmp, "node%d/server%d.yaml" % (node, k),
                             self.server_yaml(k, cluster_file))
            ready = os.path.join(self.tmp, "node%d" % node, "server%d.ready" % k)
            child = self._start("server %d" % k, node, [server, "--config", cfg,
                                                        "--ready-file", ready],
                                self._service_env())
            self.servers.append(child)
            wait_up(child, lambda: os.path.exists(ready), "write " + ready, 30.0, ClusterError)
        for n in range(self.nodes):
            sock = os.path.join(self.tmp, "node%d" % n, "bytecompd.sock")
            instance = "%sn%d" % (self.net.tag, n)
            cfg = write_file(self.tmp, "node%d/daemon.yaml" % n,
                              self.daemon_yaml(n, cluster_file, sock, instance))
            self.instances.append(instance)
            child = self._start("daemon %d" % n, n, [bytecompd, "--config", cfg],
                                self._service_env())
            child.socket = sock
            self.daemons.append(child)
            wait_up(child, lambda: _can_connect(sock), "open " + sock, 30.0, ClusterError)
        return self

    def shape(self, rate):
        self.net.shape(rate)

    def services_alive(self):
        dead = [c for c in self.servers + self.daemons if c.returncode is not None]
        return ", ".join("%s (%s)" % (c.label, describe_status(c.returncode)) for c in dead)

    def watch_pids(self, n):
        """Pids whose CPU node n's counters add up: its daemon and colocated server."""
        pids = [self.daemons[n].proc.pid]
        if self.servers_mode == "colocated":
            pids.append(self.servers[n].proc.pid)
        return pids

    def torchrun(self, worker_args, time_limit, env_extra=None,
                 module="bytecomp_harness.cluster_worker"):
        """Runs `torchrun --nnodes N --node_rank i ... -m module worker_args` on
        every node at once; returns (exit status, last output lines). Every
        process of the launch is stopped by the time it returns."""
        self.launches += 1
        job = "%sj%d" % (self.net.tag, self.launches)
        why = self.services_alive()
        if why:
            raise ClusterError("the cluster's services ended: %s" % why)
        py = "/usr/bin/python3"
        children = []
        events = queue.Queue()
        lines = []

        class _Tail:
            def write(self, s):
                lines.append(s)
                del lines[:-200]
                sys.stdout.write(s)
                sys.stdout.flush()

            def flush(self):
                pass
        tail = _Output(_Tail())
        try:
            for n in range(self.nodes):
                env = python_env(dict(os.environ))
                env.update({
                    "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": str(self.threads),
                    "GLOO_SOCKET_IFNAME": "eth0",
                    "BYTECOMP_SOCKET": self.daemons[n].socket,
                    "BYTECOMP_JOB_ID": job,
                    "BYTECOMP_RUN_ID": self.net.tag,
                    "BYTECOMP_TIMEOUT_MS": str(self.timeout_ms),
                    "BYTECOMP_START_TIMEOUT_MS": str(int(self.start_timeout_s * 1000)),
                    "BENCH_WATCH_PIDS": ",".join(str(p) for p in self.watch_pids(n)),
                    # cluster_worker.set_fusion: the daemon's drop-ins.
                    "BENCH_DAEMON_DROPIN": os.path.join(self.tmp, "node%d" % n,
                                                        "daemon.yaml.d"),
                })
                if self.servers_mode == "dedicated" and n == 0:
                    env["BENCH_SERVER_PIDS"] = ",".join(str(c.proc.pid) for c in self.servers)
                if self.build_root:
                    env["BYTECOMP_BUILD_ROOT"] = self.build_root
                env.update(env_extra or {})
                logdir = os.path.join(self.tmp, "node%d" % n, "torchrun%d" % self.launches)
                # --redirects 1 --tee 1: Debian's torch 1.13 torchrun fails on
                # Python 3.11 with its default "0" (docs/torch.md).
                argv = [py, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
                        "--node_rank", str(n), "--nproc_per_node", str(self.per),
                        "--master_addr", self.master_addr(), "--master_port",
                        str(MASTER_PORT), "--redirects", "1", "--tee", "1",
                        "--log_dir", logdir, "--max_restarts", "0",
                        "-m", module] + list(worker_args)
                children.append(_Child("node %d" % n, self.net.exec_prefix(n) + argv, env,
                                       None, tail, events, "[node %d] " % n))
            deadline = time.monotonic() + time_limit
            first = None
            done = 0
            while done < len(children):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.log("launch %s: time limit of %.0f s reached: stopping it" %
                             (job, time_limit))
                    return 124, lines
                try:
                    child, code = events.get(timeout=min(left, 1.0))
                except queue.Empty:
                    why = self.services_alive()
                    if why:
                        self.log("launch %s: the cluster's services ended: %s" % (job, why))
                        return 1, lines
                    continue
                done += 1
                if code != 0 and first is None:
                    first = code
                    self.log("launch %s: %s failed first (%s)" % (job, child.label,
                                                                  describe_status(code)))
                    # The others notice within their timeouts; do not wait longer.
                    deadline = min(deadline, time.monotonic() + 30.0)
            return (first if first is not None else 0), lines
        finally:
            _stop(children, signal.SIGTERM, 10.0)
            tail.drain(2.0)

    def stop(self):
        """Stops every process, removes segments, namespaces and files; never raises."""
        try:
            _stop(self.daemons, signal.SIGTERM, 10.0)
            _stop(self.servers, signal.SIGTERM, 10.0)
        finally:
            self.output.drain(2.0)
            for inst in self.instances:
                for name in shm_segments(inst):
                    try:
                        os.unlink(os.path.join("/dev/shm", name))
                    except OSError:
                        pass
            self.net.remove()
            if self.tmp and not self.keep_tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
        return False

