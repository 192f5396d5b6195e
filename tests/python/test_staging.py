"""The CUDA staging pipeline's ordering (bytecomp/torch/_staging.py), driven
on a simulated device: streams are FIFO queues that run only when the test
lets the device run, events complete when the device reaches them, copies
move real (CPU) tensor data when they execute. Whatever the device's speed,
the daemon must only ever see finished copies, the host must never wait for
the device in a hook, and the optimizer's stream must see the sums."""

import unittest

import torch

from bytecomp.torch import _staging


class FakeEvent:
    def __init__(self, name):
        self.name = name
        self.recorded = 0  # times recorded
        self.done = 0      # times reached on the device


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.queue = []  # ("copy", dst, src) | ("record", ev, k) | ("wait", ev, k) | ("fn", f)


class FakeDevice(_staging.StreamOps):
    def __init__(self):
        self.compute = FakeStream("compute")
        self.side = FakeStream("side")
        self.n_events = 0
        self.host_waits = 0
        self.log = []

    # -- StreamOps
    def current_stream(self):
        return self.compute

    def side_stream(self):
        return self.side

    def new_event(self):
        self.n_events += 1
        return FakeEvent("e%d" % self.n_events)

    def record(self, event, stream):
        event.recorded += 1
        stream.queue.append(("record", event, event.recorded))

    def wait_event(self, stream, event):
        stream.queue.append(("wait", event, event.recorded))

    def query(self, event):
        return event.done >= event.recorded

    def synchronize(self, event):
        self.host_waits += 1
        while event.done < event.recorded:
            if not self.step():
                raise AssertionError("device deadlock waiting for %s" % event.name)

    def copy_async(self, dst, src, stream):
        stream.queue.append(("copy", dst, src))

    # -- the simulated device
    def enqueue(self, stream, fn):
        stream.queue.append(("fn", fn))

    def step(self, only=None):
        """Runs one runnable operation (the side stream first when both
        can run, or only `only`'s). False when nothing can run."""
        for s in ([only] if only else [self.side, self.compute]):
            if not s.queue:
                continue
            op = s.queue[0]
            if op[0] == "wait" and op[1].done < op[2]:
                continue
            s.queue.pop(0)
            if op[0] == "copy":
                op[1].copy_(op[2])
                self.log.append((s.name, "copy"))
            elif op[0] == "record":
                op[1].done = max(op[1].done, op[2])
            elif op[0] == "fn":
                op[1]()
            return True
        return False

    def run(self, only=None):
        while self.step(only):
            pass


class FakeDaemon:
    """push_pull sums the host buffers of `ranks` simulated ranks: every
    other rank contributes the same values times `other` (so the result is
    data * (1 + other))."""

    def __init__(self, buffers, other=2.0):
        self.buffers = buffers
        self.other = other
        self.pushed = []  # (key, values seen at push)
        self.handles = 0

    def push(self, key):
        self.pushed.append((key, self.buffers[key].clone()))
        self.handles += 1
        return ("h", key, self.handles)

    def wait(self, key, handle):
        assert handle[1] == key
        self.buffers[key].mul_(1.0 + self.other)


def make(n_tensors=3, size=5):
    dev = FakeDevice()
    host = {k: torch.full((size,), -1.0) for k in range(n_tensors)}
    grads = {k: torch.zeros(size) for k in range(n_tensors)}
    daemon = FakeDaemon(host)
    pipe = _staging.StagingPipeline(dev, daemon.push, daemon.wait)
    slots = [pipe.new_slot(k, host[k]) for k in range(n_tensors)]
    return dev, host, grads, daemon, pipe, slots


def backward(dev, pipe, slots, grads, values, run_between=True):
    """Autograd on the compute stream: each gradient is written by a kernel
    enqueued before its hook runs (the device may not have run it yet)."""
    for slot, v in zip(slots, values):
        g = grads[slot.key]
        dev.enqueue(dev.compute, lambda g=g, v=v: g.fill_(v))
        pipe.grad_ready(slot, g)
        if run_between:
            dev.step()


def sync(pipe, slots, grads):
    pipe.drain()
    for slot in slots:
        pipe.copy_back(slot, grads[slot.key])
    pipe.finish(slots)


class Ordering(unittest.TestCase):
    def test_daemon_sees_only_finished_copies_and_step_sees_the_sums(self):
        for run_between in (False, True):
            dev, host, grads, daemon, pipe, slots = make()
            backward(dev, pipe, slots, grads, [1.0, 2.0, 3.0], run_between)
            sync(pipe, slots, grads)
            seen = {}
            dev.enqueue(dev.compute, lambda: seen.update(
                {k: g.clone() for k, g in grads.items()}))  # the optimizer's step
            dev.run()
            self.assertEqual([k for k, _ in daemon.pushed], [0, 1, 2])
            for k, v in daemon.pushed:
                self.assertTrue(torch.equal(v, torch.full((5,), float(k + 1))), (k, v))
            for k in range(3):
                self.assertTrue(torch.equal(seen[k], torch.full((5,), 3.0 * (k + 1))), seen)

    def test_hooks_never_wait_for_the_device(self):
        dev, host, grads, daemon, pipe, slots = make(n_tensors=4)
        backward(dev, pipe, slots, grads, [1.0, 2.0, 3.0, 4.0], run_between=False)
        self.assertEqual(dev.host_waits, 0)
        self.assertEqual(daemon.pushed, [])  # nothing ran on the device yet
        sync(pipe, slots, grads)
        self.assertEqual(dev.host_waits, 4)  # drain: once per tensor left
        self.assertEqual(pipe.host_syncs, 4)

    def test_hooks_push_copies_that_finished(self):
        dev, host, grads, daemon, pipe, slots = make(n_tensors=3)
        dev.enqueue(dev.compute, lambda: grads[0].fill_(7.0))
        pipe.grad_ready(slots[0], grads[0])
        dev.run()  # the device catches up before the next hook
        dev.enqueue(dev.compute, lambda: grads[1].fill_(8.0))
        pipe.grad_ready(slots[1], grads[1])
        self.assertEqual([k for k, _ in daemon.pushed], [0])  # pushed from the 2nd hook
        self.assertEqual(dev.host_waits, 0)
        dev.run()
        pipe.pump()
        self.assertEqual([k for k, _ in daemon.pushed], [0, 1])
        pipe.grad_ready(slots[2], grads[2])
        sync(pipe, slots, grads)
        dev.run()
        self.assertEqual(dev.host_waits, 1)

    def test_copy_waits_for_the_kernel_that_writes_the_gradient(self):
        """The side stream is free to run ahead; the d2h copy must still see
        the value the compute stream writes before the hook."""
        dev, host, grads, daemon, pipe, slots = make(n_tensors=1)
        dev.enqueue(dev.compute, lambda: grads[0].fill_(5.0))
        pipe.grad_ready(slots[0], grads[0])
        dev.run(only=dev.side)  # side alone cannot pass its wait
        self.assertTrue(torch.equal(host[0], torch.full((5,), -1.0)))
        sync(pipe, slots, grads)
        self.assertTrue(torch.equal(daemon.pushed[0][1], torch.full((5,), 5.0)))

    def test_next_iteration_reuses_the_buffer_after_the_copy_back(self):
        """Iteration 2's d2h copy into the host buffer runs after iteration
        1's h2d copy read it (same side stream), even when the host races
        ahead of the device."""
        dev, host, grads, daemon, pipe, slots = make(n_tensors=2)
        results = []
        for it, vals in enumerate(([1.0, 2.0], [10.0, 20.0])):
            backward(dev, pipe, slots, grads, vals, run_between=False)
            sync(pipe, slots, grads)
            dev.enqueue(dev.compute, lambda: results.append([g.clone() for g in grads.values()]))
            # the optimizer zeroes nothing here: the next backward overwrites
        dev.run()
        self.assertEqual([r[0][0].item() for r in results], [3.0, 30.0])
        self.assertEqual([r[1][0].item() for r in results], [6.0, 60.0])

    def test_staging_twice_in_one_step_is_refused(self):
        dev, host, grads, daemon, pipe, slots = make(n_tensors=1)
        pipe.grad_ready(slots[0], grads[0])
        with self.assertRaisesRegex(RuntimeError, "staged twice"):
            pipe.grad_ready(slots[0], grads[0])

    def test_copy_back_before_push_is_refused(self):
        dev, host, grads, daemon, pipe, slots = make(n_tensors=1)
        with self.assertRaisesRegex(RuntimeError, "copy_back of 0 in state idle"):
            pipe.copy_back(slots[0], grads[0])


class Registration(unittest.TestCase):
    class Cudart:
        def __init__(self, rc=0):
            self.calls = []
            self.rc = rc

        def cudaHostRegister(self, ptr, size, flags):
            self.calls.append(("register", ptr, size, flags))
            return self.rc

        def cudaHostUnregister(self, ptr):
            self.calls.append(("unregister", ptr))
            return 0

    def test_one_page_aligned_range_covers_every_buffer(self):
        rt = self.Cudart()
        region = _staging.register_host_range([(0x10040, 100), (0x13000, 0x1100)], rt)
        self.assertEqual(region, (0x10000, 0x5000))
        self.assertEqual(rt.calls, [("register", 0x10000, 0x5000, 0)])
        _staging.unregister_host_range(region, rt)
        self.assertEqual(rt.calls[-1], ("unregister", 0x10000))

    def test_failure_names_the_error(self):
        with self.assertRaisesRegex(RuntimeError, "cudaHostRegister.*cudaError 2"):
            _staging.register_host_range([(0x1000, 8)], self.Cudart(rc=2))

    def test_nothing_staged_registers_nothing(self):
        rt = self.Cudart()
        self.assertIsNone(_staging.register_host_range([], rt))
        _staging.unregister_host_range(None, rt)
        self.assertEqual(rt.calls, [])


class Encoded(unittest.TestCase):
    """GPU placement (StagedSlot.encode): the compression and the payload
    copies run on the side stream after the gradient is ready, in place of
    the dense copy; the daemon gets push_compressed, only after they ran."""

    def test_encode_replaces_the_dense_copy_and_pushes_compressed(self):
        dev = FakeDevice()
        host = {0: torch.full((4,), -1.0), 1: torch.full((4,), -1.0)}
        grads = {0: torch.zeros(4), 1: torch.zeros(4)}
        daemon = FakeDaemon(host)
        compressed = []

        def push_compressed(key):
            compressed.append((key, host[key].clone()))
            return ("h", key, 0)
        pipe = _staging.StagingPipeline(dev, daemon.push, daemon.wait, push_compressed)
        slots = [pipe.new_slot(k, host[k]) for k in (0, 1)]

        def encode(grad, side):  # "compress": negate, on the side stream
            dev.enqueue(side, lambda: host[0].copy_(-grad))
        slots[0].encode = encode
        backward(dev, pipe, slots, grads, [3.0, 5.0], run_between=False)
        self.assertEqual(compressed, [])  # nothing ran on the device yet
        pipe.drain()
        self.assertEqual([k for k, _ in compressed], [0])
        self.assertTrue(torch.equal(compressed[0][1], torch.full((4,), -3.0)))
        self.assertEqual([k for k, _ in daemon.pushed], [1])  # the dense one
        self.assertTrue(torch.equal(daemon.pushed[0][1], torch.full((4,), 5.0)))
        self.assertEqual(dev.log.count(("side", "copy")), 1)  # slot 1's only: 0 made none


class SymmetricComm:
    """The comm of a 2-rank ShardFlow whose other local rank has the same
    gradient: the collectives are device operations on the side stream
    (they run when the simulated device gets there), as NCCL's are."""

    def __init__(self, dev, daemon_factor):
        self.dev = dev
        self.factor = daemon_factor  # what the daemon's sum multiplies by
        self.log = []
        self.waits = []

    def sum(self, buf, count, shard, stream):
        self.log.append("reduce_scatter")
        self.dev.enqueue(stream, lambda: buf[:count].mul_(2.0))  # both ranks' gradients

    def allgather(self, buf, count, stream):
        self.log.append("allgather")
        per = count // 2

        def other_shard():  # rank 1's shard came back from its daemon the same way
            buf[per:2 * per].mul_(self.factor)
        self.dev.enqueue(stream, other_shard)

    def wait(self, stream):
        self.waits.append(stream.name)

    def abort(self):
        self.log.append("abort")


class SimOps:
    def __init__(self, dev):
        self.dev = dev

    def zeros(self, count, like):
        return torch.zeros(count, dtype=like.dtype)

    def copy_async(self, dst, src, stream):
        self.dev.copy_async(dst, src, stream)


class Sharded(unittest.TestCase):
    """The NCCL intra-node shard flow inside the pipeline (rank 0 of 2):
    the daemon sees only the shard, after the reduce-scatter ran; the
    gradient ends with the allgathered sums before the compute stream
    goes on; the host waits only after the communicator's bounded wait."""

    def test_shard_through_the_daemon_between_the_collectives(self):
        from bytecomp.torch import _nccl
        dev = FakeDevice()
        comm = SymmetricComm(dev, daemon_factor=3.0)
        flow = _nccl.ShardFlow(comm, SimOps(dev), 0, 2)
        host = {0: torch.full((3,), -1.0)}  # 5 elements padded to 6: shard of 3
        daemon = FakeDaemon(host, other=2.0)  # the other node: x3
        pipe = _staging.StagingPipeline(dev, daemon.push, daemon.wait)
        pipe.bounded_wait = comm.wait
        slot = pipe.new_slot(0, host[0])
        slot.shard = flow
        grad = torch.zeros(5)
        for it in range(2):  # the padded buffer and the shard are reused
            dev.enqueue(dev.compute, lambda: grad.copy_(torch.arange(1.0, 6.0)))
            pipe.grad_ready(slot, grad)
            self.assertEqual(daemon.pushed[it:], [])  # nothing ran on the device yet
            pipe.drain()
            self.assertEqual(comm.waits, ["side"] * (it + 1))  # bounded, then the host wait
            key, seen = daemon.pushed[it]
            # Rank 0's shard of the node's sum: elements 0..2 of 2 * grad.
            self.assertTrue(torch.equal(seen, torch.tensor([2.0, 4.0, 6.0])), seen)
            pipe.copy_back(slot, grad)
            pipe.finish([slot])
            dev.run()
            # Everything summed: 2 local ranks x 3 (the daemon), padding dropped.
            self.assertTrue(torch.equal(grad, torch.arange(1.0, 6.0) * 6.0), grad)
        self.assertEqual(comm.log, ["reduce_scatter", "allgather"] * 2)


if __name__ == "__main__":
    unittest.main()
