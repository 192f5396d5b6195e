"""The NCCL intra-node shard flow's layout and ordering (bytecomp/torch/
_nccl.py, issue 27) over simulated local ranks: each rank's side stream is a
FIFO queue; a collective runs once every rank's queue reached it (as NCCL
does); copies move real CPU tensor data when they run. The real
communicator (NcclComm over libbytecomp_gpu) needs GPUs: scripts/gpu-check."""

import unittest

import torch

from bytecomp import _lib
from bytecomp.torch import _intra, _nccl


class World:
    """N ranks' side streams and the collectives among them."""

    def __init__(self, n):
        self.n = n
        self.queues = [[] for _ in range(n)]
        self.aborted = False

    def run(self):
        while True:
            progressed = False
            for q in self.queues:  # copies up to the next collective
                while q and q[0][0] == "copy":
                    _, dst, src = q.pop(0)
                    dst.copy_(src)
                    progressed = True
            heads = [q[0] if q else None for q in self.queues]
            if all(h is not None and h[0] != "copy" for h in heads):
                kinds = {h[0] for h in heads}
                assert len(kinds) == 1, "ranks disagree on the collective: %s" % kinds
                bufs = [h[1] for h in heads]
                count = heads[0][2]
                per = count // self.n
                if heads[0][0] == "rs":
                    total = sum(b[:count].clone() for b in bufs)
                    for r, b in enumerate(bufs):
                        b[r * per:(r + 1) * per] = total[r * per:(r + 1) * per]
                else:  # allgather
                    parts = [b[r * per:(r + 1) * per].clone() for r, b in enumerate(bufs)]
                    for b in bufs:
                        for r, p in enumerate(parts):
                            b[r * per:(r + 1) * per] = p
                for q in self.queues:
                    q.pop(0)
                progressed = True
            if not progressed:
                return


class Comm:
    def __init__(self, world, rank, fail=False):
        self.world, self.rank, self.fail = world, rank, fail

    def sum(self, buf, count, shard, stream):
        assert shard == 1 and stream == ("side", self.rank)
        if self.fail:
            raise _lib.BytecompError("BYTECOMP_ERR_PEER_LOST", "NCCL: a local rank died")
        self.world.queues[self.rank].append(("rs", buf, count))

    def allgather(self, buf, count, stream):
        self.world.queues[self.rank].append(("ag", buf, count))

    def abort(self):
        self.world.aborted = True


class Ops:
    def __init__(self, world, rank):
        self.world, self.rank = world, rank

    def zeros(self, count, like):
        return torch.zeros(count, dtype=like.dtype)

    def copy_async(self, dst, src, stream):
        self.world.queues[self.rank].append(("copy", dst, src))


class ShardFlowTest(unittest.TestCase):
    def test_every_rank_ends_with_the_sum_and_stages_only_its_shard(self):
        n = 3
        world = World(n)
        flows = [_nccl.ShardFlow(Comm(world, r), Ops(world, r), r, n) for r in range(n)]
        grads = [torch.arange(10, dtype=torch.float32) * (r + 1) for r in range(n)]
        want = sum(g.clone() for g in grads)
        shards = [f.before("w", g, ("side", r)) for r, (f, g) in enumerate(zip(flows, grads))]
        world.run()
        self.assertEqual([s.numel() for s in shards], [4, 4, 4])  # 10 padded to 12
        for r, s in enumerate(shards):  # rank r holds the sum of its shard
            full = torch.cat([want, torch.zeros(2)])
            self.assertTrue(torch.equal(s, full[r * 4:(r + 1) * 4]), (r, s))
        for s in shards:  # the daemon's inter-node sum (here: two identical nodes)
            s.mul_(2)
        for r, (f, g) in enumerate(zip(flows, grads)):
            f.after("w", g, ("side", r))
        world.run()
        for g in grads:
            self.assertTrue(torch.equal(g, want * 2), g)
        # The buffers are reused next iteration; the padding stays zero.
        self.assertIs(flows[0].layout("w", grads[0])[0], flows[0].layout("w", grads[0])[0])

    def test_a_failing_collective_aborts_the_communicator_and_raises(self):
        world = World(2)
        f = _nccl.ShardFlow(Comm(world, 0, fail=True), Ops(world, 0), 0, 2)
        with self.assertRaises(_lib.BytecompError):
            f.before("w", torch.ones(4), ("side", 0))
        self.assertTrue(world.aborted)

    def test_refusals(self):
        with self.assertRaises(ValueError):
            _nccl.ShardFlow(None, None, 2, 2)
        world = World(1)
        f = _nccl.ShardFlow(Comm(world, 0), Ops(world, 0), 0, 1)
        f.before("w", torch.ones(4), ("side", 0))
        with self.assertRaises(ValueError):
            f.layout("w", torch.ones(5))

    def test_real_communicator_needs_nccl(self):
        try:
            _nccl.NcclComm._lib()
        except _lib.UnsupportedError as e:
            self.assertIn("NCCL", str(e))
            return
        if not torch.cuda.is_available():
            self.skipTest("NCCL built, no CUDA device: scripts/gpu-check")
        self.assertEqual(len(_nccl.NcclComm.make_id()), 128)


class IntraMode(unittest.TestCase):
    """BYTECOMP_INTRA_NODE and what the shard flow accepts (the optimizer
    refuses the rest at start with these messages)."""

    def test_mode(self):
        self.assertEqual(_intra.mode({}), "daemon")
        self.assertEqual(_intra.mode({"BYTECOMP_INTRA_NODE": "nccl"}), "nccl")
        with self.assertRaisesRegex(ValueError, "expected one of daemon, nccl, host"):
            _intra.mode({"BYTECOMP_INTRA_NODE": "NCCL"})

    def test_parameters(self):
        w = torch.zeros(3)
        self.assertIsNone(_intra.check_params("host", [("w", w)], 2))
        self.assertIsNone(_intra.check_params("nccl", [("w", w)], 1))  # one rank: no flow
        self.assertIn("'w' is on cpu", _intra.check_params("nccl", [("w", w)], 2))
        self.assertIn("float32 only", _intra.check_params(
            "host", [("w", w), ("i", torch.zeros(3, dtype=torch.int64))], 2))

    def test_daemon_comm_allgather_contributes_only_its_shard(self):
        sent = []

        class Client:
            def push_pull(self, tid, it):
                sent.append((tid, it, shm.clone()))
                return 1

            def wait_once(self, h, t):
                shm.add_(torch.tensor([10.0, 20.0, 0.0, 0.0]))  # rank 0's shard
                return True

        shm = torch.zeros(4)
        comm = _intra.DaemonComm(Client(), 1, 2, 1000)
        buf = torch.tensor([1.0, 2.0, 3.0, 4.0])
        comm.adopt(buf, 7, shm)
        comm.allgather(buf, 4, None)
        self.assertTrue(torch.equal(sent[0][2], torch.tensor([0.0, 0.0, 3.0, 4.0])))
        self.assertTrue(torch.equal(buf, torch.tensor([10.0, 20.0, 3.0, 4.0])))
        comm.abort()
        with self.assertRaises(_lib.JobAbortedError):
            comm.sum(buf, 4, 1, None)


class Detach(unittest.TestCase):
    """Leaving a failed job: the communicator is aborted before any device
    synchronize, which a collective stuck on a dead local rank would block
    forever (the synchronize is stood in for; the order is what matters)."""

    def test_a_failed_job_aborts_the_communicator_before_synchronizing(self):
        from unittest import mock

        from bytecomp.torch import _optimizer
        events = []

        class Device:
            type = "cuda"

        class Param:
            grad = None
            device = Device()

        class Codec:
            def close(self):
                events.append("codec.close")

        class Intra:
            def abort(self):
                events.append("abort")

            def close(self):
                events.append("intra.close")

        class Client:
            def close(self):
                events.append("client.close")

        slot = _optimizer._Slot.__new__(_optimizer._Slot)
        slot.param, slot.buf, slot.codec = Param(), torch.zeros(2), Codec()
        opt = _optimizer._DistributedOptimizer.__new__(_optimizer._DistributedOptimizer)
        opt._bc_client, opt._bc_slots, opt._bc_failed = Client(), [slot], RuntimeError("dead")
        opt._bc_intra, opt._bc_pinned, opt._bc_staging, opt._bc_hooks = Intra(), None, None, []
        opt._bc_module_hooks = []
        with mock.patch.object(torch.cuda, "synchronize",
                               lambda *a: events.append("synchronize")):
            opt._bytecomp_detach()
        self.assertEqual(events, ["abort", "synchronize", "codec.close", "client.close",
                                  "intra.close"])


if __name__ == "__main__":
    unittest.main()
