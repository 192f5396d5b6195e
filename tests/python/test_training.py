"""Training through bytecomp-run with real daemons, a parameter server and
processes, on 2 emulated nodes x 2 workers:
- uncompressed: the 4 workers end with the same parameters as one process
  training on the union of their batches (float tolerance);
- the digits demo learns (uncompressed), and with the demo's compression
  strategy (error feedback) ends within 1 accuracy point of it."""

import json
import os
import shutil
import sys
import tempfile
import unittest

import torch

import helpers

sys.path.insert(0, os.path.join(helpers.TESTS_DIR, "workers"))
from equiv_model import Net, batches  # noqa: E402

DIGITS = os.path.join(helpers.PYTHON_ROOT, "bytecomp", "examples", "digits.py")
STRATEGY = os.path.join(helpers.SOURCE_ROOT, "configs", "demo-strategy.yaml")


def cluster_shape():
    """The issue's cluster: 2 emulated nodes x 2 workers (+ 1 parameter server)."""
    return 2, 2


class Training(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="bc-train-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_workers_match_one_process_on_the_union_of_batches(self):
        nodes, per = cluster_shape()
        steps, batch = 25, 8
        rc, out, pid = helpers.launch(
            ["--nodes", str(nodes), "--nproc-per-node", str(per), "--time-limit", "90",
             os.path.join(helpers.TESTS_DIR, "workers", "equiv_worker.py"),
             "--steps", str(steps), "--batch", str(batch), "--out", self.tmp], timeout=120)
        self.assertEqual(rc, 0, out)
        n = nodes * per
        got = [torch.load(os.path.join(self.tmp, "rank%d.pt" % r)) for r in range(n)]
        for r in range(1, n):
            for k in got[0]:
                self.assertTrue(torch.equal(got[0][k], got[r][k]), "rank %d differs in %s" % (r, k))
        torch.manual_seed(100)            # rank 0's initial weights
        ref = Net()
        init = {k: v.clone() for k, v in ref.state_dict().items()}
        opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        for x, y in batches(steps, batch * n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ref(x), y).backward()
            opt.step()
        for k, v in ref.state_dict().items():
            self.assertFalse(torch.equal(v, init[k]) and k != "unused", "%s did not train" % k)
            self.assertTrue(torch.allclose(got[0][k], v, rtol=1e-4, atol=1e-5),
                            "%s: max diff %g" % (k, (got[0][k] - v).abs().max()))
        self.assertTrue(torch.equal(got[0]["unused"], init["unused"]))

    def digits(self, nodes, per, strategy, name):
        out_json = os.path.join(self.tmp, name + ".json")
        args = ["--nodes", str(nodes), "--nproc-per-node", str(per), "--time-limit", "150",
                DIGITS, "--epochs", "10", "--out", out_json]
        if strategy:
            args = ["--strategy", strategy] + args
        rc, out, _ = helpers.launch(args, timeout=180)
        self.assertEqual(rc, 0, out)
        with open(out_json) as f:
            return json.load(f), out

    plain = None  # the uncompressed digits run, shared by the two tests below

    def plain_run(self):
        if Training.plain is None:
            nodes, per = cluster_shape()
            Training.plain = self.digits(nodes, per, None, "plain")
        return Training.plain

    def test_digits_learns_uncompressed(self):
        plain, out = self.plain_run()
        self.assertGreater(plain["final_accuracy"], 90.0, out)
        self.assertLess(plain["final_loss"], plain["epochs"][0]["loss"] / 4, out)

    def test_compressed_with_error_feedback_matches_uncompressed_accuracy(self):
        nodes, per = cluster_shape()
        plain, _ = self.plain_run()
        comp, out = self.digits(nodes, per, STRATEGY, "comp")
        self.assertLessEqual(abs(comp["final_accuracy"] - plain["final_accuracy"]), 1.0,
                             "compressed %.2f%% vs uncompressed %.2f%%\n%s" %
                             (comp["final_accuracy"], plain["final_accuracy"], out))

if __name__ == "__main__":
    unittest.main()
