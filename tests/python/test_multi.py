"""bytecomp.torch across processes: broadcasts of parameters and optimizer
state, misuse that only shows between ranks, and the torchrun launch mode
(a daemon started by hand, as under systemd, and torch.distributed.run)."""

import os
import re
import subprocess
import tempfile
import shutil
import unittest
import uuid

import torch

import helpers

MULTI = os.path.join(helpers.TESTS_DIR, "workers", "multi_worker.py")


class Multi(unittest.TestCase):
    def run_mode(self, mode, nproc=3, nodes=1):
        run_id = "mm" + uuid.uuid4().hex[:8]
        rc, out, pid = helpers.launch(["--nodes", str(nodes), "--nproc-per-node", str(nproc),
                                       "--job-id", run_id,
                                       "--timeout-ms", "5000", "--start-timeout", "5",
                                       "--time-limit", "60", MULTI, mode], timeout=90)
        self.assertEqual(helpers.run_leftovers(run_id, pid), ([], []), out)
        return rc, out

    def test_broadcasts_make_ranks_equal(self):
        rc, out = self.run_mode("state")
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("OK state"), 3, out)

    def test_broadcasts_across_nodes(self):
        """2 nodes x 2: the control job goes through the parameter server in
        float32; broadcasts still arrive bit for bit (int64 above 2**53, NaN
        payloads, bool)."""
        rc, out = self.run_mode("state", nproc=2, nodes=2)
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("OK state"), 4, out)

    def test_large_broadcasts_across_nodes_from_the_last_rank(self):
        """2 nodes x 2: ~21 MB in 4 MiB chunks from rank 3 (node 1) down the
        chain of daemons (bytecomp-run gives them peer endpoints), twice, with
        barriers between; a large object."""
        rc, out = self.run_mode("big", nproc=2, nodes=2)
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("OK big"), 4, out)

    def test_broadcast_of_different_tensors_raises_everywhere(self):
        rc, out = self.run_mode("mismatch", nproc=2, nodes=2)
        self.assertEqual(rc, 3, out)
        msgs = re.findall(r"RAISED MismatchError: (.*)", out)
        self.assertEqual(len(msgs), 4, out)
        for m in msgs:
            self.assertIn("broadcast_parameters: the processes passed different tensors", m)

    def test_different_models_do_not_start(self):
        rc, out = self.run_mode("declare", nproc=2)
        self.assertNotEqual(rc, 0, out)
        self.assertNotIn("OK declare", out)
        self.assertGreaterEqual(len(re.findall(r"RAISED \w+Error: .*", out)), 1, out)
        self.assertRegex(out, r"RAISED \w+: .*(declar|differ)")


class Torchrun(unittest.TestCase):
    """The cluster mode of docs/torch.md: bytecompd runs as a service (here
    started by the test), torchrun starts the training processes."""

    def test_torchrun_with_a_running_daemon(self):
        d = helpers.Daemon()
        out_dir = tempfile.mkdtemp(prefix="bc-torchrun-")
        try:
            env = helpers.child_env(BYTECOMP_SOCKET=d.socket)
            env.pop("BYTECOMP_JOB_ID", None)
            # --redirects 1 --tee 1: Debian's torch 1.13 torchrun fails on
            # Python 3.11 with its default "0" (Std.from_str), see docs/torch.md.
            p = subprocess.run(
                [helpers.PYTHON, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", "2", "--redirects", "1", "--tee", "1",
                 os.path.join(helpers.TESTS_DIR, "workers", "equiv_worker.py"),
                 "--steps", "5", "--batch", "4", "--out", out_dir],
                env=env, capture_output=True, text=True, timeout=120)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            a, b = (torch.load(os.path.join(out_dir, "rank%d.pt" % r)) for r in range(2))
            for k in a:
                self.assertTrue(torch.equal(a[k], b[k]), k)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
            self.assertEqual(d.stop(), [])


if __name__ == "__main__":
    unittest.main()
