"""strategy="auto" on the emulated cluster (docs/auto.md): two network
namespaces, a bytecomp-server and a bytecompd each, training started per node
by torchrun. On a slow link the runtime picks a compressed strategy by itself;
on an unshaped one it stays uncompressed and trains exactly like DDP.
Skipped (with the reason) where network namespaces cannot be created."""

import json
import os
import shutil
import tempfile
import unittest

import helpers

from bytecomp import netns
from bytecomp.bench_cluster import strategy_yaml
from bytecomp.cluster import NamespacedCluster

_WHY = netns.check_permission()


@unittest.skipIf(_WHY, "network namespaces not permitted here: %s" % _WHY)
class AutoOnNamespaces(unittest.TestCase):
    def run_cluster(self, rate, systems, steps):
        out = tempfile.mkdtemp(prefix="bc-test-auto-")
        self.addCleanup(shutil.rmtree, out, True)
        strategies = os.path.join(out, "strategies")
        os.makedirs(strategies)
        with open(os.path.join(strategies, "bc_none.yaml"), "w") as f:
            f.write(strategy_yaml("bc_none"))
        c = NamespacedCluster(2, build_root=helpers.BUILD_ROOT, timeout_ms=60000)
        try:
            with c:
                if rate:
                    c.shape(rate)
                rc, lines = c.torchrun(
                    ["--model", "mlp", "--systems", systems, "--warmup", "1", "--steps",
                     str(steps), "--batch", "16", "--pool", "2", "--lr", "0.1",
                     "--auto-compressors", "efsignsgd",
                     "--strategy-dir", strategies, "--out", os.path.join(out, "r")], 400)
                self.assertEqual(rc, 0, "".join(lines[-80:]))
                ranks = [json.load(open(os.path.join(out, "r", "rank%d.json" % r)))
                         for r in range(2)]
        finally:
            c.stop()
        return sorted(ranks, key=lambda d: d["rank"])

    def test_slow_link_compresses(self):
        """10 Mbit/s: the warm-up is link-bound; the decision compresses the
        two large weight matrices (not the 10-element bias), is applied on
        both nodes, and the steps after the switch are several times faster
        than the profiled uncompressed ones."""
        ranks = self.run_cluster("10mbit", "bc_auto", 24)
        for d in ranks:
            r = d["systems"]["bc_auto"]
            self.assertNotIn("error", r, r)
        a = ranks[0]["systems"]["bc_auto"]["auto"]
        self.assertNotIn("error", a, a)
        self.assertIn("fc1.weight", a["compressed"], a)
        self.assertIn("fc2.weight", a["compressed"], a)
        self.assertNotIn("head.bias", a["compressed"], a)
        self.assertIn("switch_iteration", a, a)
        # Both nodes applied the same decision at the same iteration.
        b = ranks[1]["systems"]["bc_auto"]["auto"]
        self.assertEqual(sorted(a["compressed"]), sorted(b["compressed"]))
        self.assertEqual(a["switch_iteration"], b["switch_iteration"])
        steps = ranks[0]["systems"]["bc_auto"]["step_s"]
        after = sorted(steps[a["switch_iteration"] + 2:])
        self.assertGreaterEqual(len(after), 3, (a, steps))
        self.assertLess(after[len(after) // 2], a["profiled_s"] / 3, (a, steps))

    def test_unshaped_link_stays_uncompressed_and_exact(self):
        """No shaping: compression does not pay; nothing is compressed and
        the losses equal DDP's step for step (the same sums)."""
        ranks = self.run_cluster(None, "ddp_fp32,bc_auto", 16)
        a = ranks[0]["systems"]["bc_auto"]["auto"]
        self.assertNotIn("error", a, a)
        self.assertEqual(a["compressed"], [], a)
        for d in ranks:
            ddp, auto = d["systems"]["ddp_fp32"], d["systems"]["bc_auto"]
            self.assertNotIn("error", auto, auto)
            for x, y in zip(ddp["loss"], auto["loss"]):
                self.assertAlmostEqual(x, y, delta=1e-4 * abs(x))


if __name__ == "__main__":
    unittest.main()
