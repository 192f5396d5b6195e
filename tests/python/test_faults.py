"""Faults under bytecomp-run with real processes: a training process killed
(2 emulated nodes + a parameter server), a stuck process, the daemon killed,
Ctrl-C and the launcher SIGKILLed (2 nodes). Each time the others must raise
within the bound, bytecomp-run must exit non-zero, and no process (servers
and daemons included) and no shared-memory segment may be left."""

import os
import re
import signal
import subprocess
import time
import unittest
import uuid

import helpers

WORKER = os.path.join(helpers.TESTS_DIR, "workers", "fault_worker.py")
TIMEOUT_MS = 6000


def raised(out):
    """[(class, seconds, message)] of the RAISED lines."""
    return [(m.group(1), float(m.group(2)), m.group(3))
            for m in re.finditer(r"^\[rank \d+\] RAISED (\S+) ([\d.]+) (.*)$", out, re.M)]


class Faults(unittest.TestCase):
    def assertNothingLeft(self, run_id, pid, out):
        pids, shm = helpers.run_leftovers(run_id, pid)
        self.assertEqual(pids, [], "processes left by bytecomp-run:\n" + out)
        self.assertEqual(shm, [], "segments left in /dev/shm:\n" + out)

    def launch_async(self, run_id, worker_args, nproc=4, nodes=1):
        args = ["--nodes", str(nodes), "--nproc-per-node", str(nproc), "--job-id", run_id,
                "--timeout-ms",
                str(TIMEOUT_MS), "--time-limit", "60", "--grace", "10", WORKER] + worker_args
        return subprocess.Popen([helpers.PYTHON, helpers.LAUNCHER] + args,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=helpers.child_env())

    def test_killed_worker_makes_the_others_raise(self):
        """2 nodes x 2 workers + 1 server; rank 2 (node 1, local rank 0) dies.
        Its node peer (rank 3) is told by its daemon at once; node 0's ranks
        wait for node 1's part of the sum, which never comes: they raise when
        the bound runs out (their own BYTECOMP_TIMEOUT_MS, or the servers'
        request deadline bytecomp-run sets to the same value, whichever
        fires first). The daemons do not yet tell the other nodes that a
        node's job ended (docs/torch.md)."""
        run_id = "fk" + uuid.uuid4().hex[:8]
        rc, out, pid = helpers.launch(
            ["--nodes", "2", "--nproc-per-node", "2", "--job-id", run_id, "--timeout-ms",
             str(TIMEOUT_MS), "--time-limit", "60", WORKER, "--steps", "400", "--die-rank", "2",
             "--die-step", "15"], timeout=90)
        self.assertEqual(rc, 128 + signal.SIGKILL, out)
        self.assertIn("rank 2 failed first (killed by SIGKILL)", out)
        by_rank = {int(m.group(1)): (m.group(2), float(m.group(3)), m.group(4)) for m in
                   re.finditer(r"^\[rank (\d+)\] RAISED (\S+) ([\d.]+) (.*)$", out, re.M)}
        self.assertEqual(sorted(by_rank), [0, 1, 3], out)
        cls, secs, msg = by_rank[3]
        self.assertEqual(cls, "JobAbortedError", out)
        self.assertIn("local rank 0 (pid", msg)
        self.assertIn("disconnected without closing", msg)
        self.assertLess(secs, 1.0, out)
        for r in (0, 1):
            cls, secs, msg = by_rank[r]
            self.assertIn(cls, ("JobAbortedError", "BytecompTimeout"), out)
            self.assertLess(secs, TIMEOUT_MS / 1000.0 + 1.5, out)
        self.assertNothingLeft(run_id, pid, out)

    def test_stuck_worker_makes_the_others_time_out(self):
        run_id = "fh" + uuid.uuid4().hex[:8]
        t0 = time.monotonic()
        rc, out, pid = helpers.launch(
            ["--nproc-per-node", "2", "--job-id", run_id, "--timeout-ms", "2000",
             "--time-limit", "60", "--grace", "3", WORKER, "--steps", "400",
             "--hang-rank", "1", "--die-step", "5"], timeout=90)
        self.assertEqual(rc, 3, out)   # rank 0's exit status: it raised first
        r = raised(out)
        self.assertEqual(len(r), 1, out)
        self.assertEqual(r[0][0], "BytecompTimeout", out)
        self.assertIn("BYTECOMP_TIMEOUT_MS=2000", r[0][2])
        self.assertLess(r[0][1], 2.0 + 1.5, out)
        self.assertIn("rank 1 still running", out)
        self.assertLess(time.monotonic() - t0, 40)
        self.assertNothingLeft(run_id, pid, out)

    def test_killed_daemon_makes_the_workers_raise(self):
        run_id = "fd" + uuid.uuid4().hex[:8]
        p = self.launch_async(run_id, ["--steps", "100000", "--sleep", "0.01"], nproc=2)
        try:
            def daemon_pids():
                out = []
                for q in helpers.processes_with_env("BYTECOMP_RUN_ID", run_id):
                    with open("/proc/%d/comm" % q) as f:
                        if f.read().strip() == "bytecompd":
                            out.append(q)
                return out
            # Wait until training runs (a few steps printed), then kill.
            lines = []
            while len([ln for ln in lines if b"STEP" in ln]) < 10:
                ln = p.stdout.readline()
                self.assertTrue(ln, b"".join(lines).decode())
                lines.append(ln)
            pids = daemon_pids()
            self.assertEqual(len(pids), 1)
            os.kill(pids[0], signal.SIGKILL)
            out, _ = p.communicate(timeout=60)
            out = b"".join(lines).decode() + out.decode()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertNotEqual(p.returncode, 0, out)
        r = raised(out)
        self.assertEqual(len(r), 2, out)
        for cls, secs, msg in r:
            self.assertIn(cls, ("DaemonUnavailableError", "JobAbortedError"), out)
            self.assertLess(secs, TIMEOUT_MS / 1000.0, out)
        self.assertNothingLeft(run_id, p.pid, out)

    def test_ctrl_c_stops_everything(self):
        run_id = "fc" + uuid.uuid4().hex[:8]
        p = self.launch_async(run_id, ["--steps", "100000", "--sleep", "0.01"], nproc=2, nodes=2)
        try:
            seen = 0
            while seen < 10:
                ln = p.stdout.readline()
                self.assertTrue(ln)
                seen += b"STEP" in ln
            p.send_signal(signal.SIGINT)
            out, _ = p.communicate(timeout=60)
            out = out.decode()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.assertEqual(p.returncode, 130, out)
        self.assertIn("SIGINT: cluster stopped", out)
        self.assertNothingLeft(run_id, p.pid, out)

    def test_killed_launcher_takes_its_cluster_along(self):
        run_id = "fl" + uuid.uuid4().hex[:8]
        p = self.launch_async(run_id, ["--steps", "100000", "--sleep", "0.01"], nproc=2, nodes=2)
        try:
            seen = 0
            while seen < 5:
                ln = p.stdout.readline()
                self.assertTrue(ln)
                seen += b"STEP" in ln
            p.kill()   # SIGKILL: no cleanup code runs in the launcher
            p.wait(10)
            self.assertTrue(helpers.wait_until(
                lambda: helpers.run_leftovers(run_id, p.pid) == ([], []), 15),
                "left behind: %s" % (helpers.run_leftovers(run_id, p.pid),))
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
            for q in helpers.processes_with_env("BYTECOMP_RUN_ID", run_id):
                os.kill(q, signal.SIGKILL)


if __name__ == "__main__":
    unittest.main()
