"""Soak on the emulated cluster (issue 18): one two-node job for many
iterations with a strategy change every --change-every iterations, sampling
the memory (VmRSS) and open file descriptors of both daemons, both servers
and every training rank, and the job's shared-memory segments.

Cluster: bytecomp_harness.faultnet (two nodes with two ranks each, two servers).
Tensors: 'a' uncompressed through the servers (never changes), 'b' through
the servers and 'c' by peer allgather between the daemons, both switching
between fp16 and bf16 at every change (SIGHUP of node 0's daemon with the
strategy file rewritten: the coordinator applies it on every node at one
iteration). Values repeat every 32 iterations so that every sum stays a
small integer: exact through fp16 and bf16, and every rank checks every
element of every tensor after every iteration (bytecomp_harness.chaos_worker).

Checks (exit 1 when one fails):
  - every rank finished all iterations with exact results;
  - every strategy change was applied (daemon log: "strategy changes at
    iteration N", the coordinator's announcement, on both nodes);
  - flat memory: per process, the median RSS of the last 20% of the samples
    is within --rss-tolerance (default 2%) of the median of the 20-40%
    window (the first 20% is warm-up);
  - open fds of every process constant from the end of the warm-up on;
  - exactly one shm segment per node all along, none left at the end.
Ends with a table and one JSON line; exit 77 without namespaces.
"""

import argparse
import signal
import statistics
import sys
import time

from bytecomp_harness import netns
from bytecomp_harness.faultnet import NODES, FaultNet, FaultNetError
from bytecomp_harness.procs import print_json, run_guarded, write_file

LOCAL = 2
PERIOD = 32


def strategy(variant):
    comp = "fp16" if variant % 2 == 0 else "bf16"
    return ("version: 1\nmeta: {note: \"scripts/soak variant %d\"}\n"
            "default: {compressor: none}\nentries:\n"
            "  - tensor: \"b\"\n    option: {compressor: %s, inter: alltoall_allgather}\n"
            "  - tensor: \"c\"\n    option: {compressor: %s, inter: allgather}\n"
            % (variant, comp, comp))


def flat(samples, tolerance):
    """(ok, warm median, end median, growth %) of one process's RSS samples."""
    n = len(samples)
    if n < 10:
        return False, None, None, None
    warm = statistics.median(samples[n // 5:(2 * n) // 5])
    end = statistics.median(samples[(4 * n) // 5:])
    growth = (end - warm) * 100.0 / warm if warm else 0.0
    return growth <= tolerance * 100.0, warm, end, growth


class Soak:
    def __init__(self, a, out=sys.stdout):
        self.a = a
        self.out = out
        self.net = FaultNet(heartbeat_ms=500, peer_timeout_ms=3000, request_ms=10000,
                            strategy_text=strategy(0),
                            log_level="warn,ps_client=info",
                            echo=self.log if a.verbose else None)
        self.samples = {}      # label -> [(iteration, rss_kib, fds)]
        self.segments = []     # [(iteration, count)]
        self.problems = []
        self.changes = 0

    def log(self, msg):
        self.out.write("soak: %s\n" % msg)
        self.out.flush()

    def sample(self, it, procs):
        for p in procs:
            rss, fds = p.rss_kib(), p.fd_count()
            if rss is not None and fds is not None:
                self.samples.setdefault(p.label, []).append((it, rss, fds))
        self.segments.append((it, len(self.net.segments())))

    def run(self):
        a = self.a
        t0 = time.monotonic()
        self.net.start()
        self.log("cluster up (%s): %d iterations, a strategy change every %d" % (
            self.net.tmp, a.iterations, a.change_every))
        job = "%sj1" % self.net.net.tag
        extra = ["--iterations", str(a.iterations), "--timeout-ms", "20000",
                 "--elements", str(a.elements), "--report-every", "10",
                 "--value-period", str(PERIOD)]
        ranks = [self.net.worker("rank %d" % r, r // LOCAL, job, r % LOCAL, LOCAL, NODES, extra)
                 for r in range(NODES * LOCAL)]
        procs = self.net.services() + ranks
        next_change = a.change_every
        next_sample = 0
        step = max(1, a.iterations // a.samples)
        deadline = time.monotonic() + a.time_limit
        try:
            while True:
                prog = []
                for p in ranks:
                    last = p.last("ITER ")
                    prog.append(int(last[1].split()[1]) if last else -1)
                done = min(prog)
                if all(not p.alive() for p in ranks):
                    break
                if any(not p.alive() and p.returncode != 0 for p in ranks):
                    break
                # Not at the very end: ranks closing change fds and segments.
                if done >= next_sample and done < a.iterations - 30 and \
                        all(p.alive() for p in ranks):
                    self.sample(done, procs)
                    next_sample += step
                if done >= next_change and next_change < a.iterations:
                    self.changes += 1
                    write_file(self.net.tmp, "strategy.yaml", strategy(self.changes))
                    self.net.daemons[0].signal(signal.SIGHUP)
                    next_change += a.change_every
                if time.monotonic() > deadline:
                    self.problems.append("time limit of %.0f s reached at iteration %d" % (
                        a.time_limit, done))
                    break
                time.sleep(0.05)
            for p in ranks:
                if p.wait(30.0) is None:
                    self.problems.append("%s did not end" % p.label)
                if p.returncode != 0 or not p.first(("DONE",)):
                    self.problems.append("%s: exit %s: %s" % (p.label, p.returncode,
                                                              " | ".join(p.tail(3))))
            time.sleep(0.5)
            left = self.net.segments()
            if left:
                self.problems.append("segments left after the job: " + " ".join(left))
        finally:
            for p in ranks:
                p.end(2.0)
        self.check()
        return time.monotonic() - t0

    def check(self):
        a = self.a
        for n, d in enumerate(self.net.daemons):
            applied = sum(1 for _, line in d.lines if "strategy changes at iteration" in line)
            if applied != self.changes:
                self.problems.append("daemon %d applied %d of %d strategy changes" % (
                    n, applied, self.changes))
        self.rows = []
        for label, s in sorted(self.samples.items()):
            rss = [x[1] for x in s]
            fds = [x[2] for x in s]
            ok, warm, end, growth = flat(rss, a.rss_tolerance)
            after = fds[len(fds) // 5:]
            fd_ok = bool(after) and min(after) == max(after)
            self.rows.append({"process": label, "samples": len(s), "rss_warm_kib": warm,
                              "rss_end_kib": end, "growth_pct": None if growth is None
                              else round(growth, 2), "rss_max_kib": max(rss),
                              "fds_min": min(after) if after else None,
                              "fds_max": max(after) if after else None,
                              "flat": ok and fd_ok})
            if not ok:
                self.problems.append("%s: RSS grew %s%% (median %s KiB in the 20-40%% window, "
                                     "%s KiB in the last 20%%; tolerance %.1f%%)" % (
                                         label, "?" if growth is None else "%.2f" % growth,
                                         warm, end, a.rss_tolerance * 100))
            if not fd_ok:
                self.problems.append("%s: open fds changed after the warm-up (%s..%s)" % (
                    label, min(after) if after else "?", max(after) if after else "?"))
        counts = {c for _, c in self.segments[1:]}
        if counts - {NODES}:
            self.problems.append("shm segments during the job: %s (expected %d)" % (
                sorted(counts), NODES))

    def table(self):
        lines = ["", "| process | samples | RSS 20-40%% median (KiB) | RSS last 20%% median "
                 "(KiB) | growth %% | RSS max (KiB) | fds after warm-up | flat |",
                 "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
        lines = [x.replace("%%", "%") for x in lines]
        for r in self.rows:
            lines.append("| %s | %d | %s | %s | %s | %s | %s..%s | %s |" % (
                r["process"], r["samples"], r["rss_warm_kib"], r["rss_end_kib"],
                r["growth_pct"], r["rss_max_kib"], r["fds_min"], r["fds_max"],
                "yes" if r["flat"] else "NO"))
        return "\n".join(lines)


def parser():
    ap = argparse.ArgumentParser(prog="soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=10000)
    ap.add_argument("--change-every", type=int, default=1000)
    ap.add_argument("--quick", action="store_true",
                    help="5,000 iterations, a change every 500 (a test; under 2 minutes)")
    ap.add_argument("--elements", type=int, default=1024, help="elements per tensor")
    ap.add_argument("--samples", type=int, default=100, help="samples over the run")
    ap.add_argument("--rss-tolerance", type=float, default=0.02)
    ap.add_argument("--time-limit", type=float, default=1800.0)
    ap.add_argument("--json", help="also write the JSON summary to this file")
    ap.add_argument("--verbose", action="store_true")
    return ap


def main(argv=None):
    a = parser().parse_args(argv)
    if a.quick:
        a.iterations, a.change_every, a.time_limit = 5000, 500, min(a.time_limit, 110.0)
    why = netns.check_permission()
    if why:
        print("soak: skipped: %s" % why)
        return 77
    soak = Soak(a)

    t0 = time.monotonic()
    soak.rows = []
    _, code = run_guarded(soak.run, soak.net.stop, soak.log,
                          (FaultNetError, netns.NetnsError, OSError),
                          on_error=lambda e: soak.problems.append(str(e)))
    elapsed = time.monotonic() - t0
    print(soak.table())
    for p in soak.problems:
        print("soak: FAIL: %s" % p)
    summary = {"soak": {"iterations": a.iterations, "changes": soak.changes,
                        "elapsed_s": round(elapsed, 1), "rss_tolerance": a.rss_tolerance,
                        "processes": soak.rows, "problems": soak.problems,
                        "ok": not soak.problems and code == 0}}
    print_json(summary, a.json)
    if code == 0 and soak.problems:
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
