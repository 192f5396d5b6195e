"""Pinned staging of CUDA gradients (issue 27): a CUDA parameter's gradient
stays on the device; when autograd has produced it, it is copied device ->
the job's shared memory (page-locked once with cudaHostRegister) on a side
stream, handed to the daemon once that copy is known to be done, and copied
back into .grad on the device after the daemon's sum, before step() runs.

The ordering lives in StagingPipeline, which talks to CUDA only through a
StreamOps object, so tests drive it with a fake device (tests/python/
test_staging.py). The rules it keeps, per tensor and iteration:

1. ready   : an event is recorded on the stream autograd produced the
             gradient on (the current stream inside the hook); the side stream
             waits for it (device-side wait, no host synchronisation);
2. d2h     : copy grad -> host buffer on the side stream, then record the
             tensor's d2h event;
3. hand-off: the tensor is pushed to the daemon only once its d2h event has
             completed. Hooks poll the events (query(), never blocking) and
             push every completed copy in order; synchronize() drains the rest,
             the only place the host waits for the device (once per tensor
             left, at the end of backward);
4. h2d     : after the daemon's wait returns, copy host buffer -> grad on the
             side stream and record the tensor's h2d event; the copy of one
             tensor overlaps the daemon's work on the next;
5. step    : the compute stream waits for every h2d event (device side), so
             the optimizer's kernels read the sums; the host never waits.

With the NCCL intra-node shard flow (docs/daemon.md "Intra-node on GPUs";
bytecomp/torch/_nccl.py), a slot's `shard` (a ShardFlow) is set: step 2 copies
the rank's shard of the NCCL reduce-scatter instead of the whole gradient
(ShardFlow.before, enqueued on the side stream after the ready wait), and
step 4 copies the daemon's sum back into that shard, then enqueues the
allgather and padded -> grad (ShardFlow.after), all before the h2d event.
The host never waits on a stream with a collective in flight unboundedly:
`bounded_wait(stream)` (the communicator's bounded wait, which aborts it on
a timeout or a dead local rank) runs before every host synchronisation.

A host buffer is reused next iteration: its next d2h copy is on the same side
stream after this iteration's h2d copy (FIFO), and the daemon owns it only
between push and wait, which lie between the two.

Thread-safety: neither; used from autograd's hooks and the training thread,
which PyTorch serialises for one backward (as the CPU path does)."""


class StreamOps:
    """What the pipeline needs from CUDA. TorchCudaOps implements it for a
    real device; the tests implement it over a simulated one."""

    def current_stream(self):
        raise NotImplementedError

    def side_stream(self):
        raise NotImplementedError

    def new_event(self):
        raise NotImplementedError

    def record(self, event, stream):
        raise NotImplementedError

    def wait_event(self, stream, event):
        """`stream` waits for `event` on the device (no host wait)."""
        raise NotImplementedError

    def query(self, event):
        """True when every operation before `event` has run (non-blocking)."""
        raise NotImplementedError

    def synchronize(self, event):
        """The host waits for `event`."""
        raise NotImplementedError

    def copy_async(self, dst, src, stream):
        """Enqueues dst <- src on `stream` (device <-> pinned host)."""
        raise NotImplementedError


class HostOps(StreamOps):
    """StreamOps where every "device" operation is a host operation done at
    once (streams are names, events always complete): the pipeline's order
    on CPU tensors. The intra-node shard flow's host stand-in
    (BYTECOMP_INTRA_NODE=host) runs the real optimizer through it."""

    def current_stream(self):
        return "current"

    def side_stream(self):
        return "side"

    def new_event(self):
        return None

    def record(self, event, stream):
        pass

    def wait_event(self, stream, event):
        pass

    def query(self, event):
        return True

    def synchronize(self, event):
        pass

    def copy_async(self, dst, src, stream):
        dst.copy_(src)

    def zeros(self, count, like):  # ShardFlow's padded buffers
        import torch
        return torch.zeros(count, dtype=like.dtype)


class TorchCudaOps(StreamOps):
    """StreamOps over torch.cuda for one device."""

    def __init__(self, device):
        import torch
        self._torch = torch
        self.device = device
        self._side = torch.cuda.Stream(device=device)

    def current_stream(self):
        return self._torch.cuda.current_stream(self.device)

    def side_stream(self):
        return self._side

    def new_event(self):
        return self._torch.cuda.Event()

    def record(self, event, stream):
        event.record(stream)

    def wait_event(self, stream, event):
        stream.wait_event(event)

    def query(self, event):
        return event.query()

    def synchronize(self, event):
        event.synchronize()

    def zeros(self, count, like):  # ShardFlow's padded buffers
        return self._torch.zeros(count, dtype=like.dtype, device=self.device)

    def copy_async(self, dst, src, stream):
        with self._torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        if src.is_cuda:
            src.record_stream(stream)  # the allocator must not reuse it early
        if dst.is_cuda:
            dst.record_stream(stream)


class StagedSlot:
    """One staged tensor: its host buffer, its events and its daemon handle."""

    __slots__ = ("key", "host", "ready", "d2h", "h2d", "handle", "state", "encode", "shard")

    IDLE, COPYING, PUSHED, RETURNING = "idle", "copying", "pushed", "returning"

    def __init__(self, key, host, ops):
        self.key = key
        self.host = host
        self.ready = ops.new_event()
        self.d2h = ops.new_event()
        self.h2d = ops.new_event()
        self.handle = None
        self.state = StagedSlot.IDLE
        # GPU placement (docs/gpu.md §2): encode(grad, stream) enqueues the
        # compression on the device and the d2h copies of the payloads into
        # `host` on `stream`, instead of the dense copy; the hand-off then
        # pushes compressed. None: dense (the daemon compresses, if at all).
        self.encode = None
        # The NCCL intra-node shard flow (ShardFlow) when the local ranks
        # reduce among themselves first: `host` then holds this rank's shard.
        self.shard = None


class StagingPipeline:
    """Orders the copies and the daemon hand-off (see the module docstring).

    push(key) -> handle starts the daemon's push_pull of a slot's host buffer;
    wait(key, handle) waits for it (raising on failure)."""

    def __init__(self, ops, push, wait, push_compressed=None):
        self.ops = ops
        self._push = push
        self._push_compressed = push_compressed
        self._wait = wait
        self._copying = []  # slots whose d2h copy is enqueued, not yet pushed (FIFO)
        self.host_syncs = 0  # host waits on the device (drain only), for tests and stats
        # Called with the side stream before the host waits on it, where
        # collectives may be in flight (the shard flow's bounded NCCL wait).
        self.bounded_wait = None

    def new_slot(self, key, host):
        return StagedSlot(key, host, self.ops)

    def grad_ready(self, slot, grad):
        """From the gradient hook: enqueue the d2h copy; push whatever
        earlier copies have finished. Never waits for the device."""
        if slot.state != StagedSlot.IDLE:
            raise RuntimeError("staging: gradient %r staged twice in one step" % (slot.key,))
        ops = self.ops
        side = ops.side_stream()
        ops.record(slot.ready, ops.current_stream())
        ops.wait_event(side, slot.ready)
        src = grad if slot.shard is None else slot.shard.before(slot.key, grad, side)
        if slot.encode is not None:
            slot.encode(src, side)
        else:
            ops.copy_async(slot.host, src, side)
        ops.record(slot.d2h, side)
        slot.state = StagedSlot.COPYING
        self._copying.append(slot)
        self.pump()

    def pump(self):
        """Pushes the slots whose d2h copy has completed, in copy order
        (the side stream runs them in that order)."""
        while self._copying and self.ops.query(self._copying[0].d2h):
            self._hand_off(self._copying.pop(0))

    def drain(self):
        """Pushes every slot still copying, waiting for its copy."""
        while self._copying:
            slot = self._copying.pop(0)
            if not self.ops.query(slot.d2h):
                self.host_syncs += 1
                if self.bounded_wait is not None:
                    self.bounded_wait(self.ops.side_stream())
                self.ops.synchronize(slot.d2h)
            self._hand_off(slot)

    def _hand_off(self, slot):
        if slot.encode is not None:
            slot.handle = self._push_compressed(slot.key)
        else:
            slot.handle = self._push(slot.key)
        slot.state = StagedSlot.PUSHED

    def copy_back(self, slot, grad):
        """Waits for the daemon's sum of `slot` and enqueues host -> grad."""
        if slot.state != StagedSlot.PUSHED:
            raise RuntimeError("staging: copy_back of %r in state %s" % (slot.key, slot.state))
        h, slot.handle = slot.handle, None
        self._wait(slot.key, h)
        ops = self.ops
        side = ops.side_stream()
        if slot.shard is None:
            ops.copy_async(grad, slot.host, side)
        else:
            ops.copy_async(slot.shard.shard(slot.key), slot.host, side)
            slot.shard.after(slot.key, grad, side)
        ops.record(slot.h2d, side)
        slot.state = StagedSlot.RETURNING

    def finish(self, slots):
        """The compute stream waits for the returned gradients (device side)."""
        ops = self.ops
        cur = ops.current_stream()
        for slot in slots:
            if slot.state == StagedSlot.RETURNING:
                ops.wait_event(cur, slot.h2d)
                slot.state = StagedSlot.IDLE

    def abandon(self):
        """After a failure: forget in-flight state (the job is broken)."""
        self._copying = []


def register_host_range(addrs_and_sizes, cudart=None):
    """Page-locks the smallest page-aligned range covering the buffers, once
    (cudaHostRegister, flags 0 = portable not needed: one device per
    process). Returns (base, nbytes), to pass to unregister_host_range."""
    if not addrs_and_sizes:
        return None
    page = 4096
    lo = min(a for a, _ in addrs_and_sizes) // page * page
    hi = max(a + n for a, n in addrs_and_sizes)
    hi = (hi + page - 1) // page * page
    if cudart is None:
        import torch
        cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(lo, hi - lo, 0)
    if int(rc) != 0:
        raise RuntimeError("cudaHostRegister of the job's shared memory (%d bytes at 0x%x) "
                           "failed: cudaError %d" % (hi - lo, lo, int(rc)))
    return (lo, hi - lo)


def unregister_host_range(region, cudart=None):
    if region is None:
        return
    if cudart is None:
        import torch
        cudart = torch.cuda.cudart()
    cudart.cudaHostUnregister(region[0])
