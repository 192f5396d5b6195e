"""Horovod's tensor collectives on the control job: allreduce (exact in the
tensor's own dtype, see _Context.sum_exact), allgather (first dimensions may
differ), broadcast, their in-place (`_`) and async (`_async`, handles for
synchronize()/poll()) forms, the autograd functions behind them, and
Horovod's Compression. Internal: use them through bytecomp.torch.

Every call runs on the control context's one worker thread in call order
(_Context.submit), so async calls overlap the caller's work and all ranks
still issue the same sums in the same order."""

import itertools
import threading

import torch

from bytecomp.torch._broadcast import (_BROADCAST_DTYPES, _broadcast_tensors, _check_root,
                                       _named_tensors, _tag)
from bytecomp.torch import _control
from bytecomp.torch._control import (_INT_DTYPES, _as_bytes, _ctx_or_raise, wait_future)

# Reduction ops (Horovod's names). Only these two are sums; Horovod's
# Adasum, Min, Max and Product are refused by name (docs/torch.md).
Average = "average"
Sum = "sum"
Adasum = "adasum"
_OPS = (Average, Sum)


class _GlobalProcessSet:
    """Horovod's global_process_set: every process of the job (the only
    process set this package has)."""

    def __repr__(self):
        return "global_process_set"


global_process_set = _GlobalProcessSet()

_SUM_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16) + _INT_DTYPES


# -- Horovod's Compression ----------------------------------------------------
class Compressor:
    """Horovod's compressor interface: compress() returns (tensor, context),
    decompress() undoes it. DistributedOptimizer maps the two built-ins onto
    the daemons' compressors (fp16 -> the `fp16` compressor of every
    gradient); allreduce() applies them to the tensor as Horovod does."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError("a Compressor subclass defines compress()")

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError("a Compressor subclass defines decompress()")


class NoneCompressor(Compressor):
    strategy_compressor = "none"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    strategy_compressor = "fp16"

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else tensor.type(ctx)


class Compression:
    """Horovod's hvd.Compression: `none` and `fp16`."""
    none = NoneCompressor
    fp16 = FP16Compressor


# -- arguments ------------------------------------------------------------------
def _op_of(what, op, average):
    """Horovod's rule: op, or the deprecated average=, or Average."""
    if op is not None and average is not None:
        raise ValueError("%s: pass op= or the deprecated average=, not both" % what)
    if op is None:
        op = Average if average is None or average else Sum
    if op not in _OPS:
        raise ValueError("%s: op=%r is not supported; bytecomp.torch sums (op=Average or op=Sum); "
                         "Adasum, Min, Max and Product are not available (docs/torch.md)" %
                         (what, op))
    return op


def _check_process_set(what, process_set):
    if process_set is not None and process_set is not global_process_set:
        raise ValueError("%s: process_set=%r: bytecomp.torch has no process sets; every call "
                         "runs over all processes of the job (global_process_set)" %
                         (what, process_set))


def _check_tensor(what, tensor, dtypes):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("%s: expected a torch.Tensor, got %s" % (what, type(tensor).__name__))
    _named_tensors([("tensor", tensor)], what)  # CPU only, with the message
    if tensor.is_sparse:
        raise ValueError("%s: sparse tensors are not supported (convert with to_dense())" % what)
    if tensor.dtype not in dtypes:
        raise TypeError("%s: cannot handle a tensor of dtype %s; supported: %s" %
                        (what, tensor.dtype, ", ".join(str(d) for d in dtypes)))


# -- handles ----------------------------------------------------------------------
_handles = {}
_handles_lock = threading.Lock()
_next_handle = itertools.count(1)


def _new_handle(fut):
    with _handles_lock:
        h = next(_next_handle)
        _handles[h] = fut
    return h


def _future_of(handle, what):
    with _handles_lock:
        fut = _handles.get(handle)
    if fut is None:
        raise ValueError("%s: %r is not a handle of a pending bytecomp.torch call (already "
                         "synchronized, or from before shutdown())" % (what, handle))
    return fut


def poll(handle):
    """True once the async call behind `handle` has finished (synchronize()
    then returns at once)."""
    return _future_of(handle, "poll").done()


def synchronize(handle):
    """Waits for the async call behind `handle` and returns its result (or
    raises its error). Each handle is synchronized once."""
    fut = _future_of(handle, "synchronize")
    try:
        return wait_future(fut)
    finally:
        with _handles_lock:
            _handles.pop(handle, None)


def _forget_handles():
    """shutdown(): pending handles die with the control job."""
    with _handles_lock:
        _handles.clear()


_control._on_shutdown.append(_forget_handles)


# -- allreduce ------------------------------------------------------------------------
def _reduce(c, tensor, op, name, pre, post, what):
    """The reduction itself (on the worker): a new tensor of tensor's shape
    and dtype."""
    integer = tensor.dtype in _INT_DTYPES
    if integer and (pre != 1.0 or post != 1.0):
        raise TypeError("%s: prescale_factor/postscale_factor on an integer tensor (%s) would "
                        "round; scale it yourself" % (what, tensor.dtype))
    sig = _tag("allreduce", name, op, tuple(tensor.shape), str(tensor.dtype), pre, post)
    c.check_same(sig, tensor.numel(), what)
    flat = tensor.detach().reshape(-1)
    if pre != 1.0:
        flat = flat * pre
    s = c.sum_exact(flat, what)
    if op == Average:
        n = c.settings.size
        # Horovod divides integers with floor_divide; exact here.
        s = torch.div(s, n, rounding_mode="floor") if integer else s / n
    if post != 1.0:
        s = s * post
    return s.view(tensor.shape)


def _submit_reduce(tensor, op, name, pre, post, what, inplace):
    c = _ctx_or_raise(what)
    _check_tensor(what, tensor, _SUM_DTYPES)
    src = tensor.detach().clone()  # the value at the call, as Horovod reads it

    def run():
        out = _reduce(c, src, op, name, pre, post, what)
        if inplace:
            with torch.no_grad():
                tensor.copy_(out)
            return tensor
        return out
    return c.submit(run)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Starts allreduce() (the input is read now); returns a handle for
    synchronize()/poll()."""
    _check_process_set("allreduce_async", process_set)
    op = _op_of("allreduce_async", op, average)
    return _new_handle(_submit_reduce(tensor, op, name, prescale_factor, postscale_factor,
                                      "allreduce_async", False))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """Starts allreduce_() on `tensor`; synchronize(handle) returns it."""
    _check_process_set("allreduce_async_", process_set)
    op = _op_of("allreduce_async_", op, average)
    return _new_handle(_submit_reduce(tensor, op, name, prescale_factor, postscale_factor,
                                      "allreduce_async_", True))


class _AllreduceFn(torch.autograd.Function):
    """y = op(x over ranks); dL/dx = op(dL/dy over ranks) (each rank's loss
    depends on every rank's x)."""

    @staticmethod
    def forward(ctx, tensor, op, name, pre, post):
        ctx.op, ctx.name, ctx.pre, ctx.post = op, name, pre, post
        return wait_future(_submit_reduce(tensor, op, name, pre, post, "allreduce", False))

    @staticmethod
    def backward(ctx, grad):
        name = None if ctx.name is None else ctx.name + ".grad"
        g = wait_future(_submit_reduce(grad.contiguous(), ctx.op, name, ctx.pre, ctx.post,
                                       "allreduce (backward)", False))
        return g, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """A new tensor of tensor's shape and dtype: the average (op=Average,
    the default) or sum (op=Sum) of `tensor` over every process. Exact in
    the tensor's dtype: integers are summed exactly and wrap as in their
    type (Average: floor division by size()), float64 is summed in float64
    also across nodes. Differentiable (backward: the same allreduce of the
    gradient). Every rank passes the same shape, dtype, name and op, else
    MismatchError on every rank and the job goes on."""
    _check_process_set("allreduce", process_set)
    op = _op_of("allreduce", op, average)
    _check_tensor("allreduce", tensor, _SUM_DTYPES)
    compressed, cctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _AllreduceFn.apply(compressed, op, name, prescale_factor, postscale_factor)
    else:
        out = wait_future(_submit_reduce(compressed, op, name, prescale_factor,
                                         postscale_factor, "allreduce", False))
    return compression.decompress(out, cctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """allreduce() into `tensor` itself; returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


# -- allgather ----------------------------------------------------------------------
def _gather(c, tensor, name, what):
    t = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    rest = tuple(t.shape[1:])
    sig = _tag("allgather", name, rest, str(t.dtype))
    # The count is not compared: first dimensions may differ.
    c.check_same(sig, 0, what)
    raw = t.to(torch.uint8) if t.dtype == torch.bool else t
    parts = c.gather_bytes(_as_bytes(raw), what)
    out = []
    for p in parts:
        v = p.view(raw.dtype)
        out.append(v.to(torch.bool) if t.dtype == torch.bool else v)
    return torch.cat(out).view((-1,) + rest)


def _submit_gather(tensor, name, what):
    c = _ctx_or_raise(what)
    _check_tensor(what, tensor, _BROADCAST_DTYPES)
    src = tensor.detach().clone()
    return c.submit(lambda: _gather(c, src, name, what))


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Starts allgather(); returns a handle for synchronize()/poll()."""
    _check_process_set("allgather_async", process_set)
    return _new_handle(_submit_gather(tensor, name, "allgather_async"))


class _AllgatherFn(torch.autograd.Function):
    """y = cat(x_0, ..., x_n-1); dL/dx_r = rank r's rows of the sum over
    ranks of dL/dy."""

    @staticmethod
    def forward(ctx, tensor, name):
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        ctx.name = name
        return wait_future(_submit_gather(tensor, name, "allgather"))

    @staticmethod
    def backward(ctx, grad):
        name = None if ctx.name is None else ctx.name + ".grad"
        summed = wait_future(_submit_reduce(grad.contiguous(), Sum, name, 1.0, 1.0,
                                            "allgather (backward)", False))
        dims = wait_future(_submit_gather(torch.tensor([ctx.dim0], dtype=torch.int64),
                                          None if name is None else name + ".dims",
                                          "allgather (backward)"))
        c = _ctx_or_raise("allgather")
        offset = int(dims[:c.settings.rank].sum())
        g = summed.narrow(0, offset, ctx.dim0)
        return (g.reshape(()) if ctx.scalar else g), None


def allgather(tensor, name=None, process_set=global_process_set):
    """A new tensor: every rank's `tensor` concatenated along the first
    dimension, in rank order. First dimensions may differ between ranks;
    the other dimensions and the dtype must not (else MismatchError on
    every rank). Differentiable."""
    _check_process_set("allgather", process_set)
    _check_tensor("allgather", tensor, _BROADCAST_DTYPES)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherFn.apply(tensor, name)
    return wait_future(_submit_gather(tensor, name, "allgather"))


# -- broadcast ----------------------------------------------------------------------
def _submit_broadcast(tensor, root_rank, name, what, inplace):
    c = _ctx_or_raise(what)
    _check_tensor(what, tensor, _BROADCAST_DTYPES)
    _check_root(c, root_rank, what)
    out = tensor if inplace else tensor.detach().clone()

    def run():
        with torch.no_grad():
            _broadcast_tensors(c, [("tensor" if name is None else name, out)], root_rank, what)
        return out
    return c.submit(run)


def broadcast_async(tensor, root_rank=0, name=None, process_set=global_process_set):
    """Starts broadcast(); returns a handle for synchronize()/poll()."""
    _check_process_set("broadcast_async", process_set)
    return _new_handle(_submit_broadcast(tensor, root_rank, name, "broadcast_async", False))


def broadcast_async_(tensor, root_rank=0, name=None, process_set=global_process_set):
    """Starts broadcast_() on `tensor`; synchronize(handle) returns it."""
    _check_process_set("broadcast_async_", process_set)
    return _new_handle(_submit_broadcast(tensor, root_rank, name, "broadcast_async_", True))


class _BroadcastFn(torch.autograd.Function):
    """y_r = x_root on every rank; dL/dx_root = sum over ranks of dL/dy,
    zero on the other ranks."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank, ctx.name = root_rank, name
        return wait_future(_submit_broadcast(tensor, root_rank, name, "broadcast", False))

    @staticmethod
    def backward(ctx, grad):
        name = None if ctx.name is None else ctx.name + ".grad"
        g = wait_future(_submit_reduce(grad.contiguous(), Sum, name, 1.0, 1.0,
                                       "broadcast (backward)", False))
        if _ctx_or_raise("broadcast").settings.rank != ctx.root_rank:
            g = torch.zeros_like(g)
        return g, None, None


def broadcast(tensor, root_rank=0, name=None, process_set=global_process_set):
    """A new tensor holding root_rank's `tensor` (bit for bit); `tensor` is
    not modified. Differentiable."""
    _check_process_set("broadcast", process_set)
    _check_tensor("broadcast", tensor, _BROADCAST_DTYPES)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastFn.apply(tensor, root_rank, name)
    return wait_future(_submit_broadcast(tensor, root_rank, name, "broadcast", False))


def broadcast_(tensor, root_rank=0, name=None, process_set=global_process_set):
    """Overwrites `tensor` with root_rank's (bit for bit); returns it."""
    _check_process_set("broadcast_", process_set)
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))
