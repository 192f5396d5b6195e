"""PyTorch integration, shaped like Horovod's and BytePS's APIs.

    import bytecomp.torch as bc
    bc.init()                                   # reads RANK, WORLD_SIZE, ... (bytecomp.env)
    model = Net()
    bc.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * bc.size())
    opt = bc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  strategy="configs/demo-strategy.yaml")
    bc.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()         # each gradient is pushed when ready
        opt.step()                              # waits for the rest, averages, steps

How it maps onto the thin client (docs/torch.md):
- `init()` joins a small *control job* ("<job>.ctl") with one scratch
  tensor (float64 on one node; float32 across nodes, the only dtype the
  parameter servers sum); broadcasts, `allreduce()` and `barrier()` run
  through it as sums. A broadcast is a sum in which every rank but the root
  contributes zeros; its bytes travel as 16-bit digits (0..65535, exact in
  either dtype), so every dtype arrives bit for bit.
- Each `DistributedOptimizer` joins its own job ("<job>.opt0", ".opt1", ...)
  declaring every parameter's gradient in parameter order (first declared =
  first needed by the next forward pass = highest priority). Gradients live
  in that job's shared memory: `param.grad` *is* the buffer the daemon reads
  and writes, so autograd accumulates into it and nothing is copied.
- A hook on each parameter's gradient accumulator pushes the gradient as soon
  as backward has produced it; `step()` pushes what backward did not touch,
  waits for everything (bounded by BYTECOMP_TIMEOUT_MS) and divides by size().

Thread-safety: the module-level API is meant for the training thread. Hooks
run on autograd's thread (the caller's thread for CPU tensors).
"""

import atexit
import ctypes
import pickle
import struct
import threading
import zlib

import torch

from bytecomp import _lib
from bytecomp._lib import BytecompError, StateError
from bytecomp.env import Settings
from bytecomp import strategy as _strategy

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "node_rank", "num_nodes", "DistributedOptimizer", "broadcast_parameters",
    "broadcast_optimizer_state", "broadcast_object", "broadcast", "allreduce", "barrier",
    "Average", "Sum", "NotInitializedError", "BytecompError",
]

Average = "average"
Sum = "sum"

# Elements of the control job's scratch tensor: 2 MiB per process on one
# node (float64), 1 MiB across nodes (float32).
_SCRATCH_ELEMENTS = 1 << 18
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


def _shm_tensor(addr, nbytes, dtype, shape=None):
    """A torch tensor viewing shared memory at `addr` (no copy). The memory
    stays valid until the owning client is closed."""
    buf = (ctypes.c_char * nbytes).from_address(addr)
    t = torch.frombuffer(buf, dtype=dtype)
    return t.view(shape) if shape is not None else t


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
        # Iterations start at 0 and follow each other (the parameter servers
        # collect iteration i + 1 after i).
        self.ctl_iteration = 0
        # The parameter servers sum float32 only; one node keeps float64 so
        # allreduce() of metrics is exact there.
        self.dtype = torch.float32 if settings.num_nodes > 1 else torch.float64
        self.optimizers = []
        self.next_optimizer = 0
        self.failed = False
        ctl = _lib.Client(settings.job_id + ".ctl", settings.local_rank, settings.local_size,
                          settings.node_rank, settings.num_nodes, settings.socket_path,
                          connect_timeout_ms=min(settings.timeout_ms, 60000))
        try:
            tid = ctl.declare("bytecomp.control", _SCRATCH_ELEMENTS, _TORCH_TO_C[self.dtype])
            ctl.start(settings.start_timeout_ms)
            addr, nbytes = ctl.buffer(tid)
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
        try:
            self.probe()
        except BaseException:
            self.scratch = None
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
            raise ValueError(
                "%s: the processes passed different tensors (names, shapes, dtypes or number "
                "of elements differ; this rank passed %d elements): every rank must pass the "
                "same set in the same order" % (what, count))


_ctx = None
_ctx_lock = threading.Lock()
_hooks_installed = []


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
        _ctx = _Context(settings)
        if not _hooks_installed:
            _hooks_installed.append(True)
            atexit.register(shutdown)


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
        if barrier and not c.failed:
            try:
                _barrier(c)
            except BytecompError:
                pass  # the job already ended (a peer failed): just leave
        for opt in list(c.optimizers):
            opt._bytecomp_detach()
        c.optimizers.clear()
        c.scratch = None
        c.ctl.close()
        _ctx = None


def _barrier(c):
    flat = torch.zeros(1, dtype=c.dtype)
    c.sum_flat(flat, True, "barrier")


def barrier():
    """Returns once every process of the job has called barrier()."""
    _barrier(_ctx_or_raise("barrier"))


_BROADCAST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                     torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def _tensor_bytes(t):
    """The tensor's bytes (a flat uint8 tensor, a copy)."""
    if t.dtype not in _BROADCAST_DTYPES:
        raise TypeError("bytecomp.torch: cannot broadcast a tensor of dtype %s" % t.dtype)
    flat = t.detach().reshape(-1).clone()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8)


def _broadcast_bytes(c, data, count, is_root, what):
    """Returns the root's `count` bytes (a uint8 tensor) on every rank: the
    root contributes them as 16-bit digits, the others zeros, so the sum is
    exact whatever the scratch dtype."""
    if count == 0:
        return torch.empty(0, dtype=torch.uint8)
    padded = count + (count & 1)
    if is_root:
        b = torch.zeros(padded, dtype=torch.uint8)
        b[:count] = data
        b = b.to(torch.int32)
        flat = (b[0::2] + 256 * b[1::2]).to(c.dtype)
    else:
        flat = torch.empty(padded // 2, dtype=c.dtype)
    c.sum_flat(flat, is_root, what)
    if is_root:
        return data
    words = flat.to(torch.int32)
    out = torch.empty(padded, dtype=torch.uint8)
    out[0::2] = (words & 0xFF).to(torch.uint8)
    out[1::2] = (words >> 8).to(torch.uint8)
    return out[:count]


def _named_tensors(params, what):
    if isinstance(params, dict):
        items = list(params.items())
    else:
        items = list(params)
    out = []
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            name, t = "[%d]" % i, item
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            name, t = item
        else:
            raise TypeError("%s: expected a state_dict, or an iterable of (name, tensor) pairs "
                            "or tensors; item %d is a %s" % (what, i, type(item).__name__))
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: entry %r is a %s, not a tensor" % (what, name, type(t).__name__))
        if t.device.type != "cpu":
            raise _lib.UnsupportedError(
                "BYTECOMP_ERR_UNSUPPORTED",
                "%s: tensor %r is on %s; this release handles CPU tensors only" %
                (what, name, t.device))
        out.append((str(name), t))
    return out


def _broadcast_tensors(c, named, root_rank, what):
    """Broadcasts the tensors in place from root_rank, bit for bit."""
    if not isinstance(root_rank, int) or not 0 <= root_rank < c.settings.size:
        raise ValueError("%s: root_rank=%r is not a rank (0..%d)" %
                         (what, root_rank, c.settings.size - 1))
    sig = zlib.crc32(repr([(n, tuple(t.shape), str(t.dtype)) for n, t in named]).encode())
    count = sum(t.numel() for _, t in named)
    c.check_same(sig, count, what)
    if count == 0:
        return
    for name, t in named:
        if t.dtype not in _BROADCAST_DTYPES:
            raise TypeError("%s: cannot broadcast tensor %r of dtype %s" % (what, name, t.dtype))
    is_root = c.settings.rank == root_rank
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    data = torch.cat([_tensor_bytes(t) for _, t in named]) if is_root else None
    data = _broadcast_bytes(c, data, nbytes, is_root, what)
    if not is_root:
        off = 0
        with torch.no_grad():
            for _, t in named:
                k = t.numel() * t.element_size()
                raw = data[off:off + k].clone()  # aligned for view()
                if t.dtype == torch.bool:
                    v = raw.to(torch.bool)
                else:
                    v = raw.view(t.dtype)
                t.copy_(v.view(t.shape))
                off += k


def broadcast_parameters(params, root_rank=0):
    """Copies root_rank's values into every process's tensors, in place.
    `params`: a state_dict (model.state_dict()), or an iterable of (name,
    tensor) pairs (model.named_parameters()) or of tensors. Every process
    must pass the same names, shapes and dtypes in the same order."""
    c = _ctx_or_raise("broadcast_parameters")
    _broadcast_tensors(c, _named_tensors(params, "broadcast_parameters"), root_rank,
                       "broadcast_parameters")


def broadcast(tensor, root_rank=0, name="tensor"):
    """Broadcasts one tensor in place from root_rank and returns it."""
    c = _ctx_or_raise("broadcast")
    _broadcast_tensors(c, _named_tensors([(name, tensor)], "broadcast"), root_rank, "broadcast")
    return tensor


def allreduce(tensor, average=True, name="tensor"):
    """Returns a new tensor holding the sum (average=True: mean) of `tensor`
    over every process. Meant for metrics, not gradients (use
    DistributedOptimizer for those); sums run in float64 on one node and in
    float32 across nodes (the parameter servers sum float32)."""
    c = _ctx_or_raise("allreduce")
    named = _named_tensors([(name, tensor)], "allreduce")
    if tensor.dtype not in _BROADCAST_DTYPES:
        raise TypeError("allreduce: cannot sum a tensor of dtype %s" % tensor.dtype)
    c.check_same(zlib.crc32(repr((tuple(tensor.shape), str(tensor.dtype))).encode()),
                 tensor.numel(), "allreduce")
    flat = tensor.detach().reshape(-1).to(c.dtype).clone()
    c.sum_flat(flat, True, "allreduce")
    if average:
        flat /= c.settings.size
    out_dtype = tensor.dtype if tensor.is_floating_point() else torch.float64
    return flat.view(named[0][1].shape).to(out_dtype)


def broadcast_object(obj, root_rank=0):
    """Returns root_rank's `obj` (any picklable object) in every process."""
    c = _ctx_or_raise("broadcast_object")
    if not isinstance(root_rank, int) or not 0 <= root_rank < c.settings.size:
        raise ValueError("broadcast_object: root_rank=%r is not a rank (0..%d)" %
                         (root_rank, c.settings.size - 1))
    is_root = c.settings.rank == root_rank
    data = pickle.dumps(obj) if is_root else b""

    def as_tensor(b):
        return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else \
            torch.empty(0, dtype=torch.uint8)
    length = _broadcast_bytes(c, as_tensor(struct.pack("<Q", len(data))) if is_root else None,
                              8, is_root, "broadcast_object")
    n = struct.unpack("<Q", bytes(length.tolist()))[0]
    got = _broadcast_bytes(c, as_tensor(data) if is_root else None, n, is_root,
                           "broadcast_object")
    if is_root:
        return obj
    return pickle.loads(got.numpy().tobytes())


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Makes every process's optimizer state (hyperparameters of each param
    group and per-parameter state such as momentum buffers) equal to
    root_rank's. Processes whose state is still empty get root's."""
    c = _ctx_or_raise("broadcast_optimizer_state")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("broadcast_optimizer_state: expected a torch.optim.Optimizer, got %s" %
                        type(optimizer).__name__)
    is_root = c.settings.rank == root_rank
    sd = optimizer.state_dict()
    # The structure travels pickled with tensors replaced by placeholders;
    # the tensors then travel through the tensor path (no pickle bloat).
    tensors = []

    def strip(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return ("__bytecomp_tensor__", len(tensors) - 1, tuple(x.shape), str(x.dtype))
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(strip(v) for v in x)
        return x

    skeleton = strip(sd) if is_root else None
    n_groups = len(sd["param_groups"])
    sizes = [len(g["params"]) for g in sd["param_groups"]]
    skeleton = broadcast_object((skeleton, n_groups, sizes), root_rank)
    skel, root_groups, root_sizes = skeleton
    if (root_groups, root_sizes) != (n_groups, sizes):
        raise ValueError(
            "broadcast_optimizer_state: rank %d's optimizer has param groups of sizes %s, "
            "root rank %d's has %s: build the same optimizer on every rank" %
            (c.settings.rank, sizes, root_rank, root_sizes))
    specs = []

    def collect(x):
        if isinstance(x, tuple) and len(x) == 4 and x[0] == "__bytecomp_tensor__":
            specs.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(skel)
    specs.sort(key=lambda s: s[1])
    if is_root:
        named = [("state[%d]" % i, t) for i, t in enumerate(tensors)]
    else:
        dtypes = {str(d): d for d in (torch.float32, torch.float64, torch.float16,
                                      torch.bfloat16, torch.int64, torch.int32, torch.int16,
                                      torch.int8, torch.uint8, torch.bool)}
        named = [("state[%d]" % s[1], torch.empty(s[2], dtype=dtypes[s[3]])) for s in specs]
    _broadcast_tensors(c, named, root_rank, "broadcast_optimizer_state")
    if is_root:
        return
    by_index = {int(n[6:-1]): t for n, t in named}

    def fill(x):
        if isinstance(x, tuple) and len(x) == 4 and x[0] == "__bytecomp_tensor__":
            return by_index[x[1]]
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        return x

    optimizer.load_state_dict(fill(skel))


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's class by DistributedOptimizer()."""

    def __init__(self, params, named_parameters, strategy, backward_passes_per_step, op,
                 original):
        super(self.__class__, self).__init__(params)
        if original.state:
            self.load_state_dict(original.state_dict())
        c = _ctx_or_raise("DistributedOptimizer")
        if op not in (Average, Sum):
            raise ValueError("DistributedOptimizer: op=%r; use bytecomp.torch.Average or "
                             "bytecomp.torch.Sum" % (op,))
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError("DistributedOptimizer: backward_passes_per_step=%r must be an "
                             "integer >= 1" % (backward_passes_per_step,))
        self._bc_ctx = c
        self._bc_op = op
        self._bc_passes = backward_passes_per_step
        self._bc_timeout_ms = c.settings.timeout_ms
        self._bc_params = self._bytecomp_names(named_parameters)
        # None: whatever the daemons run (BYTECOMP_STRATEGY says what that is).
        self._bc_strategy = _strategy.load(strategy)
        self._bc_client = None
        self._bc_iteration = 0
        self._bc_synced = False  # synchronize() done, step() not yet
        self._bc_failed = None
        index = c.next_optimizer
        c.next_optimizer += 1
        self._bc_job = "%s.opt%d" % (c.settings.job_id, index)
        self._bytecomp_start()
        c.optimizers.append(self)

    # -- setup -------------------------------------------------------------
    def _bytecomp_names(self, named_parameters):
        in_groups = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            for i, item in enumerate(named):
                if not (isinstance(item, (tuple, list)) and len(item) == 2 and
                        isinstance(item[1], torch.Tensor)):
                    raise TypeError("DistributedOptimizer: named_parameters must yield (name, "
                                    "parameter) pairs, e.g. model.named_parameters(); item %d "
                                    "is %r" % (i, type(item).__name__))
            names = [n for n, _ in named]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError("DistributedOptimizer: named_parameters has duplicate names %s"
                                 % ", ".join(repr(d) for d in dup))
            name_of = {}
            for n, p in named:
                name_of.setdefault(id(p), n)  # tied weights: the first name wins
            missing = [i for i, p in enumerate(in_groups) if id(p) not in name_of]
            if missing:
                raise ValueError(
                    "DistributedOptimizer: %d of the optimizer's parameters are not in "
                    "named_parameters (the first has shape %s): pass the named_parameters "
                    "of the model whose parameters the optimizer updates" %
                    (len(missing), tuple(in_groups[missing[0]].shape)))
        else:
            name_of = {}
            k = 0
            for p in in_groups:
                if id(p) not in name_of:
                    name_of[id(p)] = "param.%d" % k
                    k += 1
        # Forward order is parameter order for nn.Modules; declare that way
        # so the daemon serves the tensors needed first with priority.
        out, seen = [], set()
        for p in in_groups:
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if p.device.type != "cpu":
                raise _lib.UnsupportedError(
                    "BYTECOMP_ERR_UNSUPPORTED",
                    "DistributedOptimizer: parameter %r is on %s; this release handles CPU "
                    "tensors only" % (name_of[id(p)], p.device))
            if p.dtype not in _TORCH_TO_C:
                raise TypeError("DistributedOptimizer: parameter %r has dtype %s; supported: "
                                "float32, float64, int32, int64" % (name_of[id(p)], p.dtype))
            if p.is_sparse or not p.is_contiguous():
                raise ValueError("DistributedOptimizer: parameter %r must be dense and "
                                 "contiguous" % (name_of[id(p)],))
            out.append((name_of[id(p)], p))
        if not out:
            raise ValueError("DistributedOptimizer: the optimizer has no parameter that "
                             "requires a gradient")
        return out

    def _bytecomp_start(self):
        c = self._bc_ctx
        s = c.settings
        client = _lib.Client(self._bc_job, s.local_rank, s.local_size, s.node_rank,
                             s.num_nodes, s.socket_path,
                             connect_timeout_ms=min(s.timeout_ms, 60000))
        try:
            ids = []
            for name, p in self._bc_params:
                ids.append(client.declare(name, p.numel(), _TORCH_TO_C[p.dtype]))
            if self._bc_strategy is not None:
                _strategy.check(self._bc_strategy,
                                [(n, p.numel() * _ELEMENT_BYTES[p.dtype])
                                 for n, p in self._bc_params])
                _strategy.apply(self._bc_strategy, client, s.strategy)
            client.start(s.start_timeout_ms)
            self._bc_slots = []
            for tid, (name, p) in zip(ids, self._bc_params):
                addr, nbytes = client.buffer(tid)
                buf = _shm_tensor(addr, nbytes, p.dtype, p.shape)
                with torch.no_grad():
                    if p.grad is not None:
                        buf.copy_(p.grad)
                    else:
                        buf.zero_()
                p.grad = buf
                self._bc_slots.append(_Slot(name, p, tid, buf))
        except BaseException:
            client.close()
            raise
        self._bc_client = client
        self._bc_hooks = []
        for slot in self._bc_slots:
            # The gradient accumulator of a leaf runs after autograd has added
            # this backward's gradient into p.grad: the moment it is ready.
            with torch.enable_grad():  # the optimizer may be built under no_grad()
                acc = slot.param.expand_as(slot.param).grad_fn.next_functions[0][0]
            acc.register_hook(self._bytecomp_hook(slot))
            self._bc_hooks.append(acc)  # keep the accumulator alive

    def _bytecomp_hook(self, slot):
        def hook(*_):
            if self._bc_client is None or self._bc_failed is not None:
                return
            slot.passes += 1
            if slot.passes > self._bc_passes:
                raise StateError(
                    "BYTECOMP_ERR_STATE",
                    "gradient of %r was computed %d times since the last step() "
                    "(backward_passes_per_step=%d): call optimizer.step() after each "
                    "backward, or raise backward_passes_per_step" %
                    (slot.name, slot.passes, self._bc_passes))
            if slot.passes == self._bc_passes:
                self._bytecomp_push(slot)
        return hook

    def _bytecomp_push(self, slot):
        p = slot.param
        if p.grad is None or p.grad.data_ptr() != slot.buf.data_ptr():
            # Someone replaced p.grad (e.g. zero_grad(set_to_none=True) on the
            # wrapped optimizer): bring it back into shared memory.
            with torch.no_grad():
                if p.grad is None:
                    slot.buf.zero_()
                else:
                    slot.buf.copy_(p.grad)
            p.grad = slot.buf
        try:
            slot.handle = self._bc_client.push_pull(slot.tid, self._bc_iteration)
        except BytecompError as e:
            self._bc_failed = e
            self._bc_ctx.failed = True
            raise

    # -- public ------------------------------------------------------------
    def synchronize(self):
        """Pushes the gradients backward did not produce, waits for all of
        them (bounded by BYTECOMP_TIMEOUT_MS) and averages (op=Average).
        Call it before working on the averaged gradients (e.g. clipping):
        the next step() then does not sum them again (nor does a second
        synchronize() before that step)."""
        if self._bc_client is None:
            raise NotInitializedError("DistributedOptimizer used after bytecomp.torch.shutdown()")
        if self._bc_failed is not None:
            raise self._bc_failed
        if self._bc_synced:
            return
        try:
            for slot in self._bc_slots:
                if slot.handle is None:
                    self._bytecomp_push(slot)
            for slot in self._bc_slots:
                h, slot.handle = slot.handle, None
                _wait(self._bc_client, h, self._bc_timeout_ms,
                      "push_pull of gradient %r (step %d)", slot.name, self._bc_iteration + 1)
        except BytecompError as e:
            self._bc_failed = e
            self._bc_ctx.failed = True  # no exit barrier: the job is broken
            raise
        for slot in self._bc_slots:
            slot.passes = 0
        self._bc_iteration += 1
        self._bc_synced = True
        if self._bc_op == Average and self._bc_ctx.settings.size > 1:
            bufs = [s.buf for s in self._bc_slots]
            with torch.no_grad():
                torch._foreach_mul_(bufs, 1.0 / self._bc_ctx.settings.size)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.synchronize()
        super(self.__class__, self).step()
        self._bc_synced = False  # the next step() sums the next gradients
        return loss

    def zero_grad(self, set_to_none=False):
        """Zeroes gradients in place: they stay in shared memory (set_to_none
        is accepted for compatibility and treated as False)."""
        if self._bc_client is None:
            return super(self.__class__, self).zero_grad(set_to_none)
        if any(s.handle is not None for s in self._bc_slots):
            raise StateError(
                "BYTECOMP_ERR_STATE",
                "zero_grad() while gradients are being summed (backward ran since the last "
                "step()): call optimizer.step() or optimizer.synchronize() first")
        with torch.no_grad():
            for s in self._bc_slots:
                s.buf.zero_()
                s.passes = 0
                if s.param.grad is None or s.param.grad.data_ptr() != s.buf.data_ptr():
                    s.param.grad = s.buf

    def _bytecomp_detach(self):
        """Leaves the job: gradients move out of shared memory first."""
        client, self._bc_client = self._bc_client, None
        if client is None:
            return
        with torch.no_grad():
            for s in self._bc_slots:
                if s.param.grad is not None and s.param.grad.data_ptr() == s.buf.data_ptr():
                    s.param.grad = s.buf.clone()
                s.buf = None
        self._bc_slots = []
        self._bc_hooks = []
        client.close()


class _Slot:
    __slots__ = ("name", "param", "tid", "buf", "handle", "passes")

    def __init__(self, name, param, tid, buf):
        self.name = name
        self.param = param
        self.tid = tid
        self.buf = buf
        self.handle = None
        self.passes = 0


def DistributedOptimizer(optimizer, named_parameters=None, strategy=None,
                         backward_passes_per_step=1, op=Average):
    """Wraps `optimizer` so gradients are summed over every process of the
    job (and averaged, op=Average) before each step.

    named_parameters: model.named_parameters() of the parameters the optimizer
        updates; the names are the tensor names the strategy matches (without
        it, parameters are called param.0, param.1, ... in optimizer order).
    strategy: path of a strategy file (docs/strategy-format.md) choosing per
        tensor whether and how to compress. The node daemons execute it; they
        run the strategy of their configuration, so this must be that file
        ($BYTECOMP_STRATEGY, set by `bytecomp-run --strategy`), else
        UnsupportedError. None: whatever the daemons run (uncompressed unless
        they were given a strategy).
    backward_passes_per_step: backward passes accumulated locally per step.

    The result is an instance of the optimizer's own class (isinstance and LR
    schedulers keep working)."""
    _ctx_or_raise("DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("DistributedOptimizer: expected a torch.optim.Optimizer, got %s" %
                        type(optimizer).__name__)
    if hasattr(optimizer, "_bc_job"):
        raise ValueError("DistributedOptimizer: the optimizer is already distributed")
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, strategy, backward_passes_per_step,
               op, optimizer)
