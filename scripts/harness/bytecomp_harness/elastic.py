"""Elastic restarts on the emulated cluster (docs/reliability.md, "Elastic
restarts").

The four namespaces of bytecomp_harness.faultnet (node 0 and node 1 with a
bytecompd each, server 0 the coordinator, server 1), plus:

  - a Supervisor that restarts a server or a daemon that died, after
    `restart_sec` (what systemd's Restart=always / RestartSec= does for
    bytecomp-server.service and bytecompd.service, docs/operations.md);
  - an ElasticLaunch: on each node `torchrun --nnodes 2 --nproc_per_node P
    --max_restarts K --rdzv_backend c10d --rdzv_endpoint <node 0>:29400
    --rdzv_id JOB` running bytecomp.examples.elastic_digits, whose output
    lines (the workers' through `--tee`) are kept with their arrival time.

Node 0's agent hosts the rendezvous store (`--rdzv_conf is_host=1`: every
namespace has the machine's hostname, so torchrun cannot tell by name).
torchrun numbers the nodes of a c10d rendezvous by (hostname, agent pid):
here node 0's agent is started first, so it is group rank 0, as its daemon
(node id 100) is nodes[0]. Were it not, every worker would fail with its
daemon's refusal ("node rank 1 is daemon 101 in internode.nodes, but this
is 100"), which `wait_for` shows in the lines it reports.
"""

import os
import re
import signal
import threading
import time

from bytecomp_harness.faultnet import NODES, Proc

RDZV_PORT = 29400


class ElasticError(Exception):
    """A launch did not do what was awaited in time (the message says what)."""


class Supervisor:
    """Restarts dead services of a FaultNet after `restart_sec` (systemd's
    Restart=always). `pause()`/`resume()` hold it (e.g. while stopping)."""

    def __init__(self, net, restart_sec=0.5, log=None):
        self.net = net
        self.restart_sec = restart_sec
        self.log = log or (lambda msg: None)
        self.restarts = []        # [(monotonic, label)]
        self.failures = []        # restart attempts that failed: [str]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(30.0)

    def _run(self):
        dead_since = {}
        while not self._stop.wait(0.05):
            for kind, procs in (("server", self.net.servers), ("daemon", self.net.daemons)):
                for k, p in enumerate(procs):
                    key = (kind, k)
                    if p is None or p.alive():
                        dead_since.pop(key, None)
                        continue
                    since = dead_since.setdefault(key, time.monotonic())
                    if time.monotonic() - since < self.restart_sec or self._stop.is_set():
                        continue
                    try:
                        if kind == "server":
                            self.net.start_server(k)
                        else:
                            self.net.start_daemon(k)
                        self.restarts.append((time.monotonic(), "%s %d" % (kind, k)))
                        self.log("supervisor: restarted %s %d" % (kind, k))
                    except Exception as e:  # noqa: BLE001 - recorded, retried
                        self.failures.append("%s %d: %s" % (kind, k, e))
                        self.log("supervisor: restarting %s %d failed: %s" % (kind, k, e))
                    dead_since.pop(key, None)


class ElasticLaunch:
    """torchrun on both nodes of `net` for one elastic training run."""

    def __init__(self, net, job, script_args, nproc=2, max_restarts=6, timeout_ms=6000,
                 start_timeout_ms=40000, echo=None):
        self.net = net
        self.job = job
        self.nproc = nproc
        self.agents = []
        self.echo = echo
        env = net.env()
        # The job name is torchrun's run id (--rdzv_id): the same in every
        # generation of workers.
        for var in ("BYTECOMP_JOB_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK"):
            env.pop(var, None)
        env.update({"BYTECOMP_TIMEOUT_MS": str(timeout_ms),
                    "BYTECOMP_START_TIMEOUT_MS": str(start_timeout_ms)})
        self.env = env
        self.script_args = list(script_args)
        self.max_restarts = max_restarts

    def start(self):
        endpoint = "%s:%d" % (self.net.net.address(0), RDZV_PORT)
        for n in range(NODES):
            env = dict(self.env)
            env["BYTECOMP_SOCKET"] = self.net.socket(n)
            logdir = os.path.join(self.net.tmp, "node%d" % n, "torchrun-" + self.job)
            # --redirects 1 --tee 1: Debian's torch 1.13 torchrun fails on
            # Python 3.11 with its default "0" (docs/torch.md).
            argv = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nnodes", str(NODES),
                    "--nproc_per_node", str(self.nproc), "--max_restarts",
                    str(self.max_restarts), "--monitor_interval", "0.5",
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
                    "--rdzv_id", self.job, "--rdzv_conf",
                    "is_host=%d,join_timeout=120" % (1 if n == 0 else 0),
                    "--redirects", "1", "--tee", "1", "--log_dir", logdir,
                    "-m", "bytecomp.examples.elastic_digits"] + self.script_args
            self.agents.append(Proc("torchrun %d" % n, self.net.net.exec_prefix(n) + argv, env,
                                    self.echo))
            if n == 0:
                # Node 0's agent first: the lower pid, so group rank 0.
                time.sleep(0.2)
        return self

    def worker_pid(self, rank):
        """Pid of the live worker of global rank `rank`, or None."""
        marks = {b"RANK=%d" % rank, b"TORCHELASTIC_RUN_ID=" + self.job.encode(),
                 b"BYTECOMP_RUN_ID=" + self.net.net.tag.encode()}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open("/proc/%s/environ" % pid, "rb") as f:
                    env = set(f.read().split(b"\0"))
            except OSError:
                continue
            if marks <= env:
                return int(pid)
        return None

    def lines(self, since=0.0):
        out = []
        for a in self.agents:
            out += [(t, a.label, line) for t, line in list(a.lines) if t >= since]
        return sorted(out)

    def find(self, regex, since=0.0):
        """(time, match) of the first line matching `regex` at or after `since`."""
        r = re.compile(regex)
        for t, _label, line in self.lines(since):
            m = r.search(line)
            if m:
                return t, m
        return None

    def wait_for(self, regex, since, timeout, what):
        """Waits (bounded) for a line matching `regex`; raises ElasticError
        naming `what` when none comes, or at once when an agent exits."""
        deadline = time.monotonic() + timeout
        while True:
            hit = self.find(regex, since)
            if hit:
                return hit
            ended = [a for a in self.agents if not a.alive()]
            if ended or time.monotonic() > deadline:
                why = ("%s exited (%s)" % (ended[0].label, ended[0].returncode) if ended
                       else "not within %.0f s" % timeout)
                tail = "\n".join("[%s] %s" % (lb, ln) for _t, lb, ln in self.lines()[-40:])
                raise ElasticError("%s: %s; last lines:\n%s" % (what, why, tail))
            time.sleep(0.05)

    def wait(self, timeout):
        """Exit statuses of both agents (None: still running after `timeout`)."""
        deadline = time.monotonic() + timeout
        return [a.wait(max(0.0, deadline - time.monotonic())) for a in self.agents]

    def stop(self):
        for a in self.agents:
            a.end(10.0)


def kill(pid, sig=signal.SIGKILL):
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
