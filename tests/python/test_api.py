"""bytecomp.torch against a real bytecompd, in this process: gradients live in
shared memory, and every misuse raises with a message saying what to do."""

import os
import threading
import time
import unittest
import uuid

import torch

import helpers
import bytecomp
import bytecomp.torch as bc
from bytecomp import strategy as bstrategy


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


class Api(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = helpers.Daemon(setup_timeout_ms=3000)

    @classmethod
    def tearDownClass(cls):
        left = cls.daemon.stop()
        assert not left, "left in /dev/shm: %s" % left

    def setUp(self):
        self.saved = dict(os.environ)
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "LOCAL_WORLD_SIZE": "1", "BYTECOMP_SOCKET": self.daemon.socket,
                           "BYTECOMP_JOB_ID": "api" + uuid.uuid4().hex[:8],
                           "BYTECOMP_TIMEOUT_MS": "3000", "BYTECOMP_START_TIMEOUT_MS": "3000"})
        os.environ.pop("BYTECOMP_STRATEGY", None)

    def tearDown(self):
        bc.shutdown()
        os.environ.clear()
        os.environ.update(self.saved)

    def raises(self, exc, fragment, fn, *a, **kw):
        with self.assertRaises(exc) as cm:
            fn(*a, **kw)
        self.assertIn(fragment, str(cm.exception))
        return cm.exception

    # -- the working path ----------------------------------------------------
    def test_gradients_live_in_shared_memory(self):
        bc.init()
        self.assertEqual((bc.rank(), bc.size(), bc.local_rank(), bc.local_size()), (0, 1, 0, 1))
        m = model()
        opt = bc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                      named_parameters=m.named_parameters())
        self.assertIsInstance(opt, torch.optim.SGD)
        slots = {s.name: s for s in opt._bc_slots}
        self.assertEqual(list(slots), ["0.weight", "0.bias", "2.weight", "2.bias"])
        ref = model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        x = torch.randn(5, 4)
        for step in range(3):
            opt.zero_grad()
            ref.zero_grad()
            m(x).sum().backward()
            ref(x).sum().backward()
            for name, p in m.named_parameters():
                # autograd accumulated straight into the shared-memory buffer
                self.assertEqual(p.grad.data_ptr(), slots[name].buf.data_ptr())
                self.assertIsNotNone(slots[name].handle, "pushed during backward")
            opt.step()
            ref_opt.step()
            for (n, a), b in zip(m.named_parameters(), ref.parameters()):
                self.assertTrue(torch.equal(a, b), n)
        bc.shutdown()
        # After shutdown the gradients were moved out of shared memory.
        self.assertTrue(all(p.grad is not None for p in m.parameters()))
        self.raises(bc.NotInitializedError, "after bytecomp.torch.shutdown()", opt.step)

    def test_broadcasts_and_allreduce_single_process(self):
        bc.init()
        m = model()
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        bc.broadcast_parameters(m.state_dict(), root_rank=0)
        for k, v in m.state_dict().items():
            self.assertTrue(torch.equal(v, sd[k]))
        self.assertEqual(bc.broadcast_object({"a": [1, 2]}), {"a": [1, 2]})
        t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        self.assertTrue(torch.equal(bc.allreduce(t), t))
        big = torch.randn(bc._SCRATCH_ELEMENTS * 2 + 17)  # several scratch rounds
        self.assertTrue(torch.equal(bc.allreduce(big, average=False), big))
        opt = torch.optim.Adam(m.parameters())
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        bc.broadcast_optimizer_state(opt, root_rank=0)
        bc.barrier()

    # -- misuse --------------------------------------------------------------
    def test_calls_before_init(self):
        self.raises(bc.NotInitializedError, "rank() called before bytecomp.torch.init()", bc.rank)
        self.raises(bc.NotInitializedError, "before bytecomp.torch.init()",
                    bc.DistributedOptimizer, torch.optim.SGD(model().parameters(), lr=1))
        self.raises(bc.NotInitializedError, "before bytecomp.torch.init()",
                    bc.broadcast_parameters, {})

    def test_init_errors(self):
        os.environ.pop("RANK")
        self.raises(bytecomp.EnvironmentConfigError, "RANK is not set", bc.init)
        os.environ["RANK"] = "0"
        os.environ["BYTECOMP_SOCKET"] = os.path.join(self.daemon.dir, "nobody-here.sock")
        os.environ["BYTECOMP_START_TIMEOUT_MS"] = "800"
        t0 = time.monotonic()
        e = self.raises(bytecomp.DaemonUnavailableError, "is the daemon running?", bc.init)
        # init() waited for a daemon (one that systemd restarts) that never came.
        self.assertGreaterEqual(time.monotonic() - t0, 0.8)
        self.assertIn("init() waited BYTECOMP_START_TIMEOUT_MS=800 ms for a daemon to answer",
                      str(e))
        self.assertFalse(bc.is_initialized())

    def test_init_does_not_wait_out_a_socket_path_that_cannot_work(self):
        """Only a daemon that is not there (yet) is waited for: a socket
        path under a regular file (ENOTDIR), like a permission error, is
        refused at once, naming the path."""
        plain = os.path.join(self.daemon.dir, "plain-file")
        with open(plain, "w") as f:
            f.write("not a directory\n")
        os.environ.update({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "RANK": "0",
                           "BYTECOMP_SOCKET": os.path.join(plain, "bytecompd.sock"),
                           "BYTECOMP_START_TIMEOUT_MS": "20000"})
        t0 = time.monotonic()
        e = self.raises(bytecomp.DaemonUnavailableError, "Not a directory", bc.init)
        self.assertLess(time.monotonic() - t0, 10.0)  # not the 20 s bound
        self.assertIn(os.path.join(plain, "bytecompd.sock"), str(e))
        self.assertNotIn("init() waited", str(e))
        self.assertFalse(bc.is_initialized())

    def test_init_waits_for_a_daemon_that_comes_up(self):
        """An elastic restart's new workers can start before systemd has
        restarted the node's daemon: init() waits for it (bounded)."""
        sock = os.path.join(self.daemon.dir, "late.sock")
        late = []
        th = threading.Thread(target=lambda: (time.sleep(1.0), late.append(
            helpers.Daemon(setup_timeout_ms=3000, socket=sock))))
        os.environ["BYTECOMP_SOCKET"] = sock
        os.environ["BYTECOMP_START_TIMEOUT_MS"] = "20000"
        th.start()
        try:
            t0 = time.monotonic()
            bc.init()
            self.assertGreater(time.monotonic() - t0, 0.9)
            self.assertEqual(bc.allreduce(torch.tensor([3.0]), average=False).item(), 3.0)
            bc.shutdown()
        finally:
            th.join(30)
            for d in late:
                self.assertEqual(d.stop(), [])

    def test_other_local_ranks_never_come(self):
        os.environ.update({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                           "BYTECOMP_START_TIMEOUT_MS": "1000"})
        t0 = time.monotonic()
        e = self.raises(bytecomp.BytecompError, "2 local ranks", bc.init)
        self.assertIsInstance(e, (bytecomp.BytecompTimeout, bytecomp.JobAbortedError))
        self.assertLess(time.monotonic() - t0, 5)

    def test_bad_optimizer_arguments(self):
        bc.init()
        m = model()
        self.raises(TypeError, "expected a torch.optim.Optimizer", bc.DistributedOptimizer, m)
        named = list(m.named_parameters())
        self.raises(ValueError, "not in named_parameters", bc.DistributedOptimizer,
                    torch.optim.SGD(m.parameters(), lr=1), named_parameters=named[:2])
        self.raises(ValueError, "duplicate names '0.bias'", bc.DistributedOptimizer,
                    torch.optim.SGD(m.parameters(), lr=1),
                    named_parameters=named + [("0.bias", torch.nn.Parameter(torch.ones(1)))])
        self.raises(TypeError, "must yield (name, parameter) pairs", bc.DistributedOptimizer,
                    torch.optim.SGD(m.parameters(), lr=1), named_parameters=[1, 2])
        self.raises(ValueError, "op='max'", bc.DistributedOptimizer,
                    torch.optim.SGD(m.parameters(), lr=1), op="max")
        half = torch.nn.Linear(2, 2).half()
        self.raises(TypeError, "has dtype torch.float16", bc.DistributedOptimizer,
                    torch.optim.SGD(half.parameters(), lr=1),
                    named_parameters=half.named_parameters())
        opt = bc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1),
                                      named_parameters=named)
        self.raises(ValueError, "already distributed", bc.DistributedOptimizer, opt)

    def test_backward_twice_and_zero_grad_in_flight(self):
        bc.init()
        m = model()
        opt = bc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1),
                                      named_parameters=m.named_parameters())
        m(torch.randn(3, 4)).sum().backward()
        self.raises(bytecomp.StateError, "call optimizer.step() or optimizer.synchronize() "
                    "first", opt.zero_grad)
        e = self.raises(RuntimeError, "computed 2 times since the last step()",
                        m(torch.randn(3, 4)).sum().backward)
        self.assertIn("backward_passes_per_step=1", str(e))

    def test_synchronize_then_step_sums_once(self):
        bc.init()
        m = model()
        opt = bc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                      named_parameters=m.named_parameters())
        for step in range(1, 3):
            opt.zero_grad()
            m(torch.randn(3, 4)).sum().backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.synchronize()   # a second call before step() sums nothing again
            opt.step()
            self.assertEqual(opt._bc_iteration, step)
        opt.step()   # every step() without synchronize() sums (all ranks stay in step)
        self.assertEqual(opt._bc_iteration, 3)

    def test_optimizer_built_under_no_grad(self):
        bc.init()
        m = model()
        with torch.no_grad():
            opt = bc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1),
                                          named_parameters=m.named_parameters())
        m(torch.randn(3, 4)).sum().backward()
        self.assertTrue(all(s.handle is not None for s in opt._bc_slots))
        opt.step()

    def test_backward_passes_per_step(self):
        bc.init()
        m = model()
        opt = bc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                      named_parameters=m.named_parameters(),
                                      backward_passes_per_step=2)
        x = torch.randn(3, 4)
        m(x).sum().backward()
        self.assertTrue(all(s.handle is None for s in opt._bc_slots))
        m(x).sum().backward()
        self.assertTrue(all(s.handle is not None for s in opt._bc_slots))
        ref = model()
        ref(x).sum().backward()
        opt.step()
        for p, q in zip(m.parameters(), ref.parameters()):
            self.assertTrue(torch.allclose(p.grad, 2 * q.grad))

    def test_bad_root_rank(self):
        bc.init()
        self.raises(ValueError, "root_rank=1 is not a rank (0..0)", bc.broadcast_parameters,
                    model().state_dict(), root_rank=1)
        self.raises(ValueError, "root_rank=-1", bc.broadcast_object, 1, root_rank=-1)
        self.raises(TypeError, "expected a state_dict", bc.broadcast_parameters, [1])

    def test_bad_strategies(self):
        bc.init()
        m = model()

        def make(path):
            return bc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1),
                                           named_parameters=m.named_parameters(), strategy=path)
        d = self.daemon.dir
        self.raises(ValueError, "cannot be read", make, os.path.join(d, "missing.yaml"))
        bad = os.path.join(d, "v2.yaml")
        with open(bad, "w") as f:
            f.write("version: 2\n")
        self.raises(ValueError, "key 'version' is 2: expected 1", make, bad)
        unknown = os.path.join(d, "unknown.yaml")
        with open(unknown, "w") as f:
            f.write("version: 1\nentries:\n  - tensor: nope.weight\n"
                    "    option: {compressor: none}\n")
        self.raises(ValueError, "'nope.weight'", make, unknown)
        demo = os.path.join(helpers.SOURCE_ROOT, "configs", "demo-strategy.yaml")
        self.assertTrue(bstrategy.load(demo).compresses_anything())
        # The job's own strategy goes to the daemon (bytecomp_set_strategy),
        # which validates it at start and names the file.
        wrong = os.path.join(d, "wrong.yaml")
        with open(wrong, "w") as f:
            f.write("version: 1\ndefault: {compressor: nonesuch}\n")
        e = self.raises(bytecomp.BytecompError, "nonesuch", make, wrong)
        self.assertIn("wrong.yaml", str(e))

    def test_per_job_strategy_is_executed(self):
        """strategy=FILE runs FILE for this job, though the daemon has no
        strategy configured: fp16 on the weight (one process, one node: the
        sum is the fp16-rounded gradient), the bias uncompressed."""
        self.assertTrue(bytecomp._lib.has_set_strategy())
        bc.init()
        path = os.path.join(self.daemon.dir, "fp16.yaml")
        with open(path, "w") as f:
            f.write("version: 1\nrules:\n  - match: weight\n    option: {compressor: fp16}\n")
        m = torch.nn.Linear(300, 7)
        opt = bc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                      named_parameters=m.named_parameters(), strategy=path)
        x = torch.randn(5, 300) * 1.2345
        ref = torch.nn.Linear(300, 7)
        ref.load_state_dict(m.state_dict())
        ref(x).pow(2).sum().backward()
        m(x).pow(2).sum().backward()
        opt.step()
        self.assertTrue(torch.equal(m.weight.grad, ref.weight.grad.half().float()))
        self.assertFalse(torch.equal(m.weight.grad, ref.weight.grad))
        self.assertTrue(torch.equal(m.bias.grad, ref.bias.grad))


if __name__ == "__main__":
    unittest.main()
