"""DistributedOptimizer(overlap_forward=model) (issue 25): step() does not
wait; the next forward's per-module pre-hooks wait for and apply their
parameters' updates. Through bytecomp-run with real daemons (and a
parameter server across nodes), workers/overlap_worker.py:
- the parameters, losses, eval outputs and optimizer state equal the
  default's bit for bit at every step (SGD momentum + weight decay, Adam,
  2 backward passes per step; a module used twice, an unused parameter, a
  StepLR scheduler, zero_grad() before the forward or right after step()),
  on 1 node x 2 and on 2 nodes x 1 through a server; bc.shutdown() right
  after step() applies that step;
- a peer killed (or stuck) while a sum is pending: the forward that waits
  for it raises JobAbortedError (BytecompTimeout) naming the module;
- every optimizer class it accepts steps one parameter at a time bit for
  bit as a whole step (in-process, on the PyTorch that runs the tests);
- refusals: LBFGS, an optimizer subclass, a non-module, parameters outside
  the model, a forward that uses a parameter without its module's forward."""

import os
import re
import shutil
import tempfile
import unittest
import uuid

import helpers

WORKER = os.path.join(helpers.TESTS_DIR, "workers", "overlap_worker.py")


class PerParameterSteps(unittest.TestCase):
    def test_every_accepted_optimizer_steps_per_parameter_bit_for_bit(self):
        """The premise of overlap_forward, on the PyTorch that runs the tests:
        for every optimizer class it accepts, one step on each parameter
        alone (_step_one, as the pre-hooks do) gives the bits of one whole
        step, with state, over several steps (no daemon needed)."""
        import torch
        from bytecomp.torch import _optimizer as o

        def make(cls, params):
            if cls is torch.optim.SGD:  # the only one without a default lr
                return cls(params, lr=0.01, momentum=0.9, weight_decay=1e-4, nesterov=True)
            return cls(params)

        def run(cls, split):
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                    torch.nn.Linear(8, 3))
            opt = make(cls, m.parameters())
            g = torch.Generator().manual_seed(1)
            for _ in range(4):
                opt.zero_grad()
                m(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
                if split:
                    for grp in opt.param_groups:
                        hp = {k: v for k, v in grp.items() if k != "params"}
                        for p in grp["params"]:
                            o._step_one(opt, cls, p, hp)
                else:
                    opt.step()
            return [p.detach().clone() for p in m.parameters()]

        self.assertIn(torch.optim.SGD, o._PER_PARAMETER_OPTIMIZERS)
        self.assertIn(torch.optim.Adam, o._PER_PARAMETER_OPTIMIZERS)
        for cls in sorted(o._PER_PARAMETER_OPTIMIZERS, key=lambda c: c.__name__):
            whole, split = run(cls, False), run(cls, True)
            for a, b in zip(whole, split):
                self.assertTrue(torch.equal(a, b), "%s: max |diff| %g" %
                                (cls.__name__, (a - b).abs().max()))


class Overlap(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="bc-overlap-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_worker(self, launcher_args, worker_args, timeout=150):
        run_id = "ov" + uuid.uuid4().hex[:8]
        rc, out, pid = helpers.launch(["--job-id", run_id] + launcher_args +
                                      [WORKER] + worker_args, timeout=timeout)
        pids, shm = helpers.run_leftovers(run_id, pid)
        self.assertEqual(pids, [], "processes left:\n" + out)
        self.assertEqual(shm, [], "segments left:\n" + out)
        return rc, out

    def check_equal(self, launcher_args, ranks):
        rc, out = self.run_worker(launcher_args + ["--time-limit", "120"],
                                  ["--mode", "equal", "--steps", "8"])
        self.assertEqual(rc, 0, out)
        for name in ("sgd-momentum", "adam", "sgd-accumulate-2"):
            for r in range(ranks):
                self.assertIn("[rank %d] OK equal %s (8 steps, %d ranks)" % (r, name, ranks),
                              out)
        for r in range(ranks):
            self.assertIn("[rank %d] OK shutdown applied the last step" % r, out)

    def test_bit_identical_to_default_one_node(self):
        self.check_equal(["--nproc-per-node", "2"], 2)

    def test_bit_identical_to_default_two_nodes_through_server(self):
        self.check_equal(["--nodes", "2", "--nproc-per-node", "1"], 2)

    def forward_raised(self, out):
        m = re.search(r"^\[rank 0\] FORWARD RAISED (\S+) ([\d.]+) (.*)$", out, re.M)
        self.assertIsNotNone(m, out)
        return m.group(1), float(m.group(2)), m.group(3)

    def test_killed_peer_raises_in_the_waiting_forward(self):
        rc, out = self.run_worker(["--nproc-per-node", "2", "--timeout-ms", "20000",
                                   "--time-limit", "60", "--grace", "10"],
                                  ["--mode", "kill", "--out", self.tmp])
        self.assertNotEqual(rc, 0, out)  # rank 1 was SIGKILLed
        cls, secs, msg = self.forward_raised(out)
        self.assertEqual(cls, "JobAbortedError", out)
        self.assertIn("waited for in the forward of module '0'", msg)
        self.assertIn("disconnected", msg)  # the daemon's cause
        self.assertLess(secs, 10.0, out)    # told, not timed out
        self.assertIn("[rank 0] STEP RAISED JobAbortedError", out)

    def test_stuck_peer_times_out_in_the_waiting_forward(self):
        rc, out = self.run_worker(["--nproc-per-node", "2", "--timeout-ms", "2000",
                                   "--time-limit", "60", "--grace", "10"],
                                  ["--mode", "hang", "--out", self.tmp])
        cls, secs, msg = self.forward_raised(out)
        self.assertEqual(cls, "BytecompTimeout", out)
        self.assertIn("waited for in the forward of module '0'", msg)
        self.assertIn("BYTECOMP_TIMEOUT_MS=2000", msg)
        self.assertGreaterEqual(secs, 1.9, out)
        self.assertLess(secs, 2.0 + 5.0, out)
        self.assertIn("[rank 0] STEP RAISED BytecompTimeout", out)

    def test_refusals_and_stale_use(self):
        rc, out = self.run_worker(["--nproc-per-node", "1", "--time-limit", "60"],
                                  ["--mode", "refuse"])
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count("OK refused"), 5, out)
        self.assertIn("OK stale use refused, drain() works", out)
        self.assertIn("OK done", out)


if __name__ == "__main__":
    unittest.main()
