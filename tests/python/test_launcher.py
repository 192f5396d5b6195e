"""bytecomp-run itself: prefixes, environment, exit statuses, usage errors."""

import os
import re
import tempfile
import unittest
import uuid

import helpers


def sh(script):
    return ["/bin/sh", "-c", script]


class Launcher(unittest.TestCase):
    def test_environment_and_prefixes(self):
        run_id = "le" + uuid.uuid4().hex[:8]
        rc, out, pid = helpers.launch(
            ["--nproc-per-node", "3", "--job-id", run_id, "--time-limit", "30", "--"] +
            sh('echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK '
               '$BYTECOMP_JOB_ID $BYTECOMP_RUN_ID $BYTECOMP_SOCKET"'), timeout=60)
        self.assertEqual(rc, 0, out)
        lines = re.findall(r"^\[rank (\d)\] env (.*)$", out, re.M)
        self.assertEqual(sorted(r for r, _ in lines), ["0", "1", "2"], out)
        for r, rest in lines:
            rank, world, lrank, lworld, group, job, run, sock = rest.split()
            self.assertEqual((rank, world, lrank, lworld, group), (r, "3", r, "3", "0"))
            self.assertEqual((job, run), (run_id, run_id))
            self.assertTrue(sock.endswith("/node0/ctl.sock"), sock)
        self.assertEqual(helpers.run_leftovers(run_id, pid), ([], []))

    def test_exit_status_of_the_first_failure(self):
        run_id = "lx" + uuid.uuid4().hex[:8]
        rc, out, pid = helpers.launch(
            ["--nproc-per-node", "2", "--job-id", run_id, "--grace", "20", "--time-limit", "30",
             "--"] + sh('if [ "$RANK" = 1 ]; then exit 5; fi; sleep 0.5; exit 0'), timeout=60)
        self.assertEqual(rc, 5, out)
        self.assertIn("rank 1 failed first (exit code 5)", out)
        self.assertEqual(helpers.run_leftovers(run_id, pid), ([], []))

    def test_time_limit(self):
        run_id = "lt" + uuid.uuid4().hex[:8]
        rc, out, pid = helpers.launch(
            ["--nproc-per-node", "2", "--job-id", run_id, "--time-limit", "1", "--"] +
            sh("sleep 60"), timeout=40)
        self.assertEqual(rc, 124, out)
        self.assertIn("time limit of 1 s reached", out)
        self.assertEqual(helpers.run_leftovers(run_id, pid), ([], []))

    def test_usage_errors(self):
        rc, out, _ = helpers.launch([], timeout=30)
        self.assertEqual(rc, 2)
        self.assertIn("no training command given", out)
        rc, out, _ = helpers.launch(["--strategy", "/nonexistent.yaml", "x.py"], timeout=30)
        self.assertEqual(rc, 2)
        self.assertIn("--strategy /nonexistent.yaml: no such file", out)
        rc, out, _ = helpers.launch(["--bytecompd", "/nonexistent/bytecompd", "x.py"],
                                    timeout=30)
        self.assertEqual(rc, 1, out)
        self.assertIn("error: cannot start bytecompd /nonexistent/bytecompd: no such executable",
                      out)
        rc, out, _ = helpers.launch(["--", "no-such-program-here"], timeout=30)
        self.assertEqual(rc, 1, out)
        self.assertIn("'no-such-program-here' is not an executable file or a program on PATH",
                      out)

    def test_strategy_compressing_the_control_tensor_is_explained(self):
        src = os.path.join(helpers.SOURCE_ROOT, "configs", "demo-strategy.yaml")
        with open(src) as f:
            text = f.read().replace('  - match: "bytecomp.*"\n    option: {compressor: none}\n',
                                    "")
        self.assertNotIn("match: \"bytecomp.*\"", text)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "no-control-rule.yaml")
            with open(path, "w") as f:
                f.write(text)
            rc, out, _ = helpers.launch(
                ["--nproc-per-node", "2", "--strategy", path, "--time-limit", "30",
                 os.path.join(helpers.PYTHON_ROOT, "bytecomp", "examples", "digits.py")],
                timeout=60)
        self.assertNotEqual(rc, 0, out)
        self.assertIn("this one is float64", out)
        self.assertIn("give the daemons' strategy a first rule '- match: \"bytecomp.*\"'", out)

    def test_multi_node_refused_until_the_daemons_support_it(self):
        from bytecomp.run import _cluster_supported
        why = _cluster_supported(2, helpers.BUILD_ROOT)
        if why is None:
            self.skipTest("the daemons have the inter-node path")
        rc, out, _ = helpers.launch(["--nodes", "2", "x.py"], timeout=30)
        self.assertEqual(rc, 1, out)
        self.assertIn("no inter-node path yet", out)


if __name__ == "__main__":
    unittest.main()
