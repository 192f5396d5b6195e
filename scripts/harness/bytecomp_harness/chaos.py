"""Chaos on the emulated cluster (issue 18): faults injected at random, at a
fixed seed, into a running two-node job, each followed by checks.

Cluster (bytecomp_harness.faultnet): node 0 and node 1 (a bytecompd and two
training ranks each: bytecomp_harness.chaos_worker, no PyTorch), server 0 (the
coordinator) and server 1 in namespaces of their own. The job has three
tensors: 'a' uncompressed through the servers, 'b' fp16-compressed through
the servers, 'c' fp16 by peer allgather between the daemons; every rank checks every
result exactly after every iteration.

Per fault:
  1. start a job and wait until it trains (every rank past iteration 5);
  2. inject the fault (module FAULTS);
  3. fatal faults: every rank the fault did not hit must end with an error
     within the fault's bound, and its message must name the cause (the
     lost node, the rank, the server, ...); the fault's own process ends
     too once resumed or is restarted. Benign faults (netem delay, a little
     loss, reordering): the job must go on training with exact results for
     the fault's duration and finish;
  4. repair (SIGCONT, restart the killed service, link up, qdisc removed);
  5. checks: no process of the job left (hang), no /dev/shm segment of
     either daemon's instance, no stray socket file, every namespace
     listens on exactly its ports, every service alive;
  6. a new job trains correctly (20 iterations, exact).

Detection time = from the injection to the last affected rank's error line.
Ends with a table (fault, detected in: median/max, message, leaked
resources) and one JSON line; exit 1 when any check failed, 77 when
namespaces cannot be created here (nothing was run).
"""

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

from bytecomp_harness import netns
from bytecomp_harness.faultnet import NODES, PEER_PORT, SERVER_PORT, SERVERS, FaultNet, \
    FaultNetError
from bytecomp_harness.procs import print_json, run_guarded

LOCAL = 2                          # ranks per node
RANKS = NODES * LOCAL
STRATEGY = """version: 1
meta: {note: "scripts/chaos: a uncompressed via PS, b fp16 via PS, c fp16 peer allgather"}
default: {compressor: none}
entries:
  - tensor: "b"
    option: {compressor: fp16, inter: alltoall_allgather}
  - tensor: "c"
    option: {compressor: fp16, inter: allgather}
"""


def _has_netem():
    """Whether this kernel has sch_netem (some VM kernels do not): without
    it the delay and reorder faults are left out of the catalogue."""
    probe = "%s%dnetem" % (netns.PREFIX, os.getpid())
    if netns._run([netns._ip(), "netns", "add", probe], check=False).returncode != 0:
        return False
    try:
        return _tc(["-n", probe, "qdisc", "add", "dev", "lo", "root", "netem",
                    "delay", "1ms"]).returncode == 0
    finally:
        netns._run([netns._ip(), "netns", "del", probe], check=False)


def _tc(args):
    return netns._run([netns._tc()] + args, check=False)


def _ip(args):
    return netns._run([netns._ip()] + args, check=False)


class Job:
    """One job's four ranks (rank r = node r // 2, local rank r % 2)."""

    def __init__(self, net, name, iterations, timeout_ms, elements=256):
        self.name = name
        extra = ["--iterations", str(iterations), "--timeout-ms", str(timeout_ms),
                 "--elements", str(elements), "--report-every", "1"]
        self.ranks = [net.worker("%s r%d" % (name, r), r // LOCAL, name, r % LOCAL, LOCAL,
                                 NODES, extra) for r in range(RANKS)]

    def progress(self):
        out = []
        for p in self.ranks:
            last = p.last("ITER ")
            out.append(int(last[1].split()[1]) if last else -1)
        return out

    def wait_training(self, past, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(i >= past for i in self.progress()):
                return None
            dead = [p for p in self.ranks if not p.alive()]
            if dead:
                return "%s ended before training (%s): %s" % (
                    dead[0].label, dead[0].returncode, " | ".join(dead[0].tail(3)))
            time.sleep(0.02)
        return "the job did not reach iteration %d within %.0f s (progress %s)" % (
            past, timeout, self.progress())

    def end(self):
        for p in self.ranks:
            p.end(2.0)


def cause(line):
    """The part of a rank's error line that says why: what follows the
    daemon's "was aborted by bytecompd: " or the call's "failed: "."""
    for mark in ("was aborted by bytecompd as it started: ", "was aborted by bytecompd: ",
                 "failed: "):
        if mark in line:
            return line.split(mark, 1)[1]
    return line


def outcome(p, since):
    """The error line a rank ended with after `since`, or None."""
    return p.first(("RAISED", "TIMEOUT", "WRONG"), since)


class Fault:
    """kind, target; `hit` = ranks the fault itself stops or kills (not
    expected to report), `names` = substrings of which a surviving rank's
    message must contain one, `bound_s` = detection bound."""

    def __init__(self, kind, target, fatal, bound_s, names, hit=(), service=None, ns=None):
        self.kind = kind
        self.target = target
        self.fatal = fatal
        self.bound_s = bound_s
        self.names = names
        self.hit = list(hit)
        self.service = service      # ("daemon"|"server", index)
        self.ns = ns                # namespace index for link faults

    @property
    def label(self):
        return "%s %s" % (self.kind, self.target)


class Chaos:
    def __init__(self, args, out=sys.stdout):
        self.a = args
        self.out = out
        self.rng = random.Random(args.seed)
        self.net = FaultNet(heartbeat_ms=args.heartbeat_ms, peer_timeout_ms=args.peer_timeout_ms,
                            request_ms=args.request_ms, strategy_text=STRATEGY,
                            echo=self._echo if args.verbose else None,
                            log_level=args.log_level)
        self.rows = []
        self.jobs = 0
        hb = args.peer_timeout_ms / 1000.0
        # Heartbeat-detected faults: peer_timeout, plus the coordinator's
        # abort reaching the other node, plus scheduling slack.
        self.hb_bound = hb + args.slack_s
        # A stopped rank or daemon is silent without losing a connection:
        # the request deadline (request_ms) or the ranks' own wait timeout
        # catches it.
        self.stall_bound = max(args.request_ms, args.timeout_ms) / 1000.0 + args.slack_s
        self.now_bound = args.slack_s
        self.netem = _has_netem()
        self.iptables = shutil.which("iptables-legacy") or (
            "/usr/sbin/iptables-legacy" if os.path.exists("/usr/sbin/iptables-legacy") else None)

    def _echo(self, line):
        self.log(line)

    def log(self, msg):
        self.out.write("chaos: %s\n" % msg)
        self.out.flush()

    # -- the fault catalogue ------------------------------------------------
    def pick(self):
        r = self.rng.randrange(RANKS)
        n = self.rng.randrange(NODES)
        k = self.rng.randrange(SERVERS)
        node_id = "node %d" % (100 + n)
        kinds = {
            "kill-rank": lambda: Fault(
                "kill-rank", "rank %d" % r, True, self.now_bound,
                ["local rank %d" % (r % LOCAL), "node %d" % (100 + r // LOCAL)], hit=[r]),
            "stop-rank": lambda: Fault(
                "stop-rank", "rank %d" % r, True, self.stall_bound,
                ["node %d" % (100 + r // LOCAL), "local rank %d" % (r % LOCAL), "within"],
                hit=[r]),
            "kill-daemon": lambda: Fault(
                "kill-daemon", "daemon %d" % n, True, self.hb_bound,
                [node_id, "bytecompd", "daemon"], service=("daemon", n)),
            "stop-daemon": lambda: Fault(
                "stop-daemon", "daemon %d" % n, True, self.stall_bound,
                [node_id, "within", "bytecompd"], service=("daemon", n)),
            "kill-server": lambda: Fault(
                "kill-server", "server 1", True, self.hb_bound,
                ["node 1", "server 1"], service=("server", 1)),
            "kill-coordinator": lambda: Fault(
                "kill-coordinator", "server 0", True, self.hb_bound,
                ["node 0", "server 0", "coordinator 0"], service=("server", 0)),
            "stop-server": lambda: Fault(
                "stop-server", "server %d" % k, True, self.stall_bound,
                ["node %d" % k, "server %d" % k, "coordinator %d" % k, "within"],
                service=("server", k)),
            "link-down": lambda: Fault(
                "link-down", "node %d" % n, True, self.hb_bound,
                [node_id, "node 0", "node 1", "coordinator", "within"], ns=n),
            "partition": lambda: Fault(
                "partition", "node %d" % n, True, self.hb_bound,
                [node_id, "node 0", "node 1", "coordinator", "within"], ns=n),
            "server-link-down": lambda: Fault(
                "server-link-down", "server %d" % k, True, self.hb_bound,
                ["node %d" % k, "server %d" % k, "coordinator", "within"],
                ns=FaultNet.server_ns(k)),
            "packet-loss": lambda: Fault(
                "packet-loss", "node %d" % n, False, 0, [], ns=n),
            "slow-link": lambda: Fault(
                "slow-link", "node %d" % n, False, 0, [], ns=n),
        }
        if not self.iptables:
            del kinds["partition"], kinds["packet-loss"]
        if self.netem:
            kinds["netem-delay"] = lambda: Fault("netem-delay", "node %d" % n, False, 0, [],
                                                 ns=n)
            kinds["netem-reorder"] = lambda: Fault("netem-reorder", "node %d" % n, False, 0,
                                                   [], ns=n)
        names = sorted(kinds)
        return kinds[names[self.rng.randrange(len(names))]]()

    def plan(self, count):
        if self.a.sequence:
            out = []
            for kind in self.a.sequence.split(","):
                for _ in range(1000):
                    f = self.pick()
                    if f.kind == kind:
                        out.append(f)
                        break
                else:
                    raise FaultNetError("--sequence: unknown or unavailable fault kind %r" % kind)
            return out
        if self.a.kinds:
            wanted = self.a.kinds.split(",")
            out = []
            while len(out) < count:
                f = self.pick()
                if f.kind in wanted:
                    out.append(f)
            return out
        return [self.pick() for _ in range(count)]

    # -- injection and repair ----------------------------------------------------
    def _netem(self, ns, spec):
        where = [(self.net.ns_name(ns), "eth0"), (self.net.net.switch, "p%d" % ns)]
        for name, dev in where:
            _tc(["-n", name, "qdisc", "del", "dev", dev, "root"])
            if spec:
                p = _tc(["-n", name, "qdisc", "add", "dev", dev, "root", "netem"] + spec)
                if p.returncode != 0:
                    raise FaultNetError("tc netem %s on %s/%s failed: %s" % (
                        " ".join(spec), name, dev, p.stderr.strip()))

    def _drop(self, ns, match):
        """iptables (legacy: this kernel has x_tables, not nf_tables) on the
        node's eth0, both ways: `match` [] drops everything (a partition with
        the link up), a statistic match drops at random; None removes it."""
        ipt = self.iptables
        if not ipt:
            return
        pre = self.net.net.exec_prefix(ns)
        if match is None:
            for chain in ("INPUT", "OUTPUT"):
                netns._run(pre + [ipt, "-F", chain], check=False)
            return
        for chain, dev in (("INPUT", "-i"), ("OUTPUT", "-o")):
            p = netns._run(pre + [ipt, "-I", chain, "1", dev, "eth0"] + match + ["-j", "DROP"],
                           check=False)
            if p.returncode != 0:
                raise FaultNetError("%s -I %s in %s failed: %s" % (
                    ipt, chain, self.net.ns_name(ns), p.stderr.strip()))

    def _tbf(self, ns, rate):
        where = [(self.net.ns_name(ns), "eth0"), (self.net.net.switch, "p%d" % ns)]
        for name, dev in where:
            _tc(["-n", name, "qdisc", "del", "dev", dev, "root"])
            if rate:
                p = _tc(["-n", name, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                         "burst", "16kb", "latency", "200ms"])
                if p.returncode != 0:
                    raise FaultNetError("tc tbf on %s/%s failed: %s" % (name, dev,
                                                                        p.stderr.strip()))

    def inject(self, f, job):
        net = self.net
        if f.kind in ("kill-rank", "stop-rank"):
            job.ranks[f.hit[0]].signal(signal.SIGKILL if f.kind == "kill-rank"
                                       else signal.SIGSTOP)
        elif f.service:
            what, i = f.service
            p = net.daemons[i] if what == "daemon" else net.servers[i]
            p.signal(signal.SIGKILL if f.kind.startswith("kill") else signal.SIGSTOP)
        elif f.kind in ("link-down", "server-link-down"):
            p = _ip(["-n", net.ns_name(f.ns), "link", "set", "eth0", "down"])
            if p.returncode != 0:
                raise FaultNetError("ip link set down: " + p.stderr.strip())
        elif f.kind == "partition":
            self._drop(f.ns, [])
        elif f.kind == "packet-loss":
            self._drop(f.ns, ["-m", "statistic", "--mode", "random", "--probability", "0.03"])
        elif f.kind == "slow-link":
            self._tbf(f.ns, "2mbit")
        elif f.kind == "netem-delay":
            self._netem(f.ns, ["delay", "30ms", "10ms"])
        elif f.kind == "netem-reorder":
            self._netem(f.ns, ["delay", "10ms", "reorder", "25%", "50%"])

    def repair(self, f, job):
        """Undoes the fault; returns a problem string or None."""
        net = self.net
        try:
            if f.kind == "stop-rank":
                job.ranks[f.hit[0]].signal(signal.SIGCONT)
            elif f.service:
                what, i = f.service
                p = net.daemons[i] if what == "daemon" else net.servers[i]
                if f.kind.startswith("stop"):
                    p.signal(signal.SIGCONT)
                else:
                    p.wait(5.0)
                    p.end(1.0)
                    net.restarts += 1
                    (net.start_daemon if what == "daemon" else net.start_server)(i)
            elif f.kind in ("link-down", "server-link-down"):
                _ip(["-n", net.ns_name(f.ns), "link", "set", "eth0", "up"])
            elif f.kind in ("partition", "packet-loss"):
                self._drop(f.ns, None)
            elif f.kind == "slow-link":
                self._tbf(f.ns, None)
            elif f.ns is not None:
                self._netem(f.ns, None)
        except FaultNetError as e:
            return "repair failed: %s" % e
        return None

    # -- checks ---------------------------------------------------------------------
    def leaks(self, job):
        """Resources left once the job's ranks are gone and the fault repaired."""
        net = self.net
        found = []
        deadline = time.monotonic() + 3.0
        while any(p.alive() for p in job.ranks) and time.monotonic() < deadline:
            time.sleep(0.02)
        hung = [p for p in job.ranks if p.alive()]
        if hung:
            found.append("hung: " + ", ".join(p.label for p in hung))
        job.end()
        deadline = time.monotonic() + 3.0
        while net.segments() and time.monotonic() < deadline:
            time.sleep(0.05)
        segs = net.segments()
        if segs:
            found.append("shm: " + " ".join(segs))
        socks = net.stray_sockets()
        if socks:
            found.append("sockets: " + " ".join(os.path.basename(s) for s in socks))
        for k in range(SERVERS):
            ports = net.listeners(FaultNet.server_ns(k))
            if ports != {SERVER_PORT}:
                found.append("server %d listens on %s" % (k, sorted(ports)))
        for n in range(NODES):
            ports = net.listeners(n)
            if ports != {PEER_PORT}:
                found.append("node %d listens on %s" % (n, sorted(ports)))
        dead = [p for p in net.services() if not p.alive()]
        if dead:
            found.append("service ended: " + ", ".join(
                "%s (%s)" % (p.label, p.returncode) for p in dead))
        return found

    def new_job(self, iterations, timeout_ms=None):
        self.jobs += 1
        return Job(self.net, "%sj%d" % (self.net.net.tag, self.jobs), iterations,
                   timeout_ms or self.a.timeout_ms)

    def recover(self, row):
        """Fresh jobs until one trains 20 iterations exactly, for at most
        --recovery-s: a peer declared lost is "alive again" only once its
        heartbeats are back (docs/transport.md), so a job started at once
        after a network fault may be refused. Records when one trained and
        what the first one after the repair got."""
        t0 = time.monotonic()
        first = None
        while True:
            why = self.verify()
            if first is None:
                first = why or "trained"
                row["first_job"] = first
            if not why:
                row["recovered_s"] = round(time.monotonic() - t0, 2)
                return None
            if time.monotonic() - t0 > self.a.recovery_s:
                return "no job trained within %.0f s of the repair; last: %s" % (
                    self.a.recovery_s, why)
            time.sleep(0.5)

    def verify(self):
        """A fresh job trains 20 iterations exactly; None or the problem."""
        job = self.new_job(20)
        try:
            deadline = time.monotonic() + self.a.job_start_s + 10
            while time.monotonic() < deadline and any(p.alive() for p in job.ranks):
                time.sleep(0.02)
            bad = [p for p in job.ranks if p.returncode != 0 or not p.first(("DONE",))]
            if bad:
                p = bad[0]
                return "new job failed: %s (%s): %s" % (p.label, p.returncode,
                                                        " | ".join(p.tail(2)))
            return None
        finally:
            job.end()

    def run_fault(self, idx, f):
        row = {"n": idx, "fault": f.kind, "target": f.target, "fatal": f.fatal,
               "bound_s": round(f.bound_s, 2), "detected_s": None, "message": "",
               "leaks": [], "problems": [], "recovered_s": None, "first_job": ""}
        job = self.new_job(1 << 30 if f.fatal else 10 ** 6)
        try:
            why = job.wait_training(5, self.a.job_start_s)
            if why:
                row["problems"].append("before the fault: " + why)
                return row
            t0 = time.monotonic()
            self.inject(f, job)
            survivors = [p for r, p in enumerate(job.ranks) if r not in f.hit]
            if f.fatal:
                self._watch_fatal(f, job, survivors, t0, row)
            else:
                self._watch_benign(f, job, t0, row)
        except FaultNetError as e:
            row["problems"].append(str(e))
        finally:
            why = self.repair(f, job)
            if why:
                row["problems"].append(why)
            if f.kind == "stop-rank":
                # Resumed, the stopped rank must end as well (its job is gone).
                stopped = job.ranks[f.hit[0]]
                if stopped.wait(self.stall_bound) is None:
                    row["problems"].append("the stopped rank did not end within %.1f s of "
                                           "SIGCONT" % self.stall_bound)
            elif f.kind == "stop-daemon":
                # Its local ranks may only notice once it runs again.
                for p in job.ranks:
                    p.wait(self.stall_bound)
            row["leaks"] = self.leaks(job)
            why = self.recover(row)
            if why:
                row["problems"].append(why)
                self._heal()
        return row

    def _watch_fatal(self, f, job, survivors, t0, row):
        deadline = t0 + f.bound_s
        grace = t0 + f.bound_s + max(5.0, f.bound_s)   # to tell "late" from "never"
        while time.monotonic() < grace:
            if all(outcome(p, t0) or not p.alive() for p in survivors):
                break
            time.sleep(0.02)
        times, msgs = [], []
        for p in survivors:
            o = outcome(p, t0)
            if not o:
                row["problems"].append("%s: no error reported (%s)" % (
                    p.label, "still running" if p.alive() else "exit %s" % p.returncode))
                continue
            times.append(o[0] - t0)
            msgs.append((p, o[1]))
            if o[1].startswith("WRONG"):
                row["problems"].append("%s: %s" % (p.label, o[1]))
        if times:
            row["detected_s"] = round(max(times), 3)
            if max(times) > f.bound_s + 1e-9 and time.monotonic() >= deadline:
                row["problems"].append("detected in %.2f s, bound %.2f s" % (max(times),
                                                                             f.bound_s))
        unnamed = [(p, m) for p, m in msgs if not any(t in m for t in f.names)]
        for p, m in unnamed:
            row["problems"].append("%s: message names no cause (%s): %s" % (
                p.label, " / ".join(f.names), m))
        if msgs:
            row["message"] = msgs[0][1]

    def _watch_benign(self, f, job, t0, row):
        start = job.progress()
        time.sleep(self.a.benign_s)
        moved = [b - a for a, b in zip(start, job.progress())]
        bad = [(p, outcome(p, t0)) for p in job.ranks if outcome(p, t0) or not p.alive()]
        for p, o in bad:
            row["problems"].append("%s: %s" % (p.label, o[1] if o else "ended (%s)" %
                                               p.returncode))
        if min(moved) < 3:
            row["problems"].append("training stalled under %s (iterations per rank in "
                                   "%.1f s: %s)" % (f.kind, self.a.benign_s, moved))
        row["detected_s"] = None
        row["message"] = "trained %d iterations under the fault, no error" % min(moved)
        for p in job.ranks:
            p.signal(signal.SIGTERM)

    def _heal(self):
        """After a failed check: fresh services so one failure does not
        cascade into every later fault."""
        net = self.net
        for i in range(NODES + SERVERS):
            _ip(["-n", net.ns_name(i), "link", "set", "eth0", "up"])
            self._drop(i, None)
            self._tbf(i, None)
        for p in net.services():
            p.end(3.0)
        for k in range(SERVERS):
            net.start_server(k)
        for n in range(NODES):
            net.start_daemon(n)
        self.log("services restarted after a failed check")

    # -- report -------------------------------------------------------------------
    def table(self):
        lines = ["", "| # | fault | target | detected in (s) | bound (s) | message | leaked "
                 "| new job trained after (s) | first job after the repair | result |",
                 "| ---: | --- | --- | ---: | ---: | --- | --- | ---: | --- | --- |"]
        for r in self.rows:
            msg = cause(r["message"]).replace("|", "/")
            if len(msg) > 140:
                msg = msg[:137] + "..."
            first = cause(r["first_job"]).replace("|", "/")
            if len(first) > 110:
                first = first[:107] + "..."
            lines.append("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                r["n"], r["fault"], r["target"],
                "-" if r["detected_s"] is None else "%.2f" % r["detected_s"],
                "%.1f" % r["bound_s"] if r["fatal"] else "-", msg,
                "; ".join(r["leaks"]) or "none",
                "-" if r["recovered_s"] is None else "%.2f" % r["recovered_s"], first,
                "ok" if not (r["problems"] or r["leaks"]) else "FAIL: " +
                "; ".join(r["problems"])[:300]))
        lines += ["", "| fault kind | n | detected median (s) | max (s) | bound (s) | "
                  "leaked | first job after the repair failed | recovered max (s) | failed |",
                  "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        for kind in sorted({r["fault"] for r in self.rows}):
            rs = [r for r in self.rows if r["fault"] == kind]
            ts = [r["detected_s"] for r in rs if r["detected_s"] is not None]
            rec = [r["recovered_s"] for r in rs if r["recovered_s"] is not None]
            lines.append("| %s | %d | %s | %s | %s | %s | %d | %s | %d |" % (
                kind, len(rs), "%.2f" % statistics.median(ts) if ts else "-",
                "%.2f" % max(ts) if ts else "-",
                "%.1f" % rs[0]["bound_s"] if rs[0]["fatal"] else "-",
                "none" if not any(r["leaks"] for r in rs) else
                "%d faults" % sum(1 for r in rs if r["leaks"]),
                sum(1 for r in rs if r["first_job"] != "trained"),
                "%.2f" % max(rec) if rec else "-",
                sum(1 for r in rs if r["problems"] or r["leaks"])))
        return "\n".join(lines)

    def summary(self, elapsed):
        failed = [r for r in self.rows if r["problems"] or r["leaks"]]
        kinds = {}
        for r in self.rows:
            k = kinds.setdefault(r["fault"], {"n": 0, "failed": 0, "detected_s": [],
                                              "first_job_failed": 0, "recovered_max_s": None})
            k["n"] += 1
            k["first_job_failed"] += r["first_job"] != "trained"
            if r["recovered_s"] is not None:
                k["recovered_max_s"] = max(k["recovered_max_s"] or 0, r["recovered_s"])
            k["failed"] += bool(r["problems"] or r["leaks"])
            if r["detected_s"] is not None:
                k["detected_s"].append(r["detected_s"])
        for k in kinds.values():
            ts = k.pop("detected_s")
            k["median_s"] = round(statistics.median(ts), 3) if ts else None
            k["max_s"] = round(max(ts), 3) if ts else None
        return {"chaos": {"faults": len(self.rows), "failed": len(failed), "seed": self.a.seed,
                          "peer_timeout_ms": self.a.peer_timeout_ms,
                          "heartbeat_ms": self.a.heartbeat_ms, "request_ms": self.a.request_ms,
                          "restarts": self.net.restarts, "jobs": self.jobs,
                          "elapsed_s": round(elapsed, 1), "kinds": kinds,
                          "failures": [{"n": r["n"], "fault": r["fault"], "target": r["target"],
                                        "problems": r["problems"], "leaks": r["leaks"]}
                                       for r in failed]}}

    def run(self):
        t_start = time.monotonic()
        faults = self.plan(self.a.faults)
        self.net.start()
        self.log("cluster up (%s); %d faults, seed %d" % (self.net.tmp, len(faults),
                                                        self.a.seed))
        if not self.netem:
            self.log("this kernel has no sch_netem: the netem-delay and netem-reorder faults "
                     "are left out")
        if not self.iptables:
            self.log("iptables-legacy not found (scripts/install-deps): the partition and "
                     "packet-loss faults are left out")
        why = self.verify()
        if why:
            raise FaultNetError("the cluster does not train before any fault: " + why)
        for i, f in enumerate(faults, 1):
            row = self.run_fault(i, f)
            self.rows.append(row)
            state = "ok" if not (row["problems"] or row["leaks"]) else \
                "FAIL " + "; ".join(row["problems"] + row["leaks"])
            self.log("%3d/%d %-17s %-9s detected %-6s recovered %-6s %s | %s" % (
                i, len(faults), f.kind, f.target,
                "-" if row["detected_s"] is None else "%.2fs" % row["detected_s"],
                "-" if row["recovered_s"] is None else "%.2fs" % row["recovered_s"], state,
                cause(row["message"])[:160]))
        return time.monotonic() - t_start


def parser():
    ap = argparse.ArgumentParser(prog="chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=100, help="faults to inject (default 100)")
    ap.add_argument("--quick", action="store_true",
                    help="8 faults, one of each main kind (a test; under 2 minutes)")
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--kinds", default="", help="comma-separated fault kinds to draw from")
    ap.add_argument("--sequence", default="",
                    help="comma-separated fault kinds injected in this order (replaces "
                         "--faults; targets still drawn at the seed)")
    ap.add_argument("--log-level", default="warn", help="servers' and daemons' logging.levels")
    ap.add_argument("--heartbeat-ms", type=int, default=500)
    ap.add_argument("--peer-timeout-ms", type=int, default=1500)
    ap.add_argument("--request-ms", type=int, default=4000)
    ap.add_argument("--timeout-ms", type=int, default=6000,
                    help="the ranks' own wait timeout per push_pull")
    ap.add_argument("--slack-s", type=float, default=1.5,
                    help="added to every detection bound (scheduling on a loaded machine)")
    ap.add_argument("--benign-s", type=float, default=2.0,
                    help="how long a benign fault (netem) stays before it is removed")
    ap.add_argument("--job-start-s", type=float, default=30.0)
    ap.add_argument("--recovery-s", type=float, default=20.0,
                    help="how long after the repair a new job must train (retrying)")
    ap.add_argument("--json", help="also write the JSON summary to this file")
    ap.add_argument("--verbose", action="store_true", help="echo every process's output")
    return ap


QUICK_KINDS = ["kill-rank", "kill-daemon", "kill-coordinator", "link-down", "partition",
               "stop-rank", "packet-loss", "kill-server"]


def main(argv=None):
    a = parser().parse_args(argv)
    why = netns.check_permission()
    if why:
        print("chaos: skipped: %s" % why)
        return 77
    chaos = Chaos(a)
    if a.quick:
        # One fault of each main kind, in a seeded order, coordinator loss included.
        faults = []
        available = {chaos.pick().kind for _ in range(400)}
        for kind in [k for k in QUICK_KINDS if k in available]:
            while True:
                f = chaos.pick()
                if f.kind == kind:
                    faults.append(f)
                    break
        chaos.plan = lambda _count: faults

    t0 = time.monotonic()
    elapsed, code = run_guarded(chaos.run, chaos.net.stop, chaos.log,
                                (FaultNetError, netns.NetnsError, subprocess.SubprocessError,
                                 OSError))
    elapsed = elapsed or time.monotonic() - t0
    print(chaos.table())
    summary = chaos.summary(elapsed)
    print_json(summary, a.json)
    if code == 0 and (summary["chaos"]["failed"] or not chaos.rows):
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
