"""The emulated multi-machine cluster of scripts/bench-cluster (docs/cluster.md):
network namespaces with shaped veths, per node a bytecomp-server and a
bytecompd from their YAML files, training started per node by
`torchrun --nnodes 2 --node_rank i --master_addr ...`. Skipped (with the
reason) where network namespaces cannot be created."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import shutil
import unittest

import helpers

from bytecomp_harness import netns
from bytecomp_harness.cluster import NamespacedCluster
from bytecomp_harness.bench_cluster import strategy_yaml, ALL_SYSTEMS

_WHY = netns.check_permission()
BENCH = os.path.join(helpers.SOURCE_ROOT, "scripts", "bench-cluster")


def _leftovers(tag):
    pids = helpers.processes_with_env("BYTECOMP_RUN_ID", tag)
    shm = helpers.shm_entries("bytecomp.%s" % tag)
    ns = [n for n in netns.list_namespaces() if n.startswith(tag)]
    return pids, shm, ns


@unittest.skipIf(_WHY, "network namespaces not permitted here: %s" % _WHY)
class TorchrunOnNamespaces(unittest.TestCase):
    def test_two_namespaces_ddp_and_bytecomp_train_alike(self):
        """2 nodes at 1 Gbit/s: DDP (gloo) and ByteComp uncompressed, started
        by torchrun per node, reach the same losses (the same sums), every
        node's link carried a full gradient per step (the traffic crossed the
        namespaces), a topk strategy trains too, and nothing is left."""
        out = tempfile.mkdtemp(prefix="bc-test-cluster-")
        strategies = os.path.join(out, "strategies")
        os.makedirs(strategies)
        for s in ("bc_none", "bc_topk"):
            with open(os.path.join(strategies, s + ".yaml"), "w") as f:
                f.write(strategy_yaml(s))
        c = NamespacedCluster(2, build_root=helpers.BUILD_ROOT, timeout_ms=60000)
        tag = c.net.tag
        try:
            with c:
                c.shape("1gbit")
                qdisc = subprocess.run(["tc", "-n", c.net.names[1], "qdisc", "show", "dev",
                                        "eth0"], capture_output=True, text=True).stdout
                self.assertIn("tbf", qdisc)
                self.assertIn("1Gbit", qdisc)
                rc, lines = c.torchrun(
                    ["--model", "lstm", "--systems", "compute,ddp_fp32,bc_none,bc_topk",
                     "--warmup", "1", "--steps", "4", "--batch", "2", "--seq", "8",
                     "--pool", "1", "--lr", "0.5",
                     "--strategy-dir", strategies, "--out", os.path.join(out, "r")], 240)
                self.assertEqual(rc, 0, "".join(lines[-60:]))
                ranks = sorted((json.load(open(os.path.join(out, "r", "rank%d.json" % r)))
                                for r in range(2)), key=lambda d: d["rank"])
            self.assertEqual([d["node_rank"] for d in ranks], [0, 1])
            for d in ranks:
                sysr = d["systems"]
                for s in ("compute", "ddp_fp32", "bc_none", "bc_topk"):
                    self.assertNotIn("error", sysr[s], sysr[s])
                    self.assertEqual(len(sysr[s]["loss"]), 5)
                ddp, bcn = sysr["ddp_fp32"], sysr["bc_none"]
                for a, b in zip(ddp["loss"], bcn["loss"]):
                    self.assertAlmostEqual(a, b, delta=1e-4 * abs(a))
                grad_bytes = 4 * ddp["params"]
                # 2 nodes: a node sends its half to the other's server and
                # answers the other's pull of its own half: one gradient.
                self.assertGreater(bcn["tx_bytes_per_step"], 0.95 * grad_bytes)
                self.assertGreater(ddp["tx_bytes_per_step"], 0.95 * grad_bytes)
                self.assertLess(sysr["bc_topk"]["tx_bytes_per_step"], 0.2 * grad_bytes)
                self.assertLess(sysr["compute"]["tx_bytes_per_step"], 0.01 * grad_bytes)
                self.assertGreater(bcn["service_cpu_s_per_step"], 0.0)
                # One batch again and again: DDP's loss falls; topk with error
                # feedback stays near it (no divergence, no NaN).
                self.assertLess(ddp["loss"][-1], ddp["loss"][0])
                for a, b in zip(ddp["loss"], sysr["bc_topk"]["loss"]):
                    self.assertLess(abs(a - b), 0.05 * a, (ddp["loss"], sysr["bc_topk"]["loss"]))
            self.assertEqual(_leftovers(tag), ([], [], []))
        finally:
            c.stop()
            shutil.rmtree(out, ignore_errors=True)

    def test_stale_namespaces_of_dead_runs_are_removed(self):
        dead = 2 ** 22 + 12345  # above pid_max's default: no such process
        while os.path.exists("/proc/%d" % dead):
            dead += 1
        name = "%s%dn0" % (netns.PREFIX, dead)
        subprocess.run(["ip", "netns", "add", name], check=True)
        try:
            self.assertIn(name, netns.remove_stale())
            self.assertNotIn(name, netns.list_namespaces())
        finally:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def test_ctrl_c_removes_everything(self):
        """SIGINT while the cluster runs: exit 130, no namespace, process or
        shared-memory segment of the run is left."""
        p = subprocess.Popen([sys.executable, BENCH, "--quick", "--systems", "bc_none",
                              "--out", tempfile.mkdtemp(prefix="bc-test-int-")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        tag = "%s%d" % (netns.PREFIX, p.pid)
        try:
            seen = helpers.wait_until(
                lambda: len([n for n in netns.list_namespaces() if n.startswith(tag)]) >= 3
                and helpers.processes_with_env("BYTECOMP_RUN_ID", tag), 60)
            self.assertTrue(seen, "the run never built its cluster")
            p.send_signal(signal.SIGINT)
            out, _ = p.communicate(timeout=90)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
        self.assertEqual(p.returncode, 130, out[-3000:])
        self.assertIn("interrupted", out)
        self.assertEqual(_leftovers(tag), ([], [], []))

    def test_bad_bandwidth_is_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, "bandwidth '12parsecs'"):
            netns.parse_rate("12parsecs")
        p = subprocess.run([sys.executable, BENCH, "--bandwidths", "1gbit,fast"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("bandwidth 'fast'", p.stderr)


@unittest.skipIf(_WHY, "network namespaces not permitted here: %s" % _WHY)
class Quick(unittest.TestCase):
    def test_quick_run_completes_every_system(self):
        """scripts/bench-cluster --quick: every system has a figure or, where
        it failed, a null whose reason the table gives; the last line parses."""
        out = tempfile.mkdtemp(prefix="bc-test-quick-")
        try:
            p = subprocess.Popen([sys.executable, BENCH, "--quick", "--out", out],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                stdout, stderr = p.communicate(timeout=840)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.communicate(timeout=30)
            self.assertEqual(p.returncode, 0, stdout[-4000:] + stderr[-4000:])
            last = json.loads(stdout.strip().splitlines()[-1])
            self.assertEqual(set(last), {"results", "compute_only_ms", "goodput_vs_link",
                                         "accuracy", "broadcast_ms"})
            # The accuracy run (cancer, 60 steps, unshaped): exact averaging
            # both ways learns, DDP and bc_none (the same sums) end alike, and
            # the loss and accuracy curves are plotted.
            acc = last["accuracy"]["cancer"]
            self.assertEqual(sorted(acc), ["bc_none", "ddp_fp32"])
            for s, r in acc.items():
                self.assertIsNotNone(r, s)
                self.assertGreater(r["final_accuracy"], 85.0, (s, r))
                self.assertGreater(r["step_ms"], 0, (s, r))
            self.assertLess(abs(acc["bc_none"]["final_accuracy"] -
                                acc["ddp_fp32"]["final_accuracy"]), 2.0, acc)
            self.assertTrue(os.path.getsize(os.path.join(out, "accuracy-cancer.png")) > 1000)
            # bc.broadcast_parameters vs DDP's broadcast, both timed, every bandwidth.
            self.assertEqual(sorted(last["broadcast_ms"]["resnet18"]), ["1gbit", "unshaped"])
            for bw, ways in last["broadcast_ms"]["resnet18"].items():
                self.assertGreater(ways["ddp"] or 0, 0, (bw, ways))
                self.assertGreater(ways["bytecomp"] or 0, 0, (bw, ways))
            table = open(os.path.join(out, "results.md")).read()
            bws = last["results"]["resnet18"]
            self.assertEqual(sorted(bws), ["1gbit", "unshaped"])
            for bw, systems in bws.items():
                self.assertEqual(sorted(systems), sorted(ALL_SYSTEMS))
                for s, ms in systems.items():
                    if ms is None:
                        self.assertRegex(table, r"\| resnet18 \| %s \| %s \| null: \S" % (bw, s))
                        # Only what this torch cannot run (the gloo abort).
                        self.assertEqual(s, "ddp_powersgd", table)
                    else:
                        self.assertGreater(ms, 0)
            self.assertGreater(last["compute_only_ms"]["resnet18"], 0)
            # The goodput probes ran on both uncompressed paths at the shaped rate.
            self.assertEqual(sorted(last["goodput_vs_link"]), ["1gbit"])
            for path in ("ps", "ring"):
                self.assertGreater(last["goodput_vs_link"]["1gbit"][path] or 0, 0.05,
                                   last["goodput_vs_link"])
            # bc_auto ran its own decision at both rates (its run directory).
            self.assertRegex(table, r"\| resnet18 \| 1gbit \| \d+ of 62 \|")
            self.assertRegex(table, r"\| resnet18 \| unshaped \| \d+ of 62 \|")
            self.assertTrue(os.path.getsize(os.path.join(out, "cluster.png")) > 1000)
            self.assertEqual(_leftovers("%s%d" % (netns.PREFIX, p.pid)), ([], [], []))
        finally:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
