#!/usr/bin/env python3
"""bytecompctl, metrics, reload, drain and the sd_notify watchdog against
real bytecompd (and bytecomp-server) processes. Run by meson test (suite
ops); needs BYTECOMP_BUILD_ROOT and BYTECOMP_SOURCE_ROOT."""
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import uuid

BUILD = os.environ["BYTECOMP_BUILD_ROOT"]
SOURCE = os.environ["BYTECOMP_SOURCE_ROOT"]
sys.path.insert(0, os.path.join(SOURCE, "client", "python"))
os.environ.setdefault("BYTECOMP_BUILD_ROOT", BUILD)

from bytecomp import _lib  # noqa: E402
from bytecomp.run import _can_connect as can_connect  # noqa: E402

BYTECOMPD = os.path.join(BUILD, "daemon", "bytecompd")
SERVER = os.path.join(BUILD, "server", "bytecomp-server")
CTL = os.path.join(BUILD, "scripts", "bytecompctl")

STRATEGY = """version: 1
default: {compressor: none}
rules:
  - match: "big.*"
    option: {compressor: fp16, inter: allreduce}
"""
BIG = 65536    # float32 elements: 256 KiB, compressed with fp16
SMALL = 100    # uncompressed
PARTITION = 64 * 1024  # the daemons' scheduler.partition_bytes: BIG has 4 partitions
PARTS = {"big.w": 4, "small": 1}


def wait_until(pred, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


class Daemon:
    def __init__(self, extra="", env=None, strategy=True, strategy_text=STRATEGY):
        self.dir = tempfile.mkdtemp(prefix="bc-ops-")
        self.socket = os.path.join(self.dir, "ctl.sock")
        self.instance = "ops%dx%s" % (os.getpid(), uuid.uuid4().hex[:6])
        self.metrics_dir = os.path.join(self.dir, "metrics")
        os.makedirs(self.metrics_dir)
        self.strategy = os.path.join(self.dir, "strategy.yaml")
        with open(self.strategy, "w") as f:
            f.write(strategy_text)
        self.config = os.path.join(self.dir, "daemon.yaml")
        self.write_config(extra, strategy)
        self.log_path = os.path.join(self.dir, "daemon.log")
        self.log = open(self.log_path, "wb")
        e = dict(os.environ)
        e["BYTECOMP_LOG"] = "info"
        e.update(env or {})
        self.proc = subprocess.Popen([BYTECOMPD, "--config", self.config], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=e)
        if not wait_until(lambda: can_connect(self.socket) or self.proc.poll() is not None, 10) \
                or self.proc.poll() is not None:
            out = self.output()
            self.stop()
            raise RuntimeError("bytecompd did not come up: " + out)

    def write_config(self, extra="", strategy=True, threads=1):
        with open(self.config, "w") as f:
            f.write("version: 1\ncontrol:\n  socket: %s\n  setup_timeout_ms: 10000\n"
                    "shm:\n  instance: %s\nscheduler:\n  threads: %d\n"
                    "  partition_bytes: %d\n"
                    "metrics:\n  textfile_dir: %s\n  interval_ms: 500\n%s%s"
                    % (self.socket, self.instance, threads, PARTITION, self.metrics_dir,
                       "strategy:\n  file: %s\n" % self.strategy if strategy else "", extra))

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        for n in os.listdir("/dev/shm"):
            if n.startswith("bytecomp.%s." % self.instance):
                os.unlink(os.path.join("/dev/shm", n))
        shutil.rmtree(self.dir, ignore_errors=True)


def ctl(sock, *args, user=None, timeout=30):
    """(exit status, stdout, stderr) of bytecompctl."""
    def drop():
        os.setgid(65534)
        os.setuid(65534)
    r = subprocess.run(["/usr/bin/python3", CTL, "--socket", sock, *args], capture_output=True,
                       text=True, timeout=timeout, preexec_fn=drop if user else None)
    return r.returncode, r.stdout, r.stderr


def ctl_json(sock, *args):
    rc, out, err = ctl(sock, "--json", *args)
    if rc != 0:
        raise AssertionError(f"bytecompctl {' '.join(args)}: exit {rc}: {err}")
    return json.loads(out)


class Job:
    """One local rank of a job, driven in-process through libbytecomp."""

    def __init__(self, daemon, job_id, tensors=(("big.w", BIG), ("small", SMALL)), **where):
        self.c = _lib.Client(job_id, socket_path=daemon.socket, **where)
        self.ids = []
        self.bufs = []
        for name, n in tensors:
            self.ids.append(self.c.declare(name, n, _lib.FLOAT32))
        self.c.start(10000)
        for t, (_, n) in zip(self.ids, tensors):
            addr, nbytes = self.c.buffer(t)
            assert nbytes == 4 * n
            self.bufs.append((ctypes.c_float * n).from_address(addr))
        self.iteration = 0
        self.bytes_per_iteration = sum(4 * n for _, n in tensors)

    def step(self):
        """One iteration of every tensor; checks the (single-rank) sum, exact
        in fp16 for these small integers."""
        it = self.iteration
        for b in self.bufs:
            for i in range(0, len(b), 97):
                b[i] = float((i + it) % 512)
        hs = [self.c.push_pull(t, it) for t in self.ids]
        for h in hs:
            if not self.c.wait_once(h, 20000):
                raise AssertionError(f"iteration {it} did not complete")
        for b in self.bufs:
            for i in range(0, len(b), 97):
                if b[i] != float((i + it) % 512):
                    raise AssertionError(f"iteration {it}: element {i} is {b[i]}")
        self.iteration += 1

    def close(self):
        return self.c.close()


def metric(text, name, labels=None):
    """The value of one sample of the Prometheus text (None when absent)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        assert m, f"not a Prometheus sample line: {line!r}"
        if m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if labels is None or all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def check_exposition_format(test, text):
    """Every sample's family has HELP and TYPE before it; names follow the
    conventions (counters end in _total)."""
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            if kind == "counter":
                test.assertTrue(name.endswith("_total"), name)
        elif line and not line.startswith("#"):
            name = re.match(r"^[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            if name not in types and types.get(family) == "histogram":
                name = family
                test.assertTrue(family.endswith("_seconds"), family)
            test.assertIn(name, types, f"sample before its TYPE: {line}")
            test.assertTrue(name.startswith("bytecomp_"), name)


SPANS = ("wait_ranks", "queue", "reduce", "compress", "send", "wire", "decompress", "copy_out")


def histogram(text, name, labels):
    """[(le, cumulative count)] of one histogram series, in file order."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^%s_bucket\{([^}]*)\} (\S+)$" % re.escape(name), line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(got.get(k) == v for k, v in labels.items()):
            out.append((float(got["le"]), float(m.group(2))))
    return out


def check_histograms(test, text, lab, rounds):
    """Every span's histogram of the job counts `rounds` rounds, buckets
    cumulative and increasing in le, +Inf = _count."""
    for span in SPANS:
        l = dict(lab, phase=span)
        buckets = histogram(text, "bytecomp_job_phase_seconds", l)
        test.assertGreater(len(buckets), 5, span)
        les = [b[0] for b in buckets]
        test.assertEqual(les, sorted(les), span)
        test.assertEqual(les[-1], float("inf"), span)
        counts = [b[1] for b in buckets]
        test.assertEqual(counts, sorted(counts), span)
        test.assertEqual(counts[-1], rounds, span)
        test.assertEqual(metric(text, "bytecomp_job_phase_seconds_count", l), rounds, span)
        test.assertGreaterEqual(metric(text, "bytecomp_job_phase_seconds_sum", l), 0, span)


class NoDaemon(unittest.TestCase):
    def test_every_command_says_no_daemon(self):
        d = tempfile.mkdtemp(prefix="bc-ops-none-")
        try:
            missing = os.path.join(d, "absent.sock")
            # A socket file nobody listens on (a daemon that died).
            stale = os.path.join(d, "stale.sock")
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.bind(stale)
            s.close()
            for sock, words in ((missing, "does not exist"), (stale, "connection refused")):
                for cmd in (["status"], ["jobs"], ["strategy", "j"], ["metrics"], ["reload"],
                            ["drain"], ["drain", "--off"],
                            ["trace", "--job", "j", "-o", os.path.join(d, "t.json")],
                            ["trace", "-o", os.path.join(d, "t.json")], ["servers"]):
                    rc, out, err = ctl(sock, *cmd)
                    self.assertEqual(rc, 3, (cmd, out, err))
                    self.assertIn("no bytecompd at " + sock, err)
                    self.assertIn(words, err)
                    self.assertNotIn("Traceback", err)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def test_usage_errors(self):
        rc, _, err = ctl("/nonexistent", "frobnicate")
        self.assertEqual(rc, 2)
        self.assertIn("invalid choice", err)
        rc, _, err = ctl("/nonexistent", "strategy")
        self.assertEqual(rc, 2)
        rc, _, err = ctl("/nonexistent", "trace")  # no -o
        self.assertEqual(rc, 2)
        self.assertIn("-o/--out", err)
        rc, _, err = ctl("/nonexistent", "trace", "-o", "x", "--seconds", "1", "--iterations", "2")
        self.assertEqual(rc, 2)
        self.assertIn("not allowed with", err)
        rc, _, err = ctl("/nonexistent", "trace", "-o", "x", "--iterations", "0")
        self.assertEqual(rc, 2)
        self.assertIn("at least 1", err)


class WithDaemon(unittest.TestCase):
    def setUp(self):
        self.d = Daemon()

    def tearDown(self):
        self.d.stop()

    def test_commands_against_a_running_job(self):
        job = Job(self.d, "opsjob")
        try:
            k = 5
            for _ in range(k):
                job.step()
            st = ctl_json(self.d.socket, "status")
            self.assertEqual(st["jobs"], {"forming": 0, "running": 1})
            self.assertEqual(st["job_ids"], ["opsjob"])
            self.assertEqual(st["config_sources"], [self.d.config])
            self.assertEqual(st["pid"], self.d.proc.pid)
            self.assertGreater(st["uptime_seconds"], 0)
            self.assertFalse(st["draining"])

            js = ctl_json(self.d.socket, "jobs")["jobs"]
            self.assertEqual(len(js), 1)
            j = js[0]
            self.assertEqual((j["id"], j["state"], j["local_size"], j["connected"]),
                             ("opsjob", "running", 1, 1))
            self.assertEqual(j["tensors"], 2)
            self.assertEqual(j["pushpulls"], 2 * k)
            self.assertEqual(j["rounds"], k * sum(PARTS.values()))
            self.assertEqual(j["iteration"], k - 1)
            self.assertEqual(j["strategy"]["mode"], "daemon")
            self.assertEqual(j["strategy"]["source"], self.d.strategy)
            self.assertEqual(j["compress"]["input_bytes"], k * 4 * BIG)
            # fp16: two bytes per element plus a small header per partition.
            out_bytes = j["compress"]["output_bytes"]
            self.assertGreaterEqual(out_bytes, k * 2 * BIG)
            self.assertLess(out_bytes, k * 2 * BIG + k * 256)

            s = ctl_json(self.d.socket, "strategy", "opsjob")
            opts = {t["name"]: t for t in s["tensors"]}
            self.assertEqual(opts["big.w"]["compressor"], "fp16")
            self.assertEqual(opts["big.w"]["bytes"], 4 * BIG)
            self.assertEqual(opts["small"]["compressor"], "none")
            rc, _, err = ctl(self.d.socket, "strategy", "nosuchjob")
            self.assertEqual(rc, 1)
            self.assertIn("no job 'nosuchjob'", err)

            # Human tables name the same things.
            rc, out, _ = ctl(self.d.socket, "status")
            self.assertEqual(rc, 0)
            self.assertIn("1 running, 0 forming: opsjob", out)
            rc, out, _ = ctl(self.d.socket, "jobs")
            self.assertEqual(rc, 0)
            self.assertRegex(out, r"opsjob\s+0\s+running\s+1/1")
            rc, out, _ = ctl(self.d.socket, "strategy", "opsjob")
            self.assertIn("big.w", out)
            self.assertIn("fp16", out)

            rc, text, _ = ctl(self.d.socket, "metrics")
            self.assertEqual(rc, 0)
            check_exposition_format(self, text)
            lab = {"bytecomp_job": "opsjob"}
            self.assertEqual(metric(text, "bytecomp_job_pushpulls_total", lab), 2 * k)
            self.assertEqual(metric(text, "bytecomp_job_iteration", lab), k - 1)
            self.assertEqual(metric(text, "bytecomp_job_compress_input_bytes_total", lab),
                             k * 4 * BIG)
            self.assertEqual(metric(text, "bytecomp_job_compress_output_bytes_total", lab),
                             out_bytes)
            self.assertAlmostEqual(metric(text, "bytecomp_job_compression_ratio", lab),
                                   k * 4 * BIG / out_bytes, places=5)
            self.assertEqual(metric(text, "bytecomp_jobs", {"state": "running"}), 1)
            prom = os.path.join(self.d.metrics_dir, "bytecompd.prom")
            with open(prom) as f:
                self.assertEqual(metric(f.read(), "bytecomp_job_pushpulls_total", lab), 2 * k)
            # The engine's side: one round per partition and iteration, each
            # in every span's histogram.
            rounds = k * sum(PARTS.values())
            self.assertEqual(metric(text, "bytecomp_job_rounds_total", lab), rounds)
            check_histograms(self, text, lab, rounds)
            self.assertEqual(metric(text, "bytecomp_job_queued_partitions", lab), 0)
            self.assertEqual(metric(text, "bytecomp_job_waiting_tensors", lab), 0)
            self.assertEqual(metric(text, "bytecomp_job_inflight_bytes", lab), 0)
            last = metric(text, "bytecomp_job_last_iteration_seconds", lab)
            self.assertIsNotNone(last)
            self.assertGreater(last, 0)
            self.assertLess(last, j["age_seconds"] + 5)
            j2 = ctl_json(self.d.socket, "jobs")["jobs"][0]
            self.assertEqual(j2["rounds"], rounds)
            self.assertEqual(j2["engine"], {"queued_partitions": 0, "waiting_tensors": 0,
                                            "inflight_bytes": 0})
            self.assertEqual(sorted(j2["phase_seconds"]), sorted(SPANS))
            # The JSON sums are the histograms' (rendered to 6 digits).
            for span, secs in j2["phase_seconds"].items():
                self.assertAlmostEqual(
                    secs, metric(text, "bytecomp_job_phase_seconds_sum", dict(lab, phase=span)),
                    delta=1e-5 + secs * 1e-4)
            self.assertGreater(j2["last_iteration_seconds"], 0)

            for _ in range(2):
                job.step()
        finally:
            self.assertIsNone(job.close())
        k = 7
        # The job's counts move to the daemon's totals when it ends.
        self.assertTrue(wait_until(lambda: ctl_json(self.d.socket, "status")["jobs"]
                                   == {"forming": 0, "running": 0}, 10))
        rc, text, _ = ctl(self.d.socket, "metrics")
        self.assertEqual(metric(text, "bytecomp_pushpulls_total"), 2 * k)
        self.assertEqual(metric(text, "bytecomp_compress_input_bytes_total"), k * 4 * BIG)
        self.assertEqual(metric(text, "bytecomp_jobs_started_total"), 1)
        self.assertEqual(metric(text, "bytecomp_jobs_finished_total"), 1)
        self.assertIsNone(metric(text, "bytecomp_job_pushpulls_total"))

    def trace(self, *args, timeout=60):
        """(exit status, parsed trace or None, stdout, stderr) of bytecompctl trace."""
        out = os.path.join(self.d.dir, "trace-%s.json" % uuid.uuid4().hex[:6])
        rc, so, se = ctl(self.d.socket, "trace", "-o", out, *args, timeout=timeout)
        doc = None
        if os.path.exists(out):
            with open(out) as f:
                doc = json.load(f)
        return rc, doc, so, se

    def check_trace(self, doc, iterations, tracks="phase"):
        """The trace holds, for every partition of every tensor and each of
        `iterations`, slices in phase order; events sorted by time."""
        evs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
        self.assertTrue(evs)
        self.assertEqual([e["ts"] for e in evs], sorted(e["ts"] for e in evs))
        first_x = doc["traceEvents"].index(evs[0])
        self.assertTrue(all(e["ph"] == "M" for e in doc["traceEvents"][:first_x]))
        threads = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
        self.assertEqual(doc["otherData"]["iterations"], iterations)
        seen = {}
        for e in evs:
            self.assertGreaterEqual(e["dur"], 0)
            self.assertIn(e["tid"], threads)
            a = e["args"]
            if a.get("phase") is None:  # the iterations track
                self.assertEqual(threads[e["tid"]], "iterations")
                self.assertEqual(e["name"], "iteration %d" % a["iteration"])
                continue
            self.assertIn(a["tensor"], PARTS)
            self.assertIn(a["phase"], SPANS)
            self.assertLess(a["partition"], PARTS[a["tensor"]])
            self.assertIn(a["iteration"], iterations)
            if tracks == "phase":
                self.assertEqual(e["name"], a["tensor"])
            else:
                self.assertEqual(e["name"], a["phase"])
                self.assertEqual(threads[e["tid"]].split(" #")[0], a["tensor"])
            seen.setdefault((a["tensor"], a["partition"], a["iteration"]), []).append(e)
        want = {(t, p, it) for t, n in PARTS.items() for p in range(n) for it in iterations}
        self.assertEqual(set(seen), want)
        for key, es in seen.items():
            # Each round's spans follow one another.
            es.sort(key=lambda e: SPANS.index(e["args"]["phase"]))
            for a, b in zip(es, es[1:]):
                self.assertLessEqual(a["ts"] + a["dur"], b["ts"] + 0.001, key)
        # Slices of one lane never overlap (they would not render).
        by_tid = {}
        for e in evs:
            by_tid.setdefault(e["tid"], []).append(e)
        for tid, es in by_tid.items():
            for a, b in zip(es, es[1:]):
                self.assertLessEqual(a["ts"] + a["dur"], b["ts"] + 0.001, threads[tid])
        return evs, threads

    def test_trace_of_a_running_job(self):
        job = Job(self.d, "traced")
        try:
            for _ in range(5):
                job.step()
            # The latest 3 whole iterations, held by the daemon already.
            rc, doc, out, err = self.trace("--job", "traced", "--iterations", "3")
            self.assertEqual(rc, 0, err)
            self.assertIn("wrote ", out)
            evs, threads = self.check_trace(doc, [2, 3, 4])
            names = set(threads.values())
            # fp16 compression of big.w on the CPU pool, sums and copies on
            # the intra-node link: the planner's track names.
            self.assertIn("CPU compression pool", names)
            self.assertIn("intra-node link", names)
            self.assertIn("iterations", names)
            self.assertTrue(any(e["args"].get("phase") == "compress" and
                                e["name"] == "big.w" for e in evs))
            self.assertFalse(any(e["args"].get("phase") == "compress" and
                                 e["name"] == "small" for e in evs))

            # Per-tensor tracks; --job may be left out with one job.
            rc, doc, _, err = self.trace("--iterations", "2", "--tracks", "tensor")
            self.assertEqual(rc, 0, err)
            _, threads = self.check_trace(doc, [3, 4], tracks="tensor")
            self.assertEqual({n.split(" #")[0] for n in threads.values()},
                             {"big.w", "small", "iterations"})

            # --iterations waits for iterations still to come: 5 are held,
            # 3 more make 8 (a 4th step would race the poll that sees the 8th).
            out = os.path.join(self.d.dir, "wait.json")
            p = subprocess.Popen(["/usr/bin/python3", CTL, "--socket", self.d.socket, "--json",
                                  "trace", "--iterations", "8", "--within", "60", "-o", out],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(0.5)
            self.assertIsNone(p.poll(), "returned before 8 iterations were held")
            for _ in range(3):
                job.step()
            so, se = p.communicate(timeout=60)
            self.assertEqual(p.returncode, 0, se)
            self.assertEqual(json.loads(so)["iterations"], list(range(0, 8)))
            with open(out) as f:
                self.check_trace(json.load(f), list(range(0, 8)))

            # --seconds: every round finished meanwhile (iterations 8..13).
            stepper = threading.Thread(target=lambda: [job.step() for _ in range(6)])
            out = os.path.join(self.d.dir, "secs.json")
            p = subprocess.Popen(["/usr/bin/python3", CTL, "--socket", self.d.socket, "--json",
                                  "trace", "--seconds", "3", "--interval", "0.01", "-o", out],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(0.3)
            stepper.start()
            stepper.join(60)
            so, se = p.communicate(timeout=60)
            self.assertEqual(p.returncode, 0, se)
            with open(out) as f:
                doc = json.load(f)
            its = doc["otherData"]["iterations"]
            self.assertEqual(its[-1], 13)
            if doc["otherData"]["missed_records"] == 0:
                self.check_trace(doc, its)

            # Bad requests.
            rc, doc, _, err = self.trace("--job", "nosuchjob")
            self.assertEqual(rc, 1)
            self.assertIn("no job 'nosuchjob'", err)
            self.assertIsNone(doc)
            other = Job(self.d, "other")
            try:
                rc, doc, _, err = self.trace()
                self.assertEqual(rc, 1)
                self.assertIn("2 jobs (other, traced): choose one with --job", err)
                # A job that makes no progress: a bounded wait, nothing written.
                rc, doc, _, err = self.trace("--job", "other", "--iterations", "2",
                                             "--within", "0.5")
                self.assertEqual(rc, 1)
                self.assertIn("completed 0 of 2 iterations within 0.5 s", err)
                self.assertIsNone(doc)
                rc, doc, _, err = self.trace("--job", "other")
                self.assertEqual(rc, 1)
                self.assertIn("no finished partition round yet", err)
            finally:
                self.assertIsNone(other.close())
        finally:
            self.assertIsNone(job.close())

    def test_waiting_tensors_gauge_follows_the_local_ranks(self):
        jobs = [None, None]

        def join(r):
            jobs[r] = Job(self.d, "pair", tensors=(("small", SMALL),), local_rank=r,
                          local_size=2)
        ts = [threading.Thread(target=join, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        self.assertTrue(all(jobs))
        lab = {"bytecomp_job": "pair"}

        def gauge():
            rc, text, _ = ctl(self.d.socket, "metrics")
            return metric(text, "bytecomp_job_waiting_tensors", lab)
        try:
            self.assertEqual(gauge(), 0)
            h0 = jobs[0].c.push_pull(jobs[0].ids[0], 0)
            # Rank 0 submitted, rank 1 not yet: one tensor waits.
            self.assertTrue(wait_until(lambda: gauge() == 1, 10))
            time.sleep(0.3)
            self.assertEqual(gauge(), 1)
            h1 = jobs[1].c.push_pull(jobs[1].ids[0], 0)
            for j, h in ((jobs[0], h0), (jobs[1], h1)):
                self.assertTrue(j.c.wait_once(h, 20000))
            self.assertTrue(wait_until(lambda: gauge() == 0, 10))
            rc, text, _ = ctl(self.d.socket, "metrics")
            self.assertEqual(metric(text, "bytecomp_job_rounds_total", lab), 1)
            # The wait for rank 1 is in the wait_ranks span: at least the 0.3 s
            # slept above.
            self.assertGreaterEqual(
                metric(text, "bytecomp_job_phase_seconds_sum", dict(lab, phase="wait_ranks")), 0.3)
        finally:
            for j in jobs:
                self.assertIsNone(j.close())

    def test_metrics_file_is_rewritten_periodically(self):
        prom = os.path.join(self.d.metrics_dir, "bytecompd.prom")
        self.assertTrue(wait_until(lambda: os.path.exists(prom), 10))
        with open(prom) as f:
            first = metric(f.read(), "bytecomp_metrics_writes_total", {"result": "ok"})

        def advanced():
            with open(prom) as f:
                return metric(f.read(), "bytecomp_metrics_writes_total", {"result": "ok"}) > first
        self.assertTrue(wait_until(advanced, 10))
        # Written by rename: no temporary file is left beside it.
        self.assertEqual(sorted(os.listdir(self.d.metrics_dir)), ["bytecompd.prom"])

    def test_aborts_are_counted_by_reason(self):
        # A worker that starts its job, then dies without leaving it.
        w = subprocess.Popen([os.path.join(BUILD, "tests", "daemon", "bc_worker"), self.d.socket,
                              "dies", "0", "1", "1", "f32:16", "--stall"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            self.assertTrue(wait_until(lambda: ctl_json(self.d.socket, "status")["jobs"]
                                       == {"forming": 0, "running": 1}, 10))
        finally:
            w.kill()
            w.communicate(timeout=10)
        self.assertTrue(wait_until(lambda: ctl_json(self.d.socket, "status")["jobs"]
                                   == {"forming": 0, "running": 0}, 10))
        rc, text, _ = ctl(self.d.socket, "metrics")
        self.assertEqual(metric(text, "bytecomp_job_aborts_total", {"reason": "peer lost"}), 1)
        self.assertEqual(metric(text, "bytecomp_jobs_started_total"), 1)
        self.assertEqual(metric(text, "bytecomp_jobs_finished_total"), 0)

    def test_reload_applies_changes_and_keeps_the_running_job(self):
        job = Job(self.d, "keeps")
        try:
            for _ in range(3):
                job.step()
            # Uncompressed from now on, a drop-in changes the log levels and
            # metrics directory, and one change needs a restart.
            new_metrics = os.path.join(self.d.dir, "metrics2")
            os.makedirs(new_metrics)
            os.makedirs(self.d.config + ".d")
            with open(os.path.join(self.d.config + ".d", "50-metrics.yaml"), "w") as f:
                f.write(f"version: 1\nmetrics:\n  textfile_dir: {new_metrics}\n"
                        "logging:\n  levels: info,daemon=debug\n")
            self.d.write_config(strategy=False, threads=3)
            rc, out, err = ctl(self.d.socket, "reload")
            self.assertEqual(rc, 0, err)
            self.assertIn("needs a restart, not applied: scheduler.threads", out)
            self.assertIn("scheduler.threads changed, which needs a restart", self.d.output())
            st = ctl_json(self.d.socket, "status")
            self.assertEqual(st["config_sources"],
                             [self.d.config, os.path.join(self.d.config + ".d",
                                                          "50-metrics.yaml")])
            self.assertEqual(st["metrics_file"], os.path.join(new_metrics, "bytecompd.prom"))
            self.assertTrue(wait_until(
                lambda: os.path.exists(os.path.join(new_metrics, "bytecompd.prom")), 10))
            before = ctl_json(self.d.socket, "jobs")["jobs"][0]["compress"]["input_bytes"]
            for _ in range(3):
                job.step()
            j = ctl_json(self.d.socket, "jobs")["jobs"][0]
            self.assertEqual(j["pushpulls"], 12)
            self.assertEqual(j["strategy"]["mode"], "none")
            self.assertGreaterEqual(j["strategy"]["switch_iteration"], 3)
            # Nothing compressed after the switch.
            self.assertEqual(j["compress"]["input_bytes"], before)

            # A broken file is refused with its location; the job goes on.
            with open(self.d.config, "a") as f:
                f.write("scheduler:\n  threads: 1\n")  # a duplicate key
            with open(os.path.join(self.d.config + ".d", "60-bad.yaml"), "w") as f:
                f.write("version: 1\ncontrol:\n  setup_timeout_ms: 5\n")
            rc, out, err = ctl(self.d.socket, "reload")
            self.assertEqual(rc, 1)
            self.assertIn("not reloaded", err)
            self.assertIn("60-bad.yaml:3", err)
            job.step()
            # SIGHUP does the same as bytecompctl reload.
            os.remove(os.path.join(self.d.config + ".d", "60-bad.yaml"))
            self.d.write_config(strategy=True, threads=1)
            self.d.proc.send_signal(signal.SIGHUP)
            self.assertTrue(wait_until(lambda: ctl_json(self.d.socket, "jobs")["jobs"][0]
                                       ["strategy"]["mode"] == "daemon", 10))
            for _ in range(2):
                job.step()
            rc, text, _ = ctl(self.d.socket, "metrics")
            self.assertEqual(metric(text, "bytecomp_reloads_total", {"result": "ok"}), 2)
            self.assertEqual(metric(text, "bytecomp_reloads_total", {"result": "failed"}), 1)
            self.assertEqual(metric(text, "bytecomp_job_pushpulls_total",
                                    {"bytecomp_job": "keeps"}), 2 * job.iteration)
        finally:
            self.assertIsNone(job.close())

    def test_drain_refuses_new_jobs_and_waits_for_running_ones(self):
        job = Job(self.d, "running")
        job.step()
        st = ctl_json(self.d.socket, "drain")
        self.assertTrue(st["draining"])
        with self.assertRaises(_lib.BytecompError) as e:
            Job(self.d, "latecomer")
        self.assertIn("draining", str(e.exception))
        job.step()  # the admitted job goes on
        rc, _, err = ctl(self.d.socket, "drain", "--wait", "0.3")
        self.assertEqual(rc, 1)
        self.assertIn("still on the daemon", err)

        def finish():
            time.sleep(0.5)
            job.step()
            job.close()
        t = threading.Thread(target=finish)
        t.start()
        rc, out, err = ctl(self.d.socket, "drain", "--wait", "20")
        t.join()
        self.assertEqual(rc, 0, err)
        self.assertIn("draining", out)
        self.assertFalse(ctl_json(self.d.socket, "drain", "--off")["draining"])
        Job(self.d, "after").close()

    def test_gpu_profile_report_of_every_auto_candidate_is_taken(self):
        # What bytecomp.torch sends for docs/auto.md's example strategy
        # (efsignsgd, topk:0.01 and fp16, four sizes, timings printed with
        # all their digits) in a job of a long id: the request is parsed
        # (the job is not auto: ignored), not refused for its size.
        from bytecomp import ctl as _ctl
        from bytecomp import gpu_profile as _gp
        specs = _gp.candidates({"compressors": ["efsignsgd", "topk:0.01"]})
        self.assertEqual(len(specs), 3)
        measured = {s: [{"n": n, "compress_us": 1.0 / 3 + i + n / 7e5,
                         "decompress_us": 2.0 / 3 + i + n / 9e5, "bytes": n // 8 + 12}
                        for n in _gp.SIZES] for i, s in enumerate(specs)}
        report = _gp.report_text("measured on NVIDIA H200 (the test's figures)", measured)
        job = "j" * 100
        j = Job(self.d, job, tensors=(("small", SMALL),))
        try:
            answer = _ctl.request(self.d.socket, "gpu_profile", "%s\n%s" % (job, report),
                                  timeout=10)
            self.assertEqual(answer.strip(), "ignored: job '%s' is not auto" % job)
            # A malformed report is refused naming what is wrong.
            with self.assertRaises(_ctl.CtlError) as e:
                _ctl.request(self.d.socket, "gpu_profile",
                             "%s\n%s" % (job, report.replace("compress_us", "compress_ms", 1)),
                             timeout=10)
            self.assertIn("gpu_profile: report:", str(e.exception))  # a line:column follows
            self.assertIn("missing required key 'compressors[0].points[0].compress_us'",
                          str(e.exception))
            # One too large for a request is refused by name, not sent.
            with self.assertRaises(_ctl.CtlError) as e:
                _ctl.request(self.d.socket, "gpu_profile", "%s\n%s" % (job, report * 60),
                             timeout=10)
            self.assertIn("more than the 32768 a request carries", str(e.exception))
        finally:
            j.close()

    @unittest.skipUnless(os.geteuid() == 0, "needs root to run bytecompctl as another user")
    def test_permission_denied(self):
        os.chmod(self.d.dir, 0o755)
        # Anyone may look (at their own jobs), only root or the daemon's user
        # may change the daemon.
        rc, out, err = ctl(self.d.socket, "--json", "status", user="nobody")
        self.assertEqual(rc, 0, err)
        self.assertEqual(json.loads(out)["job_ids"], [])
        for cmd in (["reload"], ["drain"], ["drain", "--off"]):
            rc, _, err = ctl(self.d.socket, *cmd, user="nobody")
            self.assertEqual(rc, 4, err)
            self.assertIn("permission denied", err)
        os.chmod(self.d.socket, 0o600)
        rc, _, err = ctl(self.d.socket, "status", user="nobody")
        self.assertEqual(rc, 4, err)
        self.assertIn("permission denied connecting to " + self.d.socket, err)
        self.assertFalse(ctl_json(self.d.socket, "status")["draining"])


class TwoNodes(unittest.TestCase):
    """bytecompctl on each node's daemon while a two-node job runs (daemons
    and server started by bytecomp-run)."""

    def test_jobs_and_status_on_both_nodes(self):
        iterations = 6
        run_id = "ctl" + uuid.uuid4().hex[:8]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.join(SOURCE, "client", "python")
        env["BYTECOMP_LOG"] = "warn"
        r = subprocess.run(["/usr/bin/python3", os.path.join(SOURCE, "scripts", "bytecomp-run"),
                            "--nodes", "2", "--nproc-per-node", "1", "--job-id", run_id,
                            "--timeout-ms", "20000", "--time-limit", "120",
                            os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "ctl_worker.py"), str(iterations)],
                           capture_output=True, text=True, env=env, timeout=180)
        out = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, out)
        self.assertEqual(out.count("DONE"), 2, out)
        seen = {}
        for line in out.splitlines():
            m = re.search(r"CTL (\d) (\{.*\})$", line)
            if m:
                seen[int(m.group(1))] = json.loads(m.group(2))
        self.assertEqual(sorted(seen), [0, 1], out)
        for node, a in seen.items():
            st = a["status"]
            self.assertTrue(st["multi_node"])
            self.assertEqual(st["jobs"]["running"], len(st["job_ids"]))
            ours = [j for j in a["jobs"]["jobs"] if j["id"].startswith(run_id)]
            self.assertTrue(ours, a)
            for j in ours:
                self.assertEqual((j["state"], j["num_nodes"], j["node_rank"]),
                                 ("running", 2, node))
                self.assertEqual(len(j["nodes"]), 2)
                # Multi-node compression is counted by the engine's paths
                # (exact counts: ServerAndEngineMetrics).
                self.assertLessEqual(j["compress"]["output_bytes"], j["compress"]["input_bytes"])
            # The allreduce job finished `iterations` rounds of its tensor(s)
            # (and bytecomp.torch's own set-up rounds).
            self.assertGreaterEqual(max(j["pushpulls"] for j in ours), iterations)
            self.assertGreaterEqual(max(j["iteration"] for j in ours), iterations - 1)


class ServersWithoutCluster(unittest.TestCase):
    def test_single_node_daemon_has_no_servers(self):
        d = Daemon()
        try:
            rc, _, err = ctl(d.socket, "servers")
            self.assertEqual(rc, 1)
            self.assertIn("no inter-node configuration (internode.cluster_file)", err)
        finally:
            d.stop()


class ServerAndEngineMetrics(unittest.TestCase):
    """A two-node job through a real bytecomp-server (the PS path): the
    server's textfile counts exactly the rounds, pushes and answers the job
    made; each daemon's engine metrics and trace cover the inter-node phases.
    The compressed variants (big.w in fp16, the daemons' strategy; through
    the server or allgathered between the daemons) check the daemons'
    compression counts against the bytes the server received."""

    def setUp(self):
        self.compressed = "compressed" in self._testMethodName
        self.peer = "peer" in self._testMethodName
        self.dir = tempfile.mkdtemp(prefix="bc-ops-ps-")
        self.metrics_dir = os.path.join(self.dir, "server-metrics")
        os.makedirs(self.metrics_dir)
        tp = "transport: {backend: zmq, heartbeat_interval_ms: 100, peer_timeout_ms: 3000}\n"

        def cluster(address):
            return ("version: 1\ncluster:\n  coordinator: 0\n  partition_bytes: %d\n"
                    "  servers:\n    - {id: 0, address: \"%s\"}\n"
                    "  daemons:\n    - {id: 100}\n    - {id: 101}\n"
                    "  timeouts: {admission_ms: 10000, request_ms: 10000, setup_ms: 5000}\n%s"
                    % (PARTITION, address, tp))
        with open(os.path.join(self.dir, "server-cluster.yaml"), "w") as f:
            f.write(cluster("tcp://127.0.0.1:0"))
        self.server_config = os.path.join(self.dir, "server.yaml")
        with open(self.server_config, "w") as f:
            f.write("version: 1\nserver: {node_id: 0, cluster_file: server-cluster.yaml, "
                    "engine_threads: 1}\n" + tp +
                    "metrics: {textfile_dir: %s, interval_ms: 500}\n" % self.metrics_dir)
        ready = os.path.join(self.dir, "ready")
        self.server_log = open(os.path.join(self.dir, "server.log"), "wb")
        self.server = subprocess.Popen([SERVER, "--config", self.server_config,
                                        "--ready-file", ready],
                                       stdout=self.server_log, stderr=subprocess.STDOUT)
        self.daemons = []
        self.assertTrue(wait_until(lambda: os.path.exists(ready) or
                                   self.server.poll() is not None, 15))
        self.assertIsNone(self.server.poll())
        with open(ready) as f:
            address = f.read().strip()
        cluster_file = os.path.join(self.dir, "cluster.yaml")
        with open(cluster_file, "w") as f:
            f.write(cluster(address))
        for n in range(2):
            self.daemons.append(Daemon(
                extra="internode:\n  cluster_file: %s\n  node_id: %d\n  nodes: [100, 101]\n%s"
                      % (cluster_file, 100 + n,
                         "  peer_listen: tcp://127.0.0.1:0\n" if self.peer else ""),
                strategy=self.compressed,
                # fp16 pushes to the servers (the dense sum of decompressed
                # pushes, answered in fp16), or fp16 between the daemons.
                strategy_text=STRATEGY.replace(
                    "inter: allreduce",
                    "inter: allgather" if self.peer else "inter: alltoall_allgather")))

    def tearDown(self):
        for d in self.daemons:
            d.stop()
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(5)
        self.server_log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def server_metrics(self):
        path = os.path.join(self.metrics_dir, "bytecomp-server-0.prom")
        if not os.path.exists(path):
            return ""
        with open(path) as f:
            return f.read()

    def test_counts_match_the_job(self):
        self.run_job()

    def test_counts_match_the_compressed_job(self):
        self.run_job()

    def test_counts_match_the_compressed_peer_job(self):
        self.run_job()

    def run_job(self):
        jobs = [None, None]
        errors = []

        def join(n):
            try:
                jobs[n] = Job(self.daemons[n], "mn", node_rank=n, num_nodes=2)
            except Exception as e:  # reported below
                errors.append(e)
        ts = [threading.Thread(target=join, args=(n,)) for n in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        self.assertFalse(errors)

        def step(n, it):
            j = jobs[n]
            for b in j.bufs:
                for i in range(0, len(b), 97):
                    b[i] = float((i + it + n) % 512)
            hs = [j.c.push_pull(t, it) for t in j.ids]
            for h in hs:
                if not j.c.wait_once(h, 20000):
                    errors.append(f"node {n} iteration {it} did not complete")
                    return
            for b in j.bufs:
                for i in range(0, len(b), 97):
                    want = float((i + it) % 512 + (i + it + 1) % 512)
                    if b[i] != want:
                        errors.append(f"node {n} iteration {it} element {i}: {b[i]} != {want}")
                        return
        k = 4
        try:
            for it in range(k):
                ts = [threading.Thread(target=step, args=(n, it)) for n in range(2)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join(60)
                self.assertFalse(errors)
            rounds = k * sum(PARTS.values())
            # Peer allgather (big.w): only small goes through the server.
            server_rounds = k * PARTS["small"] if self.peer else rounds
            # Server: one round per partition and iteration, one push and one
            # answer per node and round, fp32 bytes as pushed.
            self.assertTrue(wait_until(lambda: metric(self.server_metrics(),
                                                      "bytecomp_server_rounds_total") == server_rounds,
                                       10), self.server_metrics())
            text = self.server_metrics()
            check_exposition_format(self, text)
            self.assertEqual(metric(text, "bytecomp_server_jobs"), 1)
            self.assertEqual(metric(text, "bytecomp_server_pushes_total"), 2 * server_rounds)
            self.assertEqual(metric(text, "bytecomp_server_answers_total"), 2 * server_rounds)
            js = [ctl_json(d.socket, "jobs")["jobs"][0]["compress"] for d in self.daemons]
            if not self.compressed:
                self.assertEqual(metric(text, "bytecomp_server_push_bytes_total"),
                                 2 * k * 4 * (BIG + SMALL))
                self.assertEqual(metric(text, "bytecomp_server_answer_bytes_total"),
                                 2 * k * 4 * (BIG + SMALL))
                self.assertEqual(js, [{"input_bytes": 0, "output_bytes": 0}] * 2)
            else:
                # Each node compressed big.w every iteration (fp16: 2 bytes an
                # element and a header per partition); the server received
                # exactly those bytes plus small's raw fp32.
                for c in js:
                    self.assertEqual(c["input_bytes"], k * 4 * BIG)
                    self.assertGreaterEqual(c["output_bytes"], k * 2 * BIG)
                    self.assertLess(c["output_bytes"], k * 2 * BIG + k * 4 * 256)
                self.assertEqual(metric(text, "bytecomp_server_push_bytes_total"),
                                 (0 if self.peer else sum(c["output_bytes"] for c in js))
                                 + 2 * k * 4 * SMALL)
                for d, c in zip(self.daemons, js):
                    dt = ctl(d.socket, "metrics")[1]
                    self.assertAlmostEqual(
                        metric(dt, "bytecomp_job_compression_ratio", {"bytecomp_job": "mn"}),
                        c["input_bytes"] / c["output_bytes"], places=5)
            self.assertEqual(metric(text, "bytecomp_server_round_seconds_count"), server_rounds)
            buckets = histogram(text, "bytecomp_server_round_seconds", {})
            self.assertEqual(buckets[-1], (float("inf"), server_rounds))
            self.assertGreater(metric(text, "bytecomp_server_round_seconds_sum"), 0)
            self.assertEqual(metric(text, "bytecomp_server_info",
                                    {"server": "0", "coordinator": "true"}), 1)
            self.assertEqual(metric(text, "bytecomp_server_refused_total", {"kind": "request"}), 0)

            # The same counters through a daemon (the cluster transport).
            for d in self.daemons:
                sv = ctl_json(d.socket, "servers")["servers"]
                self.assertEqual(len(sv), 1)
                self.assertEqual((sv[0]["id"], sv[0]["coordinator"], sv[0]["error"]),
                                 (0, True, None))
                self.assertEqual(metric(sv[0]["metrics"], "bytecomp_server_rounds_total"),
                                 server_rounds)
                self.assertEqual(metric(sv[0]["metrics"], "bytecomp_server_pushes_total"),
                                 2 * server_rounds)
            rc, out, err = ctl(self.daemons[0].socket, "servers")
            self.assertEqual(rc, 0, err)
            self.assertRegex(out, r"0\s+tcp://127\.0\.0\.1:\d+\s+coordinator\s+up\s+1\s+%d\s"
                             % server_rounds)
            rc, out, err = ctl(self.daemons[1].socket, "servers", "--metrics")
            self.assertEqual(rc, 0, err)
            self.assertIn("# server 0 tcp://127.0.0.1:", out)
            self.assertEqual(metric(out, "bytecomp_server_rounds_total"), server_rounds)

            for n, d in enumerate(self.daemons):
                lab = {"bytecomp_job": "mn"}
                # Bytes in flight return to 0 once the servers acknowledged.
                self.assertTrue(wait_until(lambda: metric(ctl(d.socket, "metrics")[1],
                                                          "bytecomp_job_inflight_bytes", lab) == 0,
                                           10))
                rc, dt, _ = ctl(d.socket, "metrics")
                self.assertEqual(metric(dt, "bytecomp_job_rounds_total", lab), rounds)
                check_histograms(self, dt, lab, rounds)
                # The inter-node wait is real time on this path.
                self.assertGreater(
                    metric(dt, "bytecomp_job_phase_seconds_sum", dict(lab, phase="wire")), 0)
                out = os.path.join(self.dir, "trace%d.json" % n)
                rc, _, err = ctl(d.socket, "trace", "--job", "mn", "--iterations", "2", "-o", out)
                self.assertEqual(rc, 0, err)
                with open(out) as f:
                    doc = json.load(f)
                self.assertEqual(doc["otherData"]["iterations"], [k - 2, k - 1])
                wires = [e for e in doc["traceEvents"]
                         if e["ph"] == "X" and e["args"].get("phase") == "wire"]
                # (A wire span whose answer arrived before kSent was stamped
                # has no length and no slice.)
                self.assertEqual({e["args"]["tensor"] for e in wires}, set(PARTS))
                tracks = {e["args"]["name"] for e in doc["traceEvents"]
                          if e["ph"] == "M" and e["name"] == "thread_name"}
                self.assertIn("inter-node link", tracks)
        finally:
            for j in jobs:
                if j:
                    j.close()
        # The final write at shutdown keeps the totals; the job is gone.
        self.server.send_signal(signal.SIGTERM)
        self.assertEqual(self.server.wait(15), 0)
        text = self.server_metrics()
        self.assertEqual(metric(text, "bytecomp_server_rounds_total"), server_rounds)
        self.assertEqual(sorted(os.listdir(self.metrics_dir)), ["bytecomp-server-0.prom"])
        # A server that is gone: named, within the per-server bound, exit 1.
        start = time.monotonic()
        rc, out, err = ctl(self.daemons[0].socket, "servers")
        self.assertEqual(rc, 1, out + err)
        self.assertRegex(out, r"0\s+tcp://\S+\s+coordinator\s+unreachable")
        self.assertIn("server 0: metrics of server 0:", out)
        self.assertLess(time.monotonic() - start, 8)
        # The daemon still answers everything else.
        self.assertEqual(ctl_json(self.daemons[0].socket, "status")["jobs"]["running"], 0)

    def test_bad_metrics_section_is_refused(self):
        with open(self.server_config) as f:
            text = f.read()
        with open(self.server_config, "w") as f:
            f.write(re.sub(r"interval_ms: 500", "interval_ms: 5", text))
        r = subprocess.run([SERVER, "--config", self.server_config], capture_output=True,
                           text=True, timeout=30)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("metrics.interval_ms", r.stderr)
        self.assertIn("500..3600000", r.stderr)


class Watchdog(unittest.TestCase):
    """READY=1 and repeated WATCHDOG=1 on a NOTIFY_SOCKET the test owns."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="bc-notify-")
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.env = {"NOTIFY_SOCKET": self.path, "WATCHDOG_USEC": "400000"}

    def tearDown(self):
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def messages(self, until, timeout):
        got = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until(got):
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                got.append(self.sock.recv(4096).decode())
            except socket.timeout:
                break
        return got

    def check_pings(self, proc):
        got = self.messages(lambda g: "READY=1" in g, 15)
        self.assertIn("READY=1", got)
        start = time.monotonic()
        pings = self.messages(lambda g: g.count("WATCHDOG=1") >= 5, 10)
        elapsed = time.monotonic() - start
        self.assertGreaterEqual(pings.count("WATCHDOG=1"), 5, pings)
        # Every 200 ms (half of WATCHDOG_USEC): five take about a second.
        self.assertLess(elapsed, 5)
        proc.send_signal(signal.SIGHUP)
        got = self.messages(lambda g: "READY=1" in g, 10)
        self.assertIn("RELOADING=1", got)
        self.assertIn("READY=1", got)
        self.assertLess(got.index("RELOADING=1"), got.index("READY=1"))
        proc.send_signal(signal.SIGTERM)
        got = self.messages(lambda g: "STOPPING=1" in g, 10)
        self.assertIn("STOPPING=1", got)
        self.assertEqual(proc.wait(10), 0)

    def test_daemon(self):
        d = Daemon(env=self.env, strategy=False)
        try:
            self.check_pings(d.proc)
        finally:
            d.stop()

    def test_server(self):
        with open(os.path.join(self.dir, "cluster.yaml"), "w") as f:
            f.write("version: 1\ncluster:\n  coordinator: 0\n  servers:\n"
                    "    - {id: 0, address: \"tcp://127.0.0.1:0\"}\n  daemons: []\n")
        with open(os.path.join(self.dir, "server.yaml"), "w") as f:
            f.write("version: 1\nserver:\n  node_id: 0\n  cluster_file: cluster.yaml\n")
        e = dict(os.environ)
        e.update(self.env)
        with open(os.path.join(self.dir, "server.log"), "wb") as log:
            p = subprocess.Popen([SERVER, "--config", os.path.join(self.dir, "server.yaml")],
                                 stdout=log, stderr=subprocess.STDOUT, env=e)
            try:
                self.check_pings(p)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait(5)


if __name__ == "__main__":
    unittest.main(verbosity=2)
