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
     too once resumed or is restarted. Faults to live through (loss, a slow
     link, delay and reordering: chaos_links): the job must go on training
     with exact results for the fault's duration, then (repaired) end 20
     iterations later like a finite job, every rank with DONE. Heavy loss
     and a flapping link may instead end the job, every rank naming the
     cause; none may hang or compute a wrong sum;
  4. repair (SIGCONT, restart the killed service, link up, rules and qdiscs removed);
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
import signal
import statistics
import subprocess
import sys
import time

from bytecomp_harness import netns
from bytecomp_harness.chaos_links import Links
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


class Job:
    """One job's four ranks (rank r = node r // 2, local rank r % 2)."""

    def __init__(self, net, name, iterations, timeout_ms, elements=256):
        self.name = name
        # Where the harness writes the iteration every rank ends at (a job
        # that survived a fault finishes like any job: close, DONE).
        self.stop_file = os.path.join(net.tmp, "stop-" + name)
        # Values repeat every 500 iterations: a job that lives through a
        # long fault runs thousands, and sums past 2048 are not exact in
        # fp16 (tensors b and c), which would read as a wrong result.
        extra = ["--iterations", str(iterations), "--timeout-ms", str(timeout_ms),
                 "--elements", str(elements), "--report-every", "1",
                 "--stop-file", self.stop_file, "--value-period", "500"]
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

    def finish(self, more):
        """Every rank ends `more` iterations after the furthest one; returns
        that count. The ranks are stopped meanwhile: their ITER lines reach
        the harness through pipes that lag under load (26 iterations once,
        at 400 iterations/s), so a count taken while they run could be one
        a rank has already passed. A pause of a few tenths of a second is
        far below every timeout of the job."""
        for p in self.ranks:
            p.signal(signal.SIGSTOP)
        try:
            seen = None
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                time.sleep(0.25)
                now = self.progress()
                if now == seen:
                    break
                seen = now
            end_at = max(seen) + more
            tmp = self.stop_file + ".tmp"
            with open(tmp, "w") as f:
                f.write("%d\n" % end_at)
            os.rename(tmp, self.stop_file)
        finally:
            for p in self.ranks:
                p.signal(signal.SIGCONT)
        return end_at

    def end(self):
        for p in self.ranks:
            p.end(2.0)
        try:
            os.unlink(self.stop_file)
        except FileNotFoundError:
            pass


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
    message must contain one, `bound_s` = detection bound. Not fatal: the
    job must survive (`either` False) or may instead abort naming the
    cause (`either` True: heavy loss, a flapping link); `spec` = the
    fault's parameters."""

    def __init__(self, kind, target, fatal, bound_s, names, hit=(), service=None, ns=None,
                 either=False, spec=None):
        self.kind = kind
        self.target = target
        self.fatal = fatal
        self.bound_s = bound_s
        self.names = names
        self.hit = list(hit)
        self.service = service      # ("daemon"|"server", index)
        self.ns = ns                # namespace index for link faults
        self.either = either
        self.spec = spec or {}
        self.repaired = False

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
        self.links = Links(self.net, echo=self._echo if args.verbose else None)
        self.netem = self.links.netem_ok
        self.iptables = self.links.iptables

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
        link_names = [node_id, "node 0", "node 1", "coordinator", "within"]
        seed = self.rng.randrange(1 << 30)
        loss = round(self.rng.uniform(0.05, 0.10), 3)
        downs = [round(self.rng.uniform(0.2, 1.8), 2) for _ in range(4)]
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
                "packet-loss", "node %d" % n, False, 0, [], ns=n, spec={"probability": 0.03}),
            "slow-link": lambda: Fault(
                "slow-link", "node %d" % n, False, 0, [], ns=n),
            # Issue 28: slow and unstable links. delay and reorder must be
            # survived; heavy loss and a flapping link may instead end the
            # job, naming the cause (a down longer than peer_timeout is a
            # lost node), but never hang or give a wrong sum.
            "delay": lambda: Fault(
                "delay", "node %d" % n, False, 0, [], ns=n,
                spec={"delay_ms": 40, "jitter_ms": 20, "hold_fraction": 1.0, "seed": seed}),
            "reorder": lambda: Fault(
                "reorder", "node %d" % n, False, 0, [], ns=n,
                spec={"delay_ms": 8, "jitter_ms": 6, "hold_fraction": 0.3, "seed": seed}),
            "heavy-loss": lambda: Fault(
                "heavy-loss", "node %d" % n, False, 0, link_names, ns=n,
                either=True, spec={"probability": loss}),
            "flap": lambda: Fault(
                "flap", "node %d" % n, False, 0, link_names, ns=n, either=True,
                spec={"down_s": downs, "up_s": 2.0}),
        }
        if not self.iptables:
            for kind in ("partition", "packet-loss", "delay", "reorder", "heavy-loss"):
                del kinds[kind]
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
    def inject(self, f, job):
        net, links = self.net, self.links
        if f.kind in ("kill-rank", "stop-rank"):
            job.ranks[f.hit[0]].signal(signal.SIGKILL if f.kind == "kill-rank"
                                       else signal.SIGSTOP)
        elif f.service:
            what, i = f.service
            p = net.daemons[i] if what == "daemon" else net.servers[i]
            p.signal(signal.SIGKILL if f.kind.startswith("kill") else signal.SIGSTOP)
        elif f.kind in ("link-down", "server-link-down", "flap"):
            links.link(f.ns, False)     # a flap's first down; _watch_survive does the rest
        elif f.kind == "partition":
            links.drop(f.ns)
        elif f.kind in ("packet-loss", "heavy-loss"):
            links.drop(f.ns, f.spec["probability"])
        elif f.kind == "slow-link":
            links.tbf(f.ns, "2mbit")
        elif f.kind in ("delay", "reorder"):
            links.delay(f.ns, **f.spec)
        elif f.kind == "netem-delay":
            links.netem(f.ns, ["delay", "30ms", "10ms"])
        elif f.kind == "netem-reorder":
            links.netem(f.ns, ["delay", "10ms", "reorder", "25%", "50%"])

    def repair(self, f, job):
        """Undoes the fault (once); returns a problem string or None."""
        if f.repaired:
            return None
        f.repaired = True
        net, links = self.net, self.links
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
            elif f.kind in ("link-down", "server-link-down", "flap"):
                links.link(f.ns, True)
            elif f.kind in ("partition", "packet-loss", "heavy-loss"):
                links.flush(f.ns)
            elif f.kind in ("delay", "reorder"):
                f.spec["stats"] = links.undelay(f.ns)
            elif f.kind == "slow-link":
                links.tbf(f.ns, None)
            elif f.ns is not None:
                links.netem(f.ns, None)
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
               "leaks": [], "problems": [], "recovered_s": None, "first_job": "",
               "outcome": "detected" if f.fatal else ""}
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
                self._watch_survive(f, job, t0, row)
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

    def _hold(self, f):
        """Keeps the fault for its duration: --benign-s, or a flap's cycles
        (down for each of spec['down_s'], up spec['up_s'] between them)."""
        if f.kind != "flap":
            time.sleep(self.a.benign_s)
            return ""
        downs = f.spec["down_s"]
        for i, down in enumerate(downs):
            if i:
                self.links.link(f.ns, False)
            time.sleep(down)
            self.links.link(f.ns, True)
            if i + 1 < len(downs):
                time.sleep(f.spec["up_s"])
        return "down %s s, up %.0f s between" % ("/".join("%.2f" % d for d in downs),
                                                 f.spec["up_s"])

    def _watch_survive(self, f, job, t0, row):
        """A fault the job should live through: after --benign-s (or the
        flap's cycles) it is repaired and every rank told to end 20
        iterations later, so the job finishes like any other (close, DONE,
        every sum checked exactly). Only an `either` fault may end the job
        instead, each rank naming the cause; none may hang."""
        start = job.progress()
        what = self._hold(f)
        moved = [b - a for a, b in zip(start, job.progress())]
        why = self.repair(f, job)
        if why:
            row["problems"].append(why)
        end_at = job.finish(20)
        t_stop = time.monotonic()
        bound = self.stall_bound + 15.0
        while any(p.alive() for p in job.ranks) and time.monotonic() < t_stop + bound:
            time.sleep(0.02)
        hung = [p.label for p in job.ranks if p.alive()]
        if hung:
            row["problems"].append("hung: %s still running %.0f s after the repair" % (
                ", ".join(hung), bound))
        errors = [(p, outcome(p, t0)) for p in job.ranks if outcome(p, t0)]
        done = [p for p in job.ranks if p.returncode == 0 and p.first(("DONE",), t0)]
        for p, o in errors:
            if o[1].startswith("WRONG") or not f.either:
                row["problems"].append("%s: %s" % (p.label, o[1]))
            elif not any(t in o[1] for t in f.names):
                row["problems"].append("%s: message names no cause (%s): %s" % (
                    p.label, " / ".join(f.names), o[1]))
        odd = [p for p in job.ranks if p not in done and not any(p is q for q, _ in errors)
               and not p.alive()]
        for p in odd:
            row["problems"].append("%s: ended (%s) with neither DONE nor an error: %s" % (
                p.label, p.returncode, " | ".join(p.tail(2))))
        stats = f.spec.get("stats") or what or (
            "%.1f %% loss" % (100 * f.spec["probability"]) if "probability" in f.spec else "")
        row["fault_spec"] = stats
        if errors:
            row["outcome"] = "aborted"
            row["detected_s"] = round(max(o[0] for _, o in errors) - t0, 3)
            row["message"] = errors[0][1][1]
            return
        if not f.either and min(moved) < 3:
            row["problems"].append("training stalled under %s (iterations per rank in "
                                   "%.1f s: %s)" % (f.kind, self.a.benign_s, moved))
        row["outcome"] = "survived" if len(done) == len(job.ranks) else "hung"
        row["message"] = "survived: %d iterations under the fault, all %d ranks finished at %d " \
            "exactly%s" % (min(moved), len(done), end_at, " (%s)" % stats if stats else "")

    def _heal(self):
        """After a failed check: fresh services so one failure does not
        cascade into every later fault."""
        net = self.net
        for i in range(NODES + SERVERS):
            self.links.heal(i)
        for p in net.services():
            p.end(3.0)
        for k in range(SERVERS):
            net.start_server(k)
        for n in range(NODES):
            net.start_daemon(n)
        self.log("services restarted after a failed check")

    def stop(self):
        """Everything the run started, its namespaces included; never raises."""
        try:
            self.links.stop()
        except Exception:  # noqa: BLE001 - the cluster must still be stopped
            pass
        self.net.stop()

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
        lines += ["", "| fault kind | n | survived | detected median (s) | max (s) | bound (s) | "
                  "leaked | first job after the repair failed | recovered max (s) | failed |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |"]
        for kind in sorted({r["fault"] for r in self.rows}):
            rs = [r for r in self.rows if r["fault"] == kind]
            ts = [r["detected_s"] for r in rs if r["detected_s"] is not None]
            rec = [r["recovered_s"] for r in rs if r["recovered_s"] is not None]
            lines.append("| %s | %d | %s | %s | %s | %s | %s | %d | %s | %d |" % (
                kind, len(rs), "-" if rs[0]["fatal"] else
                sum(1 for r in rs if r["outcome"] == "survived"),
                "%.2f" % statistics.median(ts) if ts else "-",
                "%.2f" % max(ts) if ts else "-",
                "%.1f" % rs[0]["bound_s"] if rs[0]["bound_s"] else "-",
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
                                              "first_job_failed": 0, "recovered_max_s": None,
                                              "detected": 0, "survived": 0, "aborted": 0})
            k["n"] += 1
            if r["outcome"] in ("detected", "survived", "aborted"):
                k[r["outcome"]] += 1
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
            self.log("iptables-legacy not found (scripts/install-deps): the partition, "
                     "packet-loss, heavy-loss, delay and reorder faults are left out")
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
                cause(row["message"])[:160] + (" [%s]" % row["fault_spec"]
                                               if row.get("outcome") == "aborted" else "")))
        return time.monotonic() - t_start


def parser():
    ap = argparse.ArgumentParser(prog="chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=100, help="faults to inject (default 100)")
    ap.add_argument("--quick", action="store_true",
                    help="10 faults, one of each main kind (a test; about 2 minutes)")
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
    ap.add_argument("--benign-s", type=float, default=3.0,
                    help="how long a fault the job should survive (loss, delay, a slow link) "
                         "stays before it is removed")
    ap.add_argument("--job-start-s", type=float, default=30.0)
    ap.add_argument("--recovery-s", type=float, default=20.0,
                    help="how long after the repair a new job must train (retrying)")
    ap.add_argument("--json", help="also write the JSON summary to this file")
    ap.add_argument("--verbose", action="store_true", help="echo every process's output")
    return ap


QUICK_KINDS = ["kill-rank", "kill-daemon", "kill-coordinator", "link-down", "partition",
               "stop-rank", "packet-loss", "kill-server", "reorder", "flap"]


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
    elapsed, code = run_guarded(chaos.run, chaos.stop, chaos.log,
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
