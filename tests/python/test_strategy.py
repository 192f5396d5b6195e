"""The shipped demo strategy, held to the planner's own loader and the CPU
runtime's rules (strategy_check wraps planner/strategy.h)."""

import os
import subprocess
import unittest

import helpers
from bytecomp import strategy as bstrategy
from bytecomp.examples.digits import MLP

CHECK = os.path.join(helpers.BUILD_ROOT, "tests", "python", "strategy_check")
DEMO = os.path.join(helpers.SOURCE_ROOT, "configs", "demo-strategy.yaml")


class DemoStrategy(unittest.TestCase):
    def resolve(self, path, tensors):
        args = [CHECK, path] + ["%s:%d" % (n, b) for n, b in tensors]
        return subprocess.run(args, capture_output=True, text=True, timeout=30)

    def test_demo_model_resolves_as_documented(self):
        tensors = [(n, p.numel() * 4) for n, p in MLP().named_parameters()]
        # bytecomp.torch's control job (float64) runs under the same daemons.
        tensors.append(("bytecomp.control", 8 << 18))
        r = self.resolve(DEMO, tensors)
        self.assertEqual(r.returncode, 0, r.stderr)
        got = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
        self.assertEqual(set(got), {n for n, _ in tensors})
        for name in ("fc1.weight", "fc2.weight"):
            self.assertEqual(got[name][0], "compressed", r.stdout)
            self.assertEqual(got[name][1], "ps", r.stdout)
            self.assertIn("topk{ratio=0.05} ef", " ".join(got[name]))
        for name in ("fc1.bias", "fc2.bias", "fc3.bias", "fc3.weight", "bytecomp.control"):
            self.assertEqual(got[name][0], "uncompressed", r.stdout)
        self.assertTrue(bstrategy.load(DEMO).compresses_anything())

    def test_loader_rejects_bad_files_with_location(self):
        bad = os.path.join(os.path.dirname(CHECK), "bad-strategy.yaml")
        with open(bad, "w") as f:
            f.write("version: 1\ndefault:\n  compressor: zip\n")
        r = self.resolve(bad, [("w", 4)])
        self.assertEqual(r.returncode, 1)
        self.assertIn("bad-strategy.yaml:3", r.stderr)
        self.assertIn("compressor", r.stderr)


if __name__ == "__main__":
    unittest.main()
