"""bytecomp.torch as a drop-in for horovod.torch (issue 26): Horovod's
semantics in one process against a real bytecompd, across processes on 1 and
2 nodes (workers/horovod_worker.py under bytecomp-run), and a Horovod-style
training script that differs from Horovod's only in its import line."""

import os
import re
import unittest
import uuid

import torch

import helpers
import bytecomp
import bytecomp.torch as hvd

WORKER = os.path.join(helpers.TESTS_DIR, "workers", "horovod_worker.py")
EXAMPLE = os.path.join(helpers.PYTHON_ROOT, "bytecomp", "examples", "horovod_digits.py")


class OneProcess(unittest.TestCase):
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
                           "BYTECOMP_JOB_ID": "hvd" + uuid.uuid4().hex[:8],
                           "BYTECOMP_TIMEOUT_MS": "3000", "BYTECOMP_START_TIMEOUT_MS": "3000"})
        os.environ.pop("BYTECOMP_STRATEGY", None)
        hvd.init()

    def tearDown(self):
        hvd.shutdown()
        os.environ.clear()
        os.environ.update(self.saved)

    def test_integers_exact_in_their_dtype(self):
        for dtype, vals in ((torch.int64, [2 ** 54 + 3, -(2 ** 63), 2 ** 63 - 1, 7]),
                            (torch.int32, [2 ** 31 - 1, -5]), (torch.int16, [-300, 12]),
                            (torch.uint8, [255, 1])):
            t = torch.tensor(vals, dtype=dtype)
            for op in (hvd.Sum, hvd.Average):
                got = hvd.allreduce(t, op=op)
                self.assertEqual(got.dtype, dtype)
                self.assertTrue(torch.equal(got, t), (dtype, op, got))
        self.assertEqual(hvd.allreduce(torch.tensor(2 ** 54 + 3)).item(), 2 ** 54 + 3)
        x = torch.tensor([1.25, -2.5], dtype=torch.float64)
        self.assertTrue(torch.equal(hvd.allreduce(x, average=False), x))

    def test_new_tensor_and_in_place_forms(self):
        x = torch.arange(4.0)
        y = hvd.broadcast(x, 0)
        self.assertIsNot(y, x)
        y += 1
        self.assertTrue(torch.equal(x, torch.arange(4.0)))
        self.assertIs(hvd.broadcast_(x, 0), x)
        self.assertIs(hvd.allreduce_(x), x)
        z = hvd.allreduce(x)
        self.assertIsNot(z, x)

    def test_async_handles(self):
        h = hvd.allreduce_async(torch.ones(3), op=hvd.Sum)
        g = hvd.allgather_async(torch.ones(2, 2))
        self.assertTrue(torch.equal(hvd.synchronize(g), torch.ones(2, 2)))
        self.assertTrue(hvd.poll(h) in (True, False))
        self.assertTrue(torch.equal(hvd.synchronize(h), torch.ones(3)))
        with self.assertRaisesRegex(ValueError, "not a handle of a pending"):
            hvd.synchronize(h)

    def test_autograd(self):
        a = torch.tensor([1.0, 2.0], requires_grad=True)
        (hvd.allreduce(a) * 3).sum().backward()
        self.assertTrue(torch.equal(a.grad, torch.full((2,), 3.0)))
        b = torch.ones(2, 3, requires_grad=True)
        hvd.allgather(b).sum().backward()
        self.assertTrue(torch.equal(b.grad, torch.ones(2, 3)))
        c = torch.ones(2, requires_grad=True)
        hvd.broadcast(c, 0).pow(2).sum().backward()
        self.assertTrue(torch.equal(c.grad, torch.full((2,), 2.0)))

    def test_errors_are_clear(self):
        self.assertTrue(issubclass(hvd.MismatchError, RuntimeError))
        self.assertTrue(issubclass(hvd.MismatchError, ValueError))
        with self.assertRaisesRegex(ValueError, "op='adasum' is not supported"):
            hvd.allreduce(torch.ones(1), op=hvd.Adasum)
        with self.assertRaisesRegex(ValueError, "not both"):
            hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
        with self.assertRaisesRegex(TypeError, "would round"):
            hvd.allreduce(torch.ones(1, dtype=torch.int64), prescale_factor=0.5)
        with self.assertRaisesRegex(TypeError, "dtype torch.bool"):
            hvd.allreduce(torch.ones(1, dtype=torch.bool))
        with self.assertRaisesRegex(ValueError, "no process sets"):
            hvd.allreduce(torch.ones(1), process_set=object())
        m = torch.nn.Linear(2, 2)
        with self.assertRaisesRegex(ValueError, "goes with op=Average"):
            hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1), op=hvd.Sum,
                                     gradient_predivide_factor=2.0)

    def test_broadcast_object_name_and_reinit(self):
        self.assertEqual(hvd.broadcast_object([1, "a"], 0, name="cfg"), [1, "a"])
        for _ in range(3):
            hvd.shutdown()
            hvd.init()
            self.assertEqual(hvd.allreduce(torch.tensor([5]), op=hvd.Sum).item(), 5)

    def test_skip_synchronize(self):
        m = torch.nn.Linear(3, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters())
        m(torch.ones(2, 3)).sum().backward()
        with opt.skip_synchronize():
            with self.assertRaisesRegex(bytecomp.StateError, "call optimizer.synchronize"):
                opt.step()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        before = m.weight.detach().clone()
        with opt.skip_synchronize():
            opt.step()
        self.assertLess(float((m.weight - before).norm()), 0.01 * 0.1 + 1e-7)

    def test_compression_fp16(self):
        """Compression.fp16 runs the daemons' fp16 compressor on every
        gradient: one process's sum is its gradient rounded to fp16."""
        m = torch.nn.Linear(300, 7)
        ref = torch.nn.Linear(300, 7)
        ref.load_state_dict(m.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.0),
                                       named_parameters=m.named_parameters(),
                                       compression=hvd.Compression.fp16)
        x = torch.randn(5, 300) * 1.2345
        ref(x).pow(2).sum().backward()
        m(x).pow(2).sum().backward()
        opt.step()
        self.assertTrue(torch.equal(m.weight.grad, ref.weight.grad.half().float()))
        self.assertFalse(torch.equal(m.weight.grad, ref.weight.grad))
        t = torch.tensor([1.0 + 2 ** -12])
        self.assertEqual(hvd.allreduce(t, compression=hvd.Compression.fp16).item(), 1.0)
        self.assertEqual(hvd.allreduce(t).item(), 1.0 + 2 ** -12)


class Processes(unittest.TestCase):
    def run_worker(self, args, nproc, nodes, expect):
        run_id = "hv" + uuid.uuid4().hex[:8]
        rc, out, pid = helpers.launch(["--nodes", str(nodes), "--nproc-per-node", str(nproc),
                                       "--job-id", run_id, "--timeout-ms", "5000",
                                       "--start-timeout", "10", "--time-limit", "150"] + args,
                                      timeout=180)
        self.assertEqual(rc, 0, out)
        self.assertEqual(out.count(expect), nproc * nodes, out)
        self.assertEqual(helpers.run_leftovers(run_id, pid), ([], []), out)
        return out

    def test_semantics_one_node(self):
        self.run_worker([WORKER, "semantics"], 2, 1, "OK semantics")

    def test_semantics_two_nodes(self):
        """Across nodes the parameter servers sum float32: integers still come
        back exact (2**54 + 3, 2**40 + rank, wrapping int32) and float64 is
        summed in float64."""
        self.run_worker([WORKER, "semantics"], 2, 2, "OK semantics")

    def test_reinit_one_node(self):
        self.run_worker([WORKER, "reinit"], 2, 1, "OK reinit")

    def test_reinit_two_nodes(self):
        self.run_worker([WORKER, "reinit"], 2, 2, "OK reinit")

    def test_horovod_example_two_nodes(self):
        out = self.run_worker([EXAMPLE, "--epochs", "6", "--fp16-allreduce"], 2, 2, "rank done")
        acc = [float(a) for a in re.findall(r"Test set: Average loss: \S+, Accuracy: ([\d.]+)%",
                                            out)]
        self.assertTrue(acc and acc[-1] > 80.0, out)

    def test_horovod_example_one_node(self):
        self.run_worker([EXAMPLE, "--epochs", "2"], 2, 1, "rank done")

    def test_example_differs_from_horovod_only_in_the_import(self):
        with open(EXAMPLE) as f:
            lines = f.read().splitlines()
        ours = [i for i, line in enumerate(lines) if "bytecomp" in line]
        self.assertEqual([lines[i] for i in ours], ["import bytecomp.torch as hvd"])


if __name__ == "__main__":
    unittest.main()
