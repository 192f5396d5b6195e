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


def wait_until(pred, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


class Daemon:
    def __init__(self, extra="", env=None, strategy=True):
        self.dir = tempfile.mkdtemp(prefix="bc-ops-")
        self.socket = os.path.join(self.dir, "ctl.sock")
        self.instance = "ops%dx%s" % (os.getpid(), uuid.uuid4().hex[:6])
        self.metrics_dir = os.path.join(self.dir, "metrics")
        os.makedirs(self.metrics_dir)
        self.strategy = os.path.join(self.dir, "strategy.yaml")
        with open(self.strategy, "w") as f:
            f.write(STRATEGY)
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
                    "metrics:\n  textfile_dir: %s\n  interval_ms: 500\n%s%s"
                    % (self.socket, self.instance, threads, self.metrics_dir,
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

    def __init__(self, daemon, job_id, tensors=(("big.w", BIG), ("small", SMALL))):
        self.c = _lib.Client(job_id, socket_path=daemon.socket)
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
            test.assertIn(name, types, f"sample before its TYPE: {line}")
            test.assertTrue(name.startswith("bytecomp_"), name)


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
                            ["drain"], ["drain", "--off"]):
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
                # Multi-node compression is the engine's (not counted here).
                self.assertIsNone(j["compress"])
            # The allreduce job finished `iterations` rounds of its tensor(s)
            # (and bytecomp.torch's own set-up rounds).
            self.assertGreaterEqual(max(j["pushpulls"] for j in ours), iterations)
            self.assertGreaterEqual(max(j["iteration"] for j in ours), iterations - 1)


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
