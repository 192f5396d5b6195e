"""GPU compression in the training process (issue 27): libbytecomp_gpu (the
CUDA compressors of compress/cuda/ behind bytecomp_gpu.h) and the placement
of each tensor's compression, GPU or CPU, from the job's strategy.

`placement()` is pure logic (host-tested: tests/python/test_gpu_placement.py):
a tensor is compressed on the GPU in the training process when its resolved
strategy option says `comp_device: gpu`, the tensor is a CUDA tensor, the
library was built with CUDA, a device is visible, and the compressor has CUDA
kernels; otherwise on the daemon's CPU pool, with the reason. Both write the
same wire format (compress/internal.h), so nodes may mix placements.

`GpuCompressor` wraps one tensor's compressor (it owns the tensor's
error-feedback state on the device). Library lookup as for libbytecomp
(bytecomp/_lib.py), with libbytecomp_gpu.so.1 and $BYTECOMP_GPU_LIBRARY.
"""

import ctypes
import ctypes.util
import fnmatch
import os
import re

from bytecomp import _lib

_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1000,
          "MB": 1000 * 1000, "GB": 1000 * 1000 * 1000}


def _bytes(v):
    """A strategy byte size: an integer or '<n> <unit>' (common/config.cc)."""
    if isinstance(v, int):
        return v
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(v))
    if not m or m.group(2) not in _UNITS:
        raise ValueError("byte size %r: an integer with optional unit %s" %
                         (v, ", ".join(u for u in _UNITS if u)))
    return int(m.group(1)) * _UNITS[m.group(2)]


def resolve(doc, name, nbytes):
    """The option of tensor `name` (nbytes bytes) in a parsed strategy file,
    as planner/strategy.h resolves it: exact entry, else the first rule whose
    glob and inclusive byte window match, else `default`, else {}."""
    for e in doc.get("entries") or []:
        if isinstance(e, dict) and e.get("tensor") == name:
            return dict(e.get("option") or {})
    for r in doc.get("rules") or []:
        if not isinstance(r, dict):
            continue
        if not fnmatch.fnmatchcase(name, str(r.get("match", "*"))):
            continue
        if "min_bytes" in r and nbytes < _bytes(r["min_bytes"]):
            continue
        if "max_bytes" in r and nbytes > _bytes(r["max_bytes"]):
            continue
        return dict(r.get("option") or {})
    return dict(doc.get("default") or {})


def spec_of(option):
    """The compressor spec text ("topk:ratio=0.01") of a strategy option."""
    name = str(option.get("compressor", "none"))
    params = option.get("params") or {}
    if not params:
        return name
    return name + ":" + ",".join("%s=%s" % (k, params[k]) for k in sorted(params))


class Capabilities:
    """What the process can do: libbytecomp_gpu built with CUDA, the visible
    devices, and which compressors have CUDA kernels."""

    def __init__(self, built, devices, supported):
        self.built = bool(built)
        self.devices = int(devices)
        self._supported = supported  # callable(name) -> bool

    def supported(self, name):
        return self.built and bool(self._supported(name))


def placement(doc, tensors, caps):
    """Per tensor: (where, spec, why). `tensors`: (name, nbytes, device_type)
    in declaration order; `doc`: the parsed strategy (None: uncompressed).
    where: "none" (uncompressed), "gpu" (compressed in this process on the
    device) or "cpu" (compressed by the daemon's CPU pool)."""
    out = {}
    for name, nbytes, device_type in tensors:
        opt = resolve(doc, name, nbytes) if doc else {}
        comp = str(opt.get("compressor", "none"))
        if comp == "none":
            out[name] = ("none", "none", "uncompressed")
            continue
        spec = spec_of(opt)
        if str(opt.get("comp_device", "cpu")) != "gpu":
            out[name] = ("cpu", spec, "comp_device: cpu")
        elif device_type != "cuda":
            out[name] = ("cpu", spec, "comp_device: gpu, but the tensor is on %s" % device_type)
        elif not caps.built:
            out[name] = ("cpu", spec, "comp_device: gpu, but libbytecomp_gpu has no CUDA kernels")
        elif caps.devices == 0:
            out[name] = ("cpu", spec, "comp_device: gpu, but no CUDA device is visible")
        elif not caps.supported(comp):
            out[name] = ("cpu", spec, "comp_device: gpu, but %s has no CUDA kernels" % comp)
        elif float(opt.get("cpu_share", 0) or 0) > 0:
            out[name] = ("gpu", spec, "comp_device: gpu (cpu_share %s: the first partitions "
                         "on the daemon's CPU pool)" % opt["cpu_share"])
        else:
            out[name] = ("gpu", spec, "comp_device: gpu")
    return out


# -- NCCL intra-node shard flow (docs/daemon.md "Intra-node on GPUs";
# BYTECOMP_INTRA_NODE=nccl in DistributedOptimizer, docs/gpu.md §3) -----------
def shard_layout(count, local_size):
    """How a gradient of `count` float32 elements splits among `local_size`
    local ranks for bytecomp_gpu_nccl_sum(shard=1) (a reduce-scatter needs a
    multiple of the ranks): (padded count, elements per shard). Rank r's shard
    is [r * per, (r + 1) * per) of the padded buffer; it is what rank r
    declares to the daemon (in shard_job()), the padding summing to zero."""
    if local_size < 1 or count < 0:
        raise ValueError("shard_layout(%r, %r): count >= 0, local_size >= 1" %
                         (count, local_size))
    per = -(-count // local_size)
    return per * local_size, per


def shard_job(job, local_rank):
    """The per-local-rank job a shard goes through the daemon in (local_size
    1, so today's daemon sums each shard across nodes unchanged; it also
    takes client-compressed pushes, one local rank per node)."""
    return "%s.l%d" % (job, local_rank)


def partition_seed(job, tensor_id, partition):
    """The shared seed the daemon compresses a partition with."""
    lib = library()
    if lib is None or not hasattr(lib, "bytecomp_gpu_partition_seed"):
        return 0
    return lib.bytecomp_gpu_partition_seed(job.encode(), tensor_id, partition)


def dense_partitions(cpu_share, partitions):
    """The strategy's cpu_share as the runtime executes it (docs/gpu.md §4;
    daemon/client_payload.h planned_dense_partitions): the leading
    llround(cpu_share * partitions) partitions are compressed by the daemon's
    CPU pool, the rest in this process. All of them: the tensor is pushed
    dense. cpu_share must be in [0, 1)."""
    share = float(cpu_share)
    if not 0.0 <= share < 1.0:
        raise ValueError("cpu_share %r: a share in [0, 1)" % (cpu_share,))
    if partitions < 1:
        raise ValueError("partitions %r: at least 1" % (partitions,))
    x = share * partitions  # the same double product as the daemon's
    k = int(x)
    return k + (1 if x - k >= 0.5 else 0)  # llround (x >= 0): half away from zero


class PartitionCodec:
    """Compresses one tensor in the training process, partition by
    partition of the tensor's partition size (bytecomp_tensor_partitions:
    the job's, cut into the strategy's `pieces`), straight into the tensor's
    shared-memory buffer: each partition's payload at the start of its byte
    range (bytecomp_push_pull_compressed's layout). One compressor (and
    error-feedback state) per partition, as the daemon keeps.

    `make(spec, count)` builds a partition's compressor (GpuCompressor on a
    device, GpuCompressor(host=True) as the host stand-in); `ops` gives
    scratch(nbytes) -> buffer with .ptr (device memory for the GPU; host for
    the stand-in), raw(stream) -> the stream handle the compressor takes, and
    copy(host_bytes, offset, scratch, nbytes, stream): scratch[:nbytes] ->
    host_bytes[offset:] (a byte tensor over the shared buffer), and
    copy_dense(host_bytes, offset, src, stream): a float32 slice of the
    gradient -> host_bytes[offset:] (the partitions cpu_share leaves dense).

    cpu_share (the strategy option's): the leading dense_partitions()
    partitions are copied dense for the daemon's CPU pool to compress; push
    with bytecomp_push_pull_split(dense). All of them: UnsupportedError
    (the tensor is pushed dense)."""

    def __init__(self, spec, count, partition_bytes, job, tensor_id, make, ops, cpu_share=0.0):
        if partition_bytes <= 0 or partition_bytes % 64:
            raise ValueError("partition size %r: a positive multiple of 64" % (partition_bytes,))
        self.spec = spec
        self.count = count
        self.partition_bytes = partition_bytes
        self.parts = []  # (first element, count, compressor, scratch, seed)
        per = partition_bytes // 4
        self.dense = dense_partitions(cpu_share, max(1, -(-count // per)))
        if self.dense >= max(1, -(-count // per)):
            raise _lib.UnsupportedError(
                "BYTECOMP_ERR_UNSUPPORTED",
                "cpu_share %s of %d partition(s) puts every partition on the daemon's CPU pool"
                % (cpu_share, max(1, -(-count // per))))
        self.dense_ranges = []  # (first element, count) of the dense partitions
        first, index = 0, 0
        while first < count:
            n = min(per, count - first)
            if index < self.dense:
                self.dense_ranges.append((first, n))
                first += n
                index += 1
                continue
            c = make(spec, n)
            if c.max_bytes > n * 4:
                c.close()
                self.close()
                raise _lib.UnsupportedError(
                    "BYTECOMP_ERR_UNSUPPORTED",
                    "%s of %d elements may need %d bytes, more than the partition's %d: "
                    "compressed by the daemon instead" % (spec, n, c.max_bytes, n * 4))
            self.parts.append((first, n, c, ops.scratch(c.max_bytes),
                               partition_seed(job, tensor_id, index)))
            first += n
            index += 1
        self._ops = ops

    def encode(self, grad_ptr, host_bytes, iteration, stream=None, grad=None):
        """Enqueues, per partition, compress(float32 elements at grad_ptr)
        -> scratch -> host_bytes at the partition's byte offset, on `stream`;
        the dense partitions (cpu_share) are copied from `grad` (the same
        elements as a flat float32 tensor) as they are. Returns the payload
        bytes per compressed partition."""
        if self.dense_ranges:
            if grad is None:
                raise ValueError("%s: cpu_share leaves partitions dense: encode needs the "
                                 "gradient tensor" % self.spec)
            flat = grad.reshape(-1)
            for first, n in self.dense_ranges:
                self._ops.copy_dense(host_bytes, first * 4, flat[first:first + n], stream)
        lens = []
        raw = self._ops.raw(stream)
        for first, n, c, scratch, seed in self.parts:
            ln = c.compress(grad_ptr + first * 4, scratch.ptr, c.max_bytes, iteration, seed, raw)
            self._ops.copy(host_bytes, first * 4, scratch, ln, stream)
            lens.append(ln)
        return lens

    def close(self):
        for p in self.parts:
            p[2].close()
        self.parts = []


# -- libbytecomp_gpu ----------------------------------------------------------------
_gpu_lib = None


def _candidates():
    out = []
    explicit = os.environ.get("BYTECOMP_GPU_LIBRARY")
    if explicit:
        out.append(explicit)
    build = os.environ.get("BYTECOMP_BUILD_ROOT")
    if build:
        out.append(os.path.join(build, "client", "libbytecomp_gpu.so.1"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    out.append(os.path.join(root, "build", "client", "libbytecomp_gpu.so.1"))
    out.append(ctypes.util.find_library("bytecomp_gpu") or "libbytecomp_gpu.so.1")
    return out


def library():
    """libbytecomp_gpu loaded (cached), or None when it is not found."""
    global _gpu_lib
    if _gpu_lib is not None:
        return _gpu_lib or None
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.bytecomp_gpu_built.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.bytecomp_gpu_supported.argtypes = [ctypes.c_char_p]
        lib.bytecomp_gpu_compressor_create.argtypes = [ctypes.c_char_p, ctypes.c_uint64,
                                                       ctypes.POINTER(ctypes.c_void_p)]
        lib.bytecomp_gpu_max_compressed_bytes.argtypes = [ctypes.c_void_p,
                                                          ctypes.POINTER(ctypes.c_uint64)]
        lib.bytecomp_gpu_compress.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
            ctypes.c_uint64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]
        lib.bytecomp_gpu_decompress.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p]
        lib.bytecomp_gpu_compressor_destroy.argtypes = [ctypes.c_void_p]
        if hasattr(lib, "bytecomp_gpu_compressor_create_host"):
            lib.bytecomp_gpu_compressor_create_host.argtypes = [
                ctypes.c_char_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)]
            lib.bytecomp_gpu_partition_seed.argtypes = [ctypes.c_char_p, ctypes.c_uint32,
                                                        ctypes.c_uint32]
            lib.bytecomp_gpu_partition_seed.restype = ctypes.c_uint64
        lib.bytecomp_gpu_last_error.restype = ctypes.c_char_p
        _gpu_lib = lib
        return lib
    _gpu_lib = False
    return None


def capabilities():
    lib = library()
    if lib is None:
        return Capabilities(False, 0, lambda _n: False)
    n = ctypes.c_int(0)
    built = lib.bytecomp_gpu_built(ctypes.byref(n))
    return Capabilities(built, n.value,
                        lambda name: lib.bytecomp_gpu_supported(name.encode()) == 1)


_STATUS_NAMES = {1: "BYTECOMP_ERR_INVALID_ARGUMENT", 3: "BYTECOMP_ERR_PROTOCOL",
                 7: "BYTECOMP_ERR_UNAVAILABLE", 8: "BYTECOMP_ERR_RESOURCE_EXHAUSTED",
                 9: "BYTECOMP_ERR_INTERNAL", 12: "BYTECOMP_ERR_UNSUPPORTED"}


def _check(lib, rc, what):
    if rc != 0:
        msg = lib.bytecomp_gpu_last_error().decode(errors="replace")
        cls = _lib._CLASS_BY_STATUS.get(rc, _lib.BytecompError)
        raise cls(_STATUS_NAMES.get(rc, "BYTECOMP_ERR_%d" % rc), "%s: %s" % (what, msg))


class GpuCompressor:
    """One float32 CUDA tensor's compressor (and its device-side state).
    Pointers are device addresses (tensor.data_ptr()); stream a
    torch.cuda.Stream's cuda_stream (0: default stream)."""

    def __init__(self, spec, count, host=False):
        """host=True: the CPU library behind the same calls on host pointers
        (bytecomp_gpu_compressor_create_host), the stand-in where there is
        no GPU."""
        lib = library()
        if lib is None:
            raise _lib.UnsupportedError("BYTECOMP_ERR_UNSUPPORTED",
                                        "libbytecomp_gpu not found (tried %s)" %
                                        ", ".join(_candidates()))
        self._lib = lib
        self.host = bool(host)
        h = ctypes.c_void_p()
        create = lib.bytecomp_gpu_compressor_create_host if host else \
            lib.bytecomp_gpu_compressor_create
        _check(lib, create(spec.encode(), count, ctypes.byref(h)),
               "%s compressor %r for %d elements" % ("host" if host else "GPU", spec, count))
        self._h = h
        self.spec = spec
        self.count = count
        cap = ctypes.c_uint64()
        _check(lib, lib.bytecomp_gpu_max_compressed_bytes(h, ctypes.byref(cap)), spec)
        self.max_bytes = cap.value

    def compress(self, in_ptr, out_ptr, out_capacity, iteration, seed, stream=0):
        n = ctypes.c_uint64()
        _check(self._lib, self._lib.bytecomp_gpu_compress(self._h, in_ptr, out_ptr, out_capacity,
                                                          iteration, seed, stream or None,
                                                          ctypes.byref(n)), self.spec)
        return n.value

    def decompress(self, in_ptr, nbytes, out_ptr, accumulate, iteration, seed, stream=0):
        _check(self._lib, self._lib.bytecomp_gpu_decompress(self._h, in_ptr, nbytes, out_ptr,
                                                            1 if accumulate else 0, iteration,
                                                            seed, stream or None), self.spec)

    def close(self):
        h, self._h = getattr(self, "_h", None), None
        if h:
            self._lib.bytecomp_gpu_compressor_destroy(h)

    def __del__(self):
        self.close()
