"""bytecomp.torch's broadcasts of tensors, objects and optimizer state (the
daemons' broadcast operation: raw bytes from the root, no conversion).
Internal: use them through bytecomp.torch (Horovod's tensor collectives are
in _collectives.py)."""

import pickle
import struct
import zlib

import torch

from bytecomp import _lib
from bytecomp.torch._control import MismatchError, _ctx_or_raise

_BROADCAST_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                     torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def _tensor_bytes(t):
    """The tensor's bytes (a flat uint8 tensor, a copy)."""
    if t.dtype not in _BROADCAST_DTYPES:
        raise TypeError("bytecomp.torch: cannot broadcast a tensor of dtype %s" % t.dtype)
    flat = t.detach().reshape(-1).to("cpu", copy=True)  # CUDA tensors: staged on the host
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8)


def _tag(*values):
    """The agreement value of a broadcast: every rank must compute the same."""
    return zlib.crc32(repr(values).encode())


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
        if t.device.type not in ("cpu", "cuda"):
            raise _lib.UnsupportedError(
                "BYTECOMP_ERR_UNSUPPORTED",
                "%s: tensor %r is on %s; supported are CPU and CUDA tensors" %
                (what, name, t.device))
        out.append((str(name), t))
    return out


def _broadcast_tensors(c, named, root_rank, what):
    """Broadcasts the tensors in place from root_rank, bit for bit."""
    _check_root(c, root_rank, what)
    for name, t in named:
        if t.dtype not in _BROADCAST_DTYPES:
            raise TypeError("%s: cannot broadcast tensor %r of dtype %s" % (what, name, t.dtype))
    count = sum(t.numel() for _, t in named)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    # Names, shapes and dtypes travel as the tag: the daemons compare it (with
    # the size and root) across every rank, in the broadcast itself.
    tag = _tag([(n, tuple(t.shape), str(t.dtype)) for n, t in named], nbytes)
    is_root = c.settings.rank == root_rank
    # Compared through the exact sums first: the daemons would also refuse a
    # disagreeing broadcast, but that breaks the control job, and Horovod's
    # callers expect to go on after the error.
    _check_broadcast(c, tag, nbytes, root_rank, what,
                     "the processes passed different tensors (names, shapes, dtypes or number "
                     "of elements differ, or another root rank; this rank passed %d elements "
                     "from root rank %d): every rank must pass the same set in the same order" %
                     (count, root_rank))
    # Each tensor's bytes go straight between its storage and the shared
    # memory (a contiguous CPU tensor's own bytes; others through a staging
    # copy): a copy of the whole state first costs more than the network at
    # 10 Gbit/s (docs/cluster.md).
    segments, staged = [], []
    for _, t in named:
        if t.numel() == 0:
            continue
        view = _byte_view(t)
        if view is None:
            view = _tensor_bytes(t) if is_root else \
                torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
            staged.append((t, view))
        segments.append(view)
    with torch.no_grad():
        c.broadcast_into(segments, nbytes, root_rank, tag, what)
        if not is_root:
            for t, raw in staged:
                v = raw.to(torch.bool) if t.dtype == torch.bool else raw.view(t.dtype)
                t.copy_(v.view(t.shape))


def _byte_view(t):
    """The bytes of `t` as a flat uint8 tensor sharing its storage (writes
    land in `t`), or None when `t` is not a contiguous CPU tensor."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(torch.uint8)


def _check_broadcast(c, tag, nbytes, root_rank, what, message):
    try:
        c.check_same(_tag(tag, root_rank), nbytes, what)
    except MismatchError:
        raise MismatchError("%s: %s" % (what, message)) from None


def _check_root(c, root_rank, what):
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or \
            not 0 <= root_rank < c.settings.size:
        raise ValueError("%s: root_rank=%r is not a rank (0..%d)" %
                         (what, root_rank, c.settings.size - 1))


def broadcast_parameters(params, root_rank=0):
    """Copies root_rank's values into every process's tensors, in place.
    `params`: a state_dict (model.state_dict()), or an iterable of (name,
    tensor) pairs (model.named_parameters()) or of tensors. Every process
    must pass the same names, shapes and dtypes in the same order."""
    c = _ctx_or_raise("broadcast_parameters")
    named = _named_tensors(params, "broadcast_parameters")
    c.call(lambda: _broadcast_tensors(c, named, root_rank, "broadcast_parameters"))


def broadcast_object(obj, root_rank=0, name=None):
    """Returns root_rank's `obj` (any picklable object) in every process.
    `name` (Horovod's) must be the same on every rank; it names the call in
    errors."""
    c = _ctx_or_raise("broadcast_object")
    what = "broadcast_object" if name is None else "broadcast_object(name=%r)" % (name,)
    _check_root(c, root_rank, what)
    return c.call(lambda: _broadcast_object(c, obj, root_rank, name, what))


def _broadcast_object(c, obj, root_rank, name, what):
    is_root = c.settings.rank == root_rank
    data = pickle.dumps(obj) if is_root else b""

    def as_tensor(b):
        return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else \
            torch.empty(0, dtype=torch.uint8)
    _check_broadcast(c, _tag("broadcast_object", name), 8, root_rank, what,
                     "the processes passed different names or root ranks (this rank: name=%r, "
                     "root rank %d)" % (name, root_rank))
    length = c.broadcast_bytes(as_tensor(struct.pack("<Q", len(data))), 8, root_rank,
                               _tag("broadcast_object", name), what)
    n = struct.unpack("<Q", length.numpy().tobytes())[0]
    got = c.broadcast_bytes(as_tensor(data), n, root_rank, _tag("broadcast_object", name, n),
                            what)
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
    c.call(lambda: _broadcast_tensors(c, named, root_rank, "broadcast_optimizer_state"))
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
