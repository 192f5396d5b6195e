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
        """2 nodes x 3 processes, 2 servers: ranks numbered node by node, each
        process on its node's daemon; the servers and daemons came up (the
        daemons with the cluster file of the servers bytecomp-run started)."""
        run_id = "le" + uuid.uuid4().hex[:8]
        rc, out, pid = helpers.launch(
            ["--nodes", "2", "--nproc-per-node", "3", "--servers", "2", "--job-id", run_id,
             "--time-limit", "30", "--keep-tmp", "--"] +
            sh('echo "env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK '
               '$BYTECOMP_NODE_RANK $BYTECOMP_JOB_ID $BYTECOMP_RUN_ID $BYTECOMP_SOCKET"; '
               'cat "$(dirname "$BYTECOMP_SOCKET")/daemon.yaml" | sed "s/^/cfg $RANK /"'),
            timeout=60)
        self.assertEqual(rc, 0, out)
        lines = re.findall(r"^\[rank (\d)\] env (.*)$", out, re.M)
        self.assertEqual(sorted(r for r, _ in lines), [str(r) for r in range(6)], out)
        for r, rest in lines:
            rank, world, lrank, lworld, group, node, job, run, sock = rest.split()
            n = int(r) // 3
            self.assertEqual((rank, world, lrank, lworld, group, node),
                             (r, "6", str(int(r) % 3), "3", str(n), str(n)))
            self.assertEqual((job, run), (run_id, run_id))
            self.assertTrue(sock.endswith("/node%d/ctl.sock" % n), sock)
            self.assertIn("[rank %s] cfg %s   node_id: %d" % (r, r, 100 + n), out)
            self.assertIn("[rank %s] cfg %s   nodes: [100, 101]" % (r, r), out)
        tmp = os.path.dirname(os.path.dirname(lines[0][1].split()[-1]))
        try:
            with open(os.path.join(tmp, "cluster.yaml")) as f:
                cluster = f.read()
            self.assertRegex(cluster, r'id: 0, address: "tcp://127\.0\.0\.1:[1-9]\d*"')
            self.assertIn('id: 1, address: "tcp://127.0.0.1:0"', cluster)
        finally:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
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

    def test_multi_node_needs_a_server(self):
        rc, out, _ = helpers.launch(["--nodes", "2", "--bytecomp-server", "/nonexistent/srv",
                                     "x.py"], timeout=30)
        self.assertEqual(rc, 1, out)
        self.assertIn("--nodes 2 needs bytecomp-server", out)
        self.assertIn("not found at /nonexistent/srv", out)

    def test_strategy_compressing_the_control_tensor_across_nodes_is_detected(self):
        """Across nodes the control tensor is float32, which the daemons would
        compress: init()'s exactness check refuses to go on."""
        src = os.path.join(helpers.SOURCE_ROOT, "configs", "demo-strategy.yaml")
        with open(src) as f:
            text = f.read().replace('  - match: "bytecomp.*"\n    option: {compressor: none}\n',
                                    "").replace("min_bytes: 64KiB", "min_bytes: 1")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "no-control-rule.yaml")
            with open(path, "w") as f:
                f.write(text)
            rc, out, _ = helpers.launch(
                ["--nodes", "2", "--nproc-per-node", "1", "--strategy", path, "--time-limit", "30",
                 os.path.join(helpers.PYTHON_ROOT, "bytecomp", "examples", "digits.py")],
                timeout=60)
        self.assertNotEqual(rc, 0, out)
        self.assertIn("sums of bytecomp.torch's control tensor 'bytecomp.control' are not exact",
                      out)
        self.assertIn("give the strategy a first rule '- match: \"bytecomp.*\"'", out)


if __name__ == "__main__":
    unittest.main()
