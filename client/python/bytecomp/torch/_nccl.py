"""The NCCL intra-node shard flow (issue 27, docs/daemon.md "Intra-node on
GPUs", docs/gpu.md §3): with several local ranks on a GPU node, a gradient is
reduce-scattered among them with NCCL, each rank sends only its shard through
the daemon (in the per-local-rank job bytecomp.gpu.shard_job(), local_size 1),
and the summed shards are allgathered back on the device.

DistributedOptimizer runs it when BYTECOMP_INTRA_NODE=nccl (bytecomp/torch/
_intra.py makes the communicator; the staging pipeline, _staging.py, calls
before() and after() around each slot's d2h / h2d copies). ShardFlow holds the ordering and the
buffer layout and talks to NCCL and CUDA only through a `comm` (sum(buf,
count, shard, stream), allgather(buf, count, stream), abort()) and `ops`
(zeros(count, like) -> padded device buffer, copy_async(dst, src, stream)),
so tests drive it over simulated ranks (tests/python/test_nccl_shards.py);
NcclComm is the real comm over libbytecomp_gpu.

Per tensor and iteration, on the side stream (after the gradient's ready
event, as the staging pipeline orders it):
  1. before : grad -> padded[:count]; padded[count:] stays 0;
              comm.sum(padded, padded_count, shard=1): rank r's shard of the
              sum lands at [r * per, (r + 1) * per);
  2. shard  : that slice is what the rank stages (d2h, daemon, h2d);
  3. after  : comm.allgather(padded, padded_count): every rank has every
              summed shard; padded[:count] -> grad.
Thread-safety: neither; used where the staging pipeline is."""

import ctypes

from bytecomp import _lib
from bytecomp import gpu as _gpu


class ShardFlow:
    def __init__(self, comm, ops, local_rank, local_size):
        if not 0 <= local_rank < local_size:
            raise ValueError("local rank %r of %r" % (local_rank, local_size))
        self.comm = comm
        self.ops = ops
        self.local_rank = local_rank
        self.local_size = local_size
        self._bufs = {}  # key -> (padded buffer, count, padded count, per)

    def layout(self, key, grad):
        """The tensor's padded device buffer (made once) and its layout."""
        b = self._bufs.get(key)
        count = grad.numel()
        if b is None:
            padded, per = _gpu.shard_layout(count, self.local_size)
            b = (self.ops.zeros(padded, grad), count, padded, per)
            self._bufs[key] = b
        elif b[1] != count:
            raise ValueError("shard flow: tensor %r changed size (%d, was %d)" % (key, count, b[1]))
        return b

    def shard(self, key):
        """This rank's slice of the padded buffer: what goes through the daemon."""
        buf, _, _, per = self._bufs[key]
        return buf[self.local_rank * per:(self.local_rank + 1) * per]

    def before(self, key, grad, stream):
        """Enqueues grad -> padded and the reduce-scatter; returns the shard."""
        buf, count, padded, _ = self.layout(key, grad)
        self.ops.copy_async(buf[:count], grad.reshape(-1), stream)
        self._call(self.comm.sum, buf, padded, 1, stream)
        return self.shard(key)

    def after(self, key, grad, stream):
        """Enqueues the allgather of the summed shards and padded -> grad."""
        buf, count, padded, _ = self._bufs[key]
        self._call(self.comm.allgather, buf, padded, stream)
        self.ops.copy_async(grad.reshape(-1), buf[:count], stream)

    def _call(self, fn, *args):
        try:
            fn(*args)
        except Exception:
            self.comm.abort()  # the other local ranks' pending collectives end too
            raise

    def close(self):
        self._bufs = {}


class NcclComm:
    """The comm of ShardFlow over libbytecomp_gpu's NCCL group (bounded
    waits; ncclCommAbort on any failure). `unique_id` (128 bytes) comes from
    local rank 0's make_id(), carried to the others by the job's broadcast."""

    ID_BYTES = 128

    @staticmethod
    def make_id():
        lib = NcclComm._lib()
        buf = (ctypes.c_uint8 * NcclComm.ID_BYTES)()
        NcclComm._check(lib, lib.bytecomp_gpu_nccl_unique_id(buf), "ncclGetUniqueId")
        return bytes(buf)

    def __init__(self, unique_id, nranks, rank, device, timeout_ms):
        lib = self._lib()
        if len(unique_id) != self.ID_BYTES:
            raise ValueError("NCCL unique id: %d bytes, expected %d" % (len(unique_id),
                                                                       self.ID_BYTES))
        self._l = lib
        self.timeout_ms = int(timeout_ms)
        h = ctypes.c_void_p()
        idbuf = (ctypes.c_uint8 * self.ID_BYTES).from_buffer_copy(unique_id)
        self._check(lib, lib.bytecomp_gpu_nccl_create(idbuf, nranks, rank, device,
                                                      self.timeout_ms, ctypes.byref(h)),
                    "NCCL communicator (rank %d of %d, device %d)" % (rank, nranks, device))
        self._h = h

    @staticmethod
    def _lib():
        lib = _gpu.library()
        if lib is None or not hasattr(lib, "bytecomp_gpu_nccl_built") or \
                not lib.bytecomp_gpu_nccl_built():
            raise _lib.UnsupportedError("BYTECOMP_ERR_UNSUPPORTED",
                                        "libbytecomp_gpu without NCCL: no intra-node NCCL")
        v, u64 = ctypes.c_void_p, ctypes.c_uint64
        lib.bytecomp_gpu_nccl_unique_id.argtypes = [ctypes.c_void_p]
        lib.bytecomp_gpu_nccl_create.argtypes = [v, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                 ctypes.c_uint32, ctypes.POINTER(v)]
        lib.bytecomp_gpu_nccl_sum.argtypes = [v, v, u64, ctypes.c_int, v]
        lib.bytecomp_gpu_nccl_allgather.argtypes = [v, v, u64, v]
        lib.bytecomp_gpu_nccl_wait.argtypes = [v, v, ctypes.c_uint32]
        lib.bytecomp_gpu_nccl_abort.argtypes = [v]
        lib.bytecomp_gpu_nccl_destroy.argtypes = [v]
        return lib

    @staticmethod
    def _check(lib, rc, what):
        _gpu._check(lib, rc, what)

    def sum(self, buf, count, shard, stream):
        self._check(self._l, self._l.bytecomp_gpu_nccl_sum(self._h, buf.data_ptr(), count,
                                                           1 if shard else 0,
                                                           stream.cuda_stream or None),
                    "NCCL reduce-scatter" if shard else "NCCL all-reduce")

    def allgather(self, buf, count, stream):
        self._check(self._l, self._l.bytecomp_gpu_nccl_allgather(self._h, buf.data_ptr(), count,
                                                                 stream.cuda_stream or None),
                    "NCCL allgather")

    def wait(self, stream):
        self._check(self._l, self._l.bytecomp_gpu_nccl_wait(self._h, stream.cuda_stream or None,
                                                            self.timeout_ms), "NCCL wait")

    def abort(self):
        if getattr(self, "_h", None):
            self._l.bytecomp_gpu_nccl_abort(self._h)

    def close(self):
        h, self._h = getattr(self, "_h", None), None
        if h:
            self._l.bytecomp_gpu_nccl_destroy(h)
