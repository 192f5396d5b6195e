"""bytecomp.torch's control job: init()/shutdown(), the process's context
(settings, the control job's scratch tensors), the exact sums allreduce()
of metrics runs through, and the daemons' broadcast and barrier operations
(bytecomp_broadcast, bytecomp_barrier) every broadcast* and barrier() runs
through. Internal: use it through bytecomp.torch."""

import atexit
import bisect
import concurrent.futures
import ctypes
import errno
import os
import threading
import time

import numpy as np
import torch

from bytecomp import _lib
from bytecomp._lib import BytecompError
from bytecomp.env import Settings

# Elements of the control job's scratch tensor: 2 MiB per process on one
# node (float64), 1 MiB across nodes (float32).
_SCRATCH_ELEMENTS = 1 << 18
# Broadcasts go through two scratch tensors of this many bytes each (one
# chunk in flight on each, so copying one overlaps sending the other).
_BCAST_BYTES = 4 << 20
_BCAST_NAMES = ("bytecomp.broadcast.0", "bytecomp.broadcast.1")
# Marks the daemons' and servers' message about disagreeing ranks.
_DISAGREE = "the ranks disagree"
# check_same() compares values through sums of 4-bit digits and their
# squares: exact in float32 for up to 2**24 / 225 processes.
_DIGIT_BITS = 4
# Bound on one blocking C wait, so Ctrl-C (KeyboardInterrupt) is seen
# promptly; the overall bound is BYTECOMP_TIMEOUT_MS.
_WAIT_SLICE_MS = 500

_TORCH_TO_C = {
    torch.float32: _lib.FLOAT32,
    torch.float64: _lib.FLOAT64,
    torch.int32: _lib.INT32,
    torch.int64: _lib.INT64,
}
_ELEMENT_BYTES = {torch.float32: 4, torch.float64: 8, torch.int32: 4, torch.int64: 8}


class NotInitializedError(RuntimeError):
    """A bytecomp.torch call before init() or after shutdown()."""


class MismatchError(_lib.InvalidArgumentError):
    """The processes of the job passed different arguments to the same
    collective call (names, shapes, dtypes, roots, ops). A RuntimeError, as
    Horovod raises, and a ValueError, as this package raised before. Raised
    on every rank; the job goes on (the next calls work)."""

    def __init__(self, message):
        super().__init__("BYTECOMP_ERR_INVALID_ARGUMENT", message)


# The daemon's and the coordinator's refusal of a job id whose previous job
# has not ended yet (daemon/daemon.cc, server/coordinator.cc).
_STILL_RUNNING = "is already running"
# No daemon at the socket (client/src/client.cc): between a daemon's death
# and its restart by systemd, which an elastic restart of the workers can
# overtake.
_NO_DAEMON = "cannot connect to bytecompd"
# ... but only where a daemon may yet come: no socket file (ENOENT), a stale
# one (ECONNREFUSED) or a full backlog (EAGAIN). A path that cannot work
# (ENOTDIR, EACCES, a name too long) is the caller's to fix: refused at once.
_NO_DAEMON_YET = tuple(os.strerror(e) for e in (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN))
# Pauses between init()'s attempts to join while the previous job of the
# same id is still ending: doubling from the first to the last (each refusal
# is a warning in the daemon's log), bounded by BYTECOMP_START_TIMEOUT_MS.
_REJOIN_PAUSE_S = (0.02, 0.32)


def _shm_tensor(addr, nbytes, dtype, shape=None):
    """A torch tensor viewing shared memory at `addr` (no copy). The memory
    stays valid until the owning client is closed."""
    buf = (ctypes.c_char * nbytes).from_address(addr)
    t = torch.frombuffer(buf, dtype=dtype)
    return t.view(shape) if shape is not None else t


_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _as_bytes(t):
    """A tensor's bytes as a flat uint8 tensor (a copy)."""
    return t.detach().contiguous().reshape(-1).clone().view(torch.uint8)


def wait_future(fut):
    """The result of a control-job Future. The call behind it is bounded
    (each of its C waits by BYTECOMP_TIMEOUT_MS), so this ends; it waits in
    slices so that Ctrl-C is seen."""
    while True:
        try:
            return fut.result(timeout=_WAIT_SLICE_MS / 1000.0)
        except concurrent.futures.TimeoutError:
            continue


def _wait(client, handle, timeout_ms, what, *what_args):
    """Waits for one push_pull within timeout_ms, in slices so that signals
    (Ctrl-C) are handled; raises BytecompTimeout naming `what % what_args`
    (formatted only then: this is the per-tensor hot path)."""
    left = timeout_ms
    while left > 0:
        step = left if left < _WAIT_SLICE_MS else _WAIT_SLICE_MS
        if client.wait_once(handle, step):
            return
        left -= step
    raise _lib.BytecompTimeout(
        "BYTECOMP_ERR_TIMEOUT",
        "%s did not finish within BYTECOMP_TIMEOUT_MS=%d ms: another process of the job is "
        "stuck or far behind (every process must run the same steps)" %
        (what % what_args, timeout_ms))


class _Context:
    """Process-wide state between init() and shutdown(). Guarded by _ctx_lock for
    creation/teardown; the operations themselves run on the caller's thread."""

    def __init__(self, settings):
        self.settings = settings
        self.ctl = None
        self.scratch = None
        self.bcast = []
        # Iterations start at 0 and follow each other (the parameter servers
        # collect iteration i + 1 after i).
        self.ctl_iteration = 0
        # The parameter servers sum float32 only; one node keeps float64 so
        # allreduce() of metrics is exact there.
        self.dtype = torch.float32 if settings.num_nodes > 1 else torch.float64
        self.optimizers = []
        self.next_optimizer = 0
        self.failed = False
        # The worker thread every collective of the control job runs on (see
        # submit()); created on first use.
        self._executor = None
        self._executor_lock = threading.Lock()
        self._worker = None
        ctl = _lib.Client(settings.job_id + ".ctl", settings.local_rank, settings.local_size,
                          settings.node_rank, settings.num_nodes, settings.socket_path,
                          connect_timeout_ms=min(settings.timeout_ms, 60000))
        try:
            tid = ctl.declare("bytecomp.control", _SCRATCH_ELEMENTS, _TORCH_TO_C[self.dtype])
            btids = [ctl.declare(n, _BCAST_BYTES // 4, _lib.FLOAT32) for n in _BCAST_NAMES]
            ctl.start(settings.start_timeout_ms)
            addr, nbytes = ctl.buffer(tid)
            self.bcast = []
            for b in btids:
                baddr, bbytes = ctl.buffer(b)
                self.bcast.append((b, _shm_tensor(baddr, bbytes, torch.uint8)))
        except _lib.InvalidArgumentError as e:
            ctl.close()
            if "bytecomp.control" not in e.message:
                raise
            raise _lib.InvalidArgumentError(
                e.status, e.message + "; bytecomp.torch's control tensor 'bytecomp.control' "
                "must stay uncompressed: give the daemons' strategy a first rule "
                "'- match: \"bytecomp.*\"' with 'option: {compressor: none}' (docs/torch.md)"
            ) from None
        except BaseException:
            ctl.close()
            raise
        self.ctl = ctl
        self.ctl_tensor = tid
        self.scratch = _shm_tensor(addr, nbytes, self.dtype)
        self.bcast_iteration = [0] * len(self.bcast)
        try:
            self.probe()
        except BaseException:
            self.scratch = None
            self.bcast = []
            ctl.close()
            raise

    def probe(self):
        """Checks that the control job's sums are exact: a strategy that
        compresses 'bytecomp.control' (the daemons refuse that for float64,
        not for float32 across nodes) would silently corrupt broadcasts.
        Rank 0 contributes 16-bit digits, the others 1 each."""
        n = _SCRATCH_ELEMENTS
        pattern = (torch.arange(n, dtype=torch.int64) * 7919 % 65536).to(self.dtype)
        flat = pattern.clone() if self.settings.rank == 0 else torch.ones(n, dtype=self.dtype)
        self.sum_flat(flat, True, "init (control job check)")
        if not torch.equal(flat, pattern + (self.settings.size - 1)):
            bad = int((flat != pattern + (self.settings.size - 1)).sum())
            self.failed = True
            raise _lib.InvalidArgumentError(
                "BYTECOMP_ERR_INVALID_ARGUMENT",
                "init: the daemons' sums of bytecomp.torch's control tensor 'bytecomp.control' "
                "are not exact (%d of %d elements differ): their strategy compresses it; give "
                "the strategy a first rule '- match: \"bytecomp.*\"' with 'option: "
                "{compressor: none}' (docs/torch.md)" % (bad, n))

    def sum_flat(self, flat, contribute, what):
        """Sums the vector `flat` (of the scratch dtype) over every process, in
        place, through the scratch tensor. contribute=False adds zeros."""
        n = flat.numel()
        off = 0
        while off < n:
            k = min(n - off, _SCRATCH_ELEMENTS)
            chunk = self.scratch[:k]
            if contribute:
                chunk.copy_(flat[off:off + k])
            else:
                chunk.zero_()
            try:
                h = self.ctl.push_pull(self.ctl_tensor, self.ctl_iteration)
                self.ctl_iteration += 1
                _wait(self.ctl, h, self.settings.timeout_ms, "%s", what)
            except BytecompError:
                self.failed = True  # no exit barrier: the job is broken
                raise
            flat[off:off + k].copy_(chunk)
            off += k

    def broadcast_bytes(self, data, count, root_rank, tag, what):
        """Returns root_rank's `count` bytes (`data`, a flat uint8 tensor, on
        the root; ignored elsewhere) on every rank (see broadcast_into)."""
        is_root = self.settings.rank == root_rank
        out = data if is_root else torch.empty(count, dtype=torch.uint8)
        self.broadcast_into([out] if count else [], count, root_rank, tag, what)
        return out

    def broadcast_into(self, segments, count, root_rank, tag, what):
        """Copies root_rank's bytes into every rank's `segments` (flat uint8
        CPU tensors, `count` bytes in all, in order: read on the root,
        written elsewhere) through the daemons' broadcast (raw bytes, sent
        once from the root's node), in chunks of the scratch tensors, two in
        flight. Each chunk goes straight between the segments and the shared
        memory: no staging copy of the whole. Every rank passes the same
        count, root and tag; where they differ every rank raises ValueError."""
        is_root = self.settings.rank == root_rank
        chunk = _BCAST_BYTES
        inflight = []
        # The segments as (first byte, tensor), walked in order by copy().
        starts = []
        pos = 0
        for seg in segments:
            starts.append(pos)
            pos += seg.numel()
        if pos != count:
            raise ValueError("%s: segments of %d bytes for a broadcast of %d" % (what, pos, count))

        def copy(buf, off, k, into_segments):
            i = bisect.bisect_right(starts, off) - 1
            done = 0
            while done < k:
                seg, s0 = segments[i], starts[i]
                a = off + done - s0
                n = min(seg.numel() - a, k - done)
                if n > 0:
                    if into_segments:
                        seg[a:a + n].copy_(buf[done:done + n])
                    else:
                        buf[done:done + n].copy_(seg[a:a + n])
                done += max(n, 0)
                i += 1

        def finish():
            slot, h, off, k = inflight.pop(0)
            _wait(self.ctl, h, self.settings.timeout_ms, "%s", what)
            if not is_root and k:
                copy(self.bcast[slot][1], off, k, True)

        try:
            n = max(1, (count + chunk - 1) // chunk)
            for i in range(n):
                slot = i % len(self.bcast)
                if len(inflight) == len(self.bcast):
                    finish()
                off = i * chunk
                k = min(chunk, count - off)
                tid, buf = self.bcast[slot]
                if is_root and k:
                    copy(buf, off, k, False)
                h = self.ctl.broadcast(tid, self.bcast_iteration[slot], root_rank, k, tag)
                self.bcast_iteration[slot] += 1
                inflight.append((slot, h, off, k))
            while inflight:
                finish()
        except BytecompError as e:
            self.failed = True  # no exit barrier: the job is broken
            if _DISAGREE in e.message:
                raise MismatchError("%s: the processes passed different arguments (this rank "
                                    "passed %d bytes from root rank %d): %s" %
                                    (what, count, root_rank, e.message)) from None
            raise

    def barrier(self, what):
        """Returns once every process of the job entered it (the daemons'
        barrier: through the coordinator across nodes)."""
        try:
            h = self.ctl.barrier()
            _wait(self.ctl, h, self.settings.timeout_ms, "%s", what)
        except BytecompError:
            self.failed = True
            raise

    def check_same(self, signature, count, what):
        """Fails on every rank unless all ranks passed the same (signature,
        count): for each 4-bit digit v, sum(v) == n*v and sum(v*v) == n*v*v
        hold for all ranks only when every rank's v is equal (Cauchy-Schwarz);
        the sums are small integers, exact in float32 and float64."""
        word = ((signature & 0xFFFFFFFF) << 32) | (count & 0xFFFFFFFF)
        digits = [float((word >> k) & ((1 << _DIGIT_BITS) - 1)) for k in range(0, 64, _DIGIT_BITS)]
        mine = torch.tensor(digits + [d * d for d in digits], dtype=self.dtype)
        flat = mine.clone()
        self.sum_flat(flat, True, what)
        ok = torch.equal(flat, mine * self.settings.size)
        if not ok:
            raise MismatchError(
                "%s: the processes passed different tensors (names, shapes, dtypes or number "
                "of elements differ; this rank passed %d elements): every rank must pass the "
                "same set in the same order" % (what, count))

    # -- order of the collectives ------------------------------------------
    def submit(self, fn):
        """Runs fn() on this context's one worker thread after every call
        submitted before it and returns its Future. Every collective of the
        control job runs there (the synchronous ones wait for it), so each
        rank issues them in the order its program called them, also while
        async calls are pending (ranks issuing them in different orders
        would sum different tensors together). A call made on the worker
        itself (a collective built from others) runs at once."""
        if threading.current_thread() is self._worker:
            f = concurrent.futures.Future()
            try:
                f.set_result(fn())
            except BaseException as e:  # handed to the caller through the Future
                f.set_exception(e)
            return f
        with self._executor_lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="bytecomp-ctl", initializer=self._mark_worker)
            return self._executor.submit(fn)

    def _mark_worker(self):
        self._worker = threading.current_thread()

    def call(self, fn):
        """submit(fn) and its result (or its exception)."""
        return wait_future(self.submit(fn))

    def stop_worker(self):
        """Lets queued calls finish (each is bounded by BYTECOMP_TIMEOUT_MS
        per wait) and ends the worker thread."""
        with self._executor_lock:
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)

    # -- exact sums in the tensor's own dtype --------------------------------
    def sum_exact(self, flat, what):
        """A new 1-D tensor of flat's dtype: the sum of `flat` over every
        process, exact in that dtype (integers wrap as in their own type):
        integers travel as digits whose sums are exact in the scratch dtype
        (the parameter servers sum float32 only), float64 across nodes is
        gathered and summed here in rank order (float32 would round it),
        other floats are summed in the scratch dtype (at least their own
        precision) and rounded once."""
        dt = flat.dtype
        if dt in _INT_DTYPES:
            return self._sum_integers(flat, what).to(dt)
        if dt == torch.float64 and self.dtype != torch.float64:
            parts = self.gather_bytes(_as_bytes(flat), what)
            out = parts[0].view(torch.float64).clone()
            for p in parts[1:]:
                out += p.view(torch.float64)
            return out
        work = flat.to(self.dtype, copy=True)
        self.sum_flat(work, True, what)
        return work.to(dt)

    def _digit_bits(self, what):
        n = self.settings.size
        mantissa = 53 if self.dtype == torch.float64 else 24
        for bits in (16, 8):
            if n * ((1 << bits) - 1) < (1 << mantissa):
                return bits
        raise _lib.UnsupportedError(
            "BYTECOMP_ERR_UNSUPPORTED",
            "%s: an exact integer sum over %d processes needs sums of 8-bit digits above "
            "2**%d, which the %s control tensor cannot hold" % (what, n, mantissa, self.dtype))

    def _sum_integers(self, flat, what):
        """The int64 sum (mod 2**64) of an integer tensor: its two's-complement
        bits cut into digits of 16 (or 8) bits, each digit summed as a float
        (exact: every partial sum is an integer below 2**24, in any order, on
        any path), then recombined with carries in uint64 (numpy's unsigned
        arithmetic wraps by definition, as int64 sums do in Horovod). Only
        the digits that reach the dtype's width travel."""
        bits = self._digit_bits(what)
        width = torch.empty(0, dtype=flat.dtype).element_size() * 8
        k = (width + bits - 1) // bits
        n = flat.numel()
        v = flat.to(torch.int64).contiguous().numpy().view(np.uint64)
        mask = np.uint64((1 << bits) - 1)
        digits = np.empty((k, n), dtype=np.float64)
        for j in range(k):
            digits[j] = (v >> np.uint64(bits * j)) & mask
        work = torch.from_numpy(digits.reshape(-1)).to(self.dtype)
        self.sum_flat(work, True, what)
        sums = work.to(torch.float64).numpy().reshape(k, n).astype(np.uint64)
        out = np.zeros(n, dtype=np.uint64)
        for j in range(k):
            out += sums[j] << np.uint64(bits * j)
        return torch.from_numpy(out.view(np.int64))

    def gather_bytes(self, data, what):
        """Every rank's bytes (a flat uint8 tensor, any length per rank), as
        a list in rank order, on every rank: the lengths through an exact
        integer sum (each rank fills its own slot), then one broadcast from
        each rank."""
        n = self.settings.size
        lengths = torch.zeros(n, dtype=torch.int64)
        lengths[self.settings.rank] = data.numel()
        lengths = self._sum_integers(lengths, what)
        parts = []
        for r in range(n):
            count = int(lengths[r])
            got = self.broadcast_bytes(data if r == self.settings.rank else None, count, r,
                                       count, what)
            parts.append(got.clone() if r == self.settings.rank else got)
        return parts


_ctx = None
_ctx_lock = threading.Lock()
_hooks_installed = []
# Called by shutdown() once the control job is closed (async handles die
# with it: _collectives registers its cleanup here).
_on_shutdown = []


def _ctx_or_raise(call):
    c = _ctx
    if c is None:
        raise NotInitializedError("bytecomp.torch.%s() called before bytecomp.torch.init()" % call)
    return c


def init():
    """Joins the job described by the environment (bytecomp.env). Idempotent.
    Raises EnvironmentConfigError for missing/inconsistent variables and a
    BytecompError subclass when the daemon cannot be reached or the other
    local processes do not join within BYTECOMP_START_TIMEOUT_MS."""
    global _ctx
    with _ctx_lock:
        if _ctx is not None:
            return
        settings = Settings.from_environ()
        _ctx = _join(settings)
        if not _hooks_installed:
            _hooks_installed.append(True)
            atexit.register(shutdown)


def _join(settings):
    """The context of a new control job. After shutdown() on this rank, a
    peer may still be leaving the previous job of the same id (its daemon,
    or the coordinator, still lists it): Horovod's `shutdown(); init()`
    works, so wait for it to end, within BYTECOMP_START_TIMEOUT_MS, instead
    of failing at once. The same for a node daemon that is not there (yet):
    after an elastic restart (torchrun --max_restarts) caused by its death,
    the new workers may start before systemd has restarted it."""
    deadline = time.monotonic() + settings.start_timeout_ms / 1000.0
    pause = _REJOIN_PAUSE_S[0]
    while True:
        try:
            return _Context(settings)
        except _lib.BytecompError as e:
            waited = {_STILL_RUNNING: "for it to end", _NO_DAEMON: "for a daemon to answer"}
            why = next((w for k, w in waited.items() if k in e.message), None)
            if why is not None and _NO_DAEMON in e.message and \
                    not any(s in e.message for s in _NO_DAEMON_YET):
                why = None
            if why is None or time.monotonic() >= deadline:
                if why is not None:
                    raise type(e)(e.status, "%s (init() waited BYTECOMP_START_TIMEOUT_MS=%d ms "
                                  "%s)" % (e.message, settings.start_timeout_ms, why)) \
                        from None
                raise
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, _REJOIN_PAUSE_S[1])


def is_initialized():
    return _ctx is not None


def rank():
    return _ctx_or_raise("rank").settings.rank


def size():
    return _ctx_or_raise("size").settings.size


def local_rank():
    return _ctx_or_raise("local_rank").settings.local_rank


def local_size():
    return _ctx_or_raise("local_size").settings.local_size


def node_rank():
    return _ctx_or_raise("node_rank").settings.node_rank


def num_nodes():
    return _ctx_or_raise("num_nodes").settings.num_nodes


def shutdown(barrier=False):
    """Leaves every job of this process; called automatically at exit.
    Gradients are copied out of shared memory first, so param.grad stays
    usable. A process that has waited for everything it pushed (step()
    does) leaves without disturbing peers still reading their last results
    (the daemon's clean close), so no exit barrier is needed; barrier=True
    still waits (within BYTECOMP_TIMEOUT_MS) until every process called
    shutdown. A process leaving with a sum still in flight, or while peers
    wait for its part, aborts the job for them (they raise at once)."""
    global _ctx
    with _ctx_lock:
        c = _ctx
        if c is None:
            return
        c.stop_worker()
        if barrier and not c.failed:
            try:
                c.barrier("shutdown")  # here, not on the worker: at exit it is gone
            except BytecompError:
                pass  # the job already ended (a peer failed): just leave
        # overlap_forward: the sums the last step() left in flight are waited
        # for and applied (leaving with one in flight would abort the job for
        # the peers); a failure is raised once everything is closed.
        drain_error = None
        for opt in list(c.optimizers):
            try:
                opt._bytecomp_drain_for_close()
            except BytecompError as e:
                drain_error = drain_error or e
        for opt in list(c.optimizers):
            opt._bytecomp_detach()
        c.optimizers.clear()
        c.scratch = None
        c.bcast = []
        c.ctl.close()
        _ctx = None
        for fn in _on_shutdown:
            fn()
    if drain_error is not None:
        raise drain_error


def _barrier(c):
    c.call(lambda: c.barrier("barrier"))


def barrier():
    """Returns once every process of the job has called barrier()."""
    _barrier(_ctx_or_raise("barrier"))
