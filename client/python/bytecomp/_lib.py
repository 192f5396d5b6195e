"""ctypes binding over libbytecomp, the thin client's C ABI (bytecomp.h).

Nothing here knows about PyTorch: `Client` is a direct, checked mapping of
the C functions, and every failing call raises a `BytecompError` subclass
carrying the library's message (which says what was wrong and what to do).

Finding the library, in this order:
  1. $BYTECOMP_LIBRARY (a path to libbytecomp.so.1),
  2. $BYTECOMP_BUILD_ROOT/client/libbytecomp.so.1 (meson test, bytecomp-run),
  3. <source tree>/build/client/libbytecomp.so.1 (running from a checkout),
  4. the system's libbytecomp.so.1 (installed package).

Thread-safety: like the C library, every method of a `Client` may be called
from any thread, except `close()`, which must not race with other calls.
ctypes releases the GIL during each C call, so a thread blocked in `wait()`
does not stop the others.
"""

import ctypes
import ctypes.util
import os
import threading

ABI_VERSION = 1

# bytecomp_status values (bytecomp.h).
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_CONFIG = 2
ERR_PROTOCOL = 3
ERR_TIMEOUT = 4
ERR_PEER_LOST = 5
ERR_ABORTED = 6
ERR_UNAVAILABLE = 7
ERR_RESOURCE_EXHAUSTED = 8
ERR_INTERNAL = 9
ERR_VERSION_MISMATCH = 10
ERR_STATE = 11
ERR_UNSUPPORTED = 12

# bytecomp_dtype values.
FLOAT32 = 0
FLOAT64 = 1
INT32 = 2
INT64 = 3

DEVICE_CPU = 0
DEVICE_CUDA = 1


class BytecompError(RuntimeError):
    """A failed libbytecomp call. `status` is the C status name."""

    def __init__(self, status, message):
        self.status = status
        self.message = message
        super().__init__("%s: %s" % (status, message))


class InvalidArgumentError(BytecompError, ValueError):
    """A bad argument (unknown tensor, wrong size, bad name)."""


class StateError(BytecompError):
    """A call not allowed at this point (e.g. declare after start)."""


class BytecompTimeout(BytecompError):
    """A wait ran past its timeout."""


class JobAbortedError(BytecompError):
    """The job was aborted: another process of it died or left, or the daemon
    shut the job down. The message says why."""


class DaemonUnavailableError(BytecompError):
    """bytecompd is not running, or the connection to it was lost."""


class VersionMismatchError(BytecompError):
    """libbytecomp and bytecompd come from different releases."""


class UnsupportedError(BytecompError):
    """Not supported by this release (e.g. GPU tensors)."""


_CLASS_BY_STATUS = {
    ERR_INVALID_ARGUMENT: InvalidArgumentError,
    ERR_TIMEOUT: BytecompTimeout,
    ERR_PEER_LOST: JobAbortedError,
    ERR_ABORTED: JobAbortedError,
    ERR_UNAVAILABLE: DaemonUnavailableError,
    ERR_VERSION_MISMATCH: VersionMismatchError,
    ERR_STATE: StateError,
    ERR_UNSUPPORTED: UnsupportedError,
}


class _ConnectOptions(ctypes.Structure):
    # Field order and types follow bytecomp_connect_options in bytecomp.h.
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("socket_path", ctypes.c_char_p),
        ("job_id", ctypes.c_char_p),
        ("local_rank", ctypes.c_uint32),
        ("local_size", ctypes.c_uint32),
        ("node_rank", ctypes.c_uint32),
        ("num_nodes", ctypes.c_uint32),
        ("connect_timeout_ms", ctypes.c_uint32),
        ("daemon_timeout_ms", ctypes.c_uint32),
    ]


def _source_root():
    # client/python/bytecomp/_lib.py -> the repository root.
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))


def library_candidates():
    """Paths tried for libbytecomp, in order (see the module docstring)."""
    out = []
    explicit = os.environ.get("BYTECOMP_LIBRARY")
    if explicit:
        return [explicit]
    build = os.environ.get("BYTECOMP_BUILD_ROOT")
    if build:
        out.append(os.path.join(build, "client", "libbytecomp.so.1"))
    out.append(os.path.join(_source_root(), "build", "client", "libbytecomp.so.1"))
    out.append(ctypes.util.find_library("bytecomp") or "libbytecomp.so.1")
    return out


_lib = None
_lib_lock = threading.Lock()


def _declare(lib):
    c = ctypes
    u32, u64, vp = c.c_uint32, c.c_uint64, c.c_void_p
    lib.bytecomp_connect_options_init.argtypes = [c.POINTER(_ConnectOptions)]
    lib.bytecomp_connect_options_init.restype = None
    lib.bytecomp_connect.argtypes = [c.POINTER(_ConnectOptions), c.POINTER(vp)]
    lib.bytecomp_declare_tensor.argtypes = [vp, c.c_char_p, u64, c.c_int, c.c_int,
                                           c.c_int32, c.POINTER(u32)]
    lib.bytecomp_start.argtypes = [vp, u32]
    lib.bytecomp_tensor_id.argtypes = [vp, c.c_char_p, c.POINTER(u32)]
    lib.bytecomp_tensor_buffer.argtypes = [vp, u32, c.POINTER(vp), c.POINTER(u64)]
    lib.bytecomp_push_pull.argtypes = [vp, u32, u64, c.POINTER(u64)]
    lib.bytecomp_wait.argtypes = [vp, u64, u32]
    lib.bytecomp_poll.argtypes = [vp, u64, c.POINTER(c.c_int)]
    lib.bytecomp_close.argtypes = [vp]
    for f in ("bytecomp_connect", "bytecomp_declare_tensor", "bytecomp_start",
              "bytecomp_tensor_id", "bytecomp_tensor_buffer", "bytecomp_push_pull",
              "bytecomp_wait", "bytecomp_poll", "bytecomp_close"):
        getattr(lib, f).restype = c.c_int
    lib.bytecomp_last_error.argtypes = []
    lib.bytecomp_last_error.restype = c.c_char_p
    lib.bytecomp_status_name.argtypes = [c.c_int]
    lib.bytecomp_status_name.restype = c.c_char_p
    lib.bytecomp_dtype_size.argtypes = [c.c_int]
    lib.bytecomp_dtype_size.restype = u32
    lib.bytecomp_abi_version.argtypes = []
    lib.bytecomp_abi_version.restype = u32
    lib.bytecomp_version_string.argtypes = []
    lib.bytecomp_version_string.restype = c.c_char_p
    # ABI 1.1 (BYTECOMP_1.1): absent from older libraries.
    if hasattr(lib, "bytecomp_set_strategy"):
        lib.bytecomp_set_strategy.argtypes = [vp, c.c_char_p, c.c_char_p]
        lib.bytecomp_set_strategy.restype = c.c_int
    # ABI 1.2 (BYTECOMP_1.2): absent from older libraries.
    if hasattr(lib, "bytecomp_broadcast"):
        lib.bytecomp_broadcast.argtypes = [vp, u32, u64, u32, u64, u64, c.POINTER(u64)]
        lib.bytecomp_broadcast.restype = c.c_int
        lib.bytecomp_barrier.argtypes = [vp, c.POINTER(u64)]
        lib.bytecomp_barrier.restype = c.c_int
    # ABI 1.3 (BYTECOMP_1.3): client-compressed push_pulls.
    if hasattr(lib, "bytecomp_push_pull_compressed"):
        lib.bytecomp_push_pull_compressed.argtypes = [vp, u32, u64, c.POINTER(u64)]
        lib.bytecomp_push_pull_compressed.restype = c.c_int
        lib.bytecomp_partition_bytes.argtypes = [vp, c.POINTER(u64)]
        lib.bytecomp_partition_bytes.restype = c.c_int
    # ABI 1.4 (BYTECOMP_1.4): a compressed push whose leading partitions are
    # dense (the strategy's cpu_share).
    if hasattr(lib, "bytecomp_push_pull_split"):
        lib.bytecomp_push_pull_split.argtypes = [vp, u32, u64, u32, c.POINTER(u64)]
        lib.bytecomp_push_pull_split.restype = c.c_int
    # ABI 1.5 (BYTECOMP_1.5): a tensor's own partitions (the strategy's pieces).
    if hasattr(lib, "bytecomp_tensor_partitions"):
        lib.bytecomp_tensor_partitions.argtypes = [vp, u32, c.POINTER(u64), c.POINTER(u32)]
        lib.bytecomp_tensor_partitions.restype = c.c_int


def library():
    """The loaded libbytecomp (loaded once per process)."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in library_candidates():
            if os.sep in path and not os.path.exists(path):
                tried.append("%s (no such file)" % path)
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append("%s (%s)" % (path, e))
                continue
            _declare(lib)
            abi = lib.bytecomp_abi_version()
            if abi < ABI_VERSION:
                raise VersionMismatchError(
                    "BYTECOMP_ERR_VERSION_MISMATCH",
                    "%s has C ABI version %d, this Python package needs >= %d: "
                    "install matching releases" % (path, abi, ABI_VERSION))
            _lib = lib
            return lib
        raise DaemonUnavailableError(
            "BYTECOMP_ERR_UNAVAILABLE",
            "cannot load libbytecomp; tried: %s. Build the project (meson compile -C build), "
            "or set BYTECOMP_LIBRARY to the path of libbytecomp.so.1" % "; ".join(tried))


def has_set_strategy():
    """Whether the loaded libbytecomp has bytecomp_set_strategy (ABI 1.1)."""
    return hasattr(library(), "bytecomp_set_strategy")


def has_client_compression():
    """Whether the loaded libbytecomp has bytecomp_push_pull_compressed and
    bytecomp_partition_bytes (ABI 1.3)."""
    return hasattr(library(), "bytecomp_push_pull_compressed")


def has_split_push():
    """Whether the loaded libbytecomp has bytecomp_push_pull_split (ABI 1.4)."""
    return hasattr(library(), "bytecomp_push_pull_split")


def has_collectives():
    """Whether the loaded libbytecomp has bytecomp_broadcast and
    bytecomp_barrier (ABI 1.2)."""
    return hasattr(library(), "bytecomp_broadcast")


def version_string():
    return library().bytecomp_version_string().decode()


def dtype_size(dtype):
    return int(library().bytecomp_dtype_size(dtype))


def _raise(status):
    lib = library()
    msg = lib.bytecomp_last_error().decode(errors="replace")
    name = lib.bytecomp_status_name(status).decode()
    raise _CLASS_BY_STATUS.get(status, BytecompError)(name, msg)


class Client:
    """One connection to bytecompd, joined to one job (bytecomp_client*)."""

    def __init__(self, job_id, local_rank=0, local_size=1, node_rank=0, num_nodes=1,
                 socket_path=None, connect_timeout_ms=10000, daemon_timeout_ms=0):
        lib = library()
        self._lib = lib
        opts = _ConnectOptions()
        lib.bytecomp_connect_options_init(ctypes.byref(opts))
        # Keep the encoded strings alive for the duration of the call.
        self._job = job_id.encode()
        self._sock = socket_path.encode() if socket_path else None
        opts.job_id = self._job
        opts.socket_path = self._sock
        opts.local_rank = local_rank
        opts.local_size = local_size
        opts.node_rank = node_rank
        opts.num_nodes = num_nodes
        opts.connect_timeout_ms = connect_timeout_ms
        # 0: $BYTECOMP_DAEMON_TIMEOUT_MS, else 5000 (the daemon's liveness bound)
        opts.daemon_timeout_ms = daemon_timeout_ms
        handle = ctypes.c_void_p()
        s = lib.bytecomp_connect(ctypes.byref(opts), ctypes.byref(handle))
        if s != OK:
            _raise(s)
        self._c = handle
        self.job_id = job_id
        self._closed = False

    def _check(self, status):
        if status != OK:
            _raise(status)

    def declare(self, name, count, dtype, device=DEVICE_CPU, device_index=0):
        out = ctypes.c_uint32()
        self._check(self._lib.bytecomp_declare_tensor(
            self._c, name.encode(), count, dtype, device, device_index, ctypes.byref(out)))
        return out.value

    def set_strategy(self, yaml_text, source_name=None):
        """This job's own strategy (before start(); the daemon checks it at
        start and names `source_name` in its errors). UnsupportedError when
        the library predates ABI 1.1."""
        if not hasattr(self._lib, "bytecomp_set_strategy"):
            raise UnsupportedError(
                "BYTECOMP_ERR_UNSUPPORTED",
                "this libbytecomp (%s) has no bytecomp_set_strategy (ABI 1.1): a job cannot "
                "have its own strategy; give the daemons the strategy instead "
                "(bytecomp-run --strategy, or strategy.file in daemon.yaml)" % version_string())
        self._check(self._lib.bytecomp_set_strategy(
            self._c, yaml_text.encode(), source_name.encode() if source_name else None))

    def start(self, timeout_ms):
        self._check(self._lib.bytecomp_start(self._c, timeout_ms))

    def tensor_id(self, name):
        out = ctypes.c_uint32()
        self._check(self._lib.bytecomp_tensor_id(self._c, name.encode(), ctypes.byref(out)))
        return out.value

    def buffer(self, tensor_id):
        """(address, bytes) of this process's shared-memory buffer of a tensor."""
        addr = ctypes.c_void_p()
        nbytes = ctypes.c_uint64()
        self._check(self._lib.bytecomp_tensor_buffer(self._c, tensor_id, ctypes.byref(addr),
                                                     ctypes.byref(nbytes)))
        return addr.value, nbytes.value

    def push_pull(self, tensor_id, iteration):
        h = ctypes.c_uint64()
        self._check(self._lib.bytecomp_push_pull(self._c, tensor_id, iteration, ctypes.byref(h)))
        return h.value

    def push_pull_compressed(self, tensor_id, iteration):
        """bytecomp_push_pull_compressed: the buffer holds, at the start of
        each partition's range, that partition's compressed payload."""
        h = ctypes.c_uint64()
        self._check(self._lib.bytecomp_push_pull_compressed(self._c, tensor_id, iteration,
                                                            ctypes.byref(h)))
        return h.value

    def push_pull_split(self, tensor_id, iteration, dense_partitions):
        """bytecomp_push_pull_split: as push_pull_compressed, but the first
        `dense_partitions` partitions hold the dense gradient (the daemon's
        CPU pool compresses them: cpu_share)."""
        if dense_partitions == 0:
            return self.push_pull_compressed(tensor_id, iteration)
        h = ctypes.c_uint64()
        self._check(self._lib.bytecomp_push_pull_split(self._c, tensor_id, iteration,
                                                       dense_partitions, ctypes.byref(h)))
        return h.value

    def partition_bytes(self):
        """The job's partition size (0 until the daemon published it), or 0
        with a libbytecomp older than ABI 1.3."""
        if not hasattr(self._lib, "bytecomp_partition_bytes"):
            return 0
        n = ctypes.c_uint64()
        self._check(self._lib.bytecomp_partition_bytes(self._c, ctypes.byref(n)))
        return n.value

    def tensor_partitions(self, tensor_id):
        """bytecomp_tensor_partitions: (partition bytes, partitions) of one
        tensor, the job's partition size cut into its strategy's `pieces`;
        (0, 0) until the daemon published them. A libbytecomp older than ABI
        1.5 (whose daemons do not cut by pieces) gives the job's partition
        size and the count it makes."""
        if not hasattr(self._lib, "bytecomp_tensor_partitions"):
            pb = self.partition_bytes()
            if pb == 0:
                return 0, 0
            nbytes = self.buffer(tensor_id)[1]
            return pb, max(1, -(-nbytes // pb))
        pb = ctypes.c_uint64()
        parts = ctypes.c_uint32()
        self._check(self._lib.bytecomp_tensor_partitions(self._c, tensor_id, ctypes.byref(pb),
                                                         ctypes.byref(parts)))
        return pb.value, parts.value

    def _need_collectives(self, call):
        if not hasattr(self._lib, "bytecomp_broadcast"):
            raise UnsupportedError(
                "BYTECOMP_ERR_UNSUPPORTED",
                "this libbytecomp (%s) has no %s (ABI 1.2): install a libbytecomp and "
                "bytecompd of the same release" % (version_string(), call))

    def broadcast(self, tensor_id, iteration, root_rank, nbytes, tag=0):
        """bytecomp_broadcast: starts copying root_rank's first `nbytes` bytes
        of the tensor's buffer into every rank's; returns the handle (wait
        with wait_once). Every rank passes the same values."""
        self._need_collectives("bytecomp_broadcast")
        h = ctypes.c_uint64()
        self._check(self._lib.bytecomp_broadcast(self._c, tensor_id, iteration, root_rank,
                                                 nbytes, tag & 0xFFFFFFFFFFFFFFFF,
                                                 ctypes.byref(h)))
        return h.value

    def barrier(self):
        """bytecomp_barrier: returns the handle, done once every rank of
        the job entered the barrier."""
        self._need_collectives("bytecomp_barrier")
        h = ctypes.c_uint64()
        self._check(self._lib.bytecomp_barrier(self._c, ctypes.byref(h)))
        return h.value

    def wait_once(self, handle, timeout_ms):
        """One bytecomp_wait. True when done, False on timeout (handle stays
        valid); raises on any other failure."""
        s = self._lib.bytecomp_wait(self._c, handle, timeout_ms)
        if s == OK:
            return True
        if s == ERR_TIMEOUT:
            return False
        _raise(s)

    def poll(self, handle):
        done = ctypes.c_int()
        self._check(self._lib.bytecomp_poll(self._c, handle, ctypes.byref(done)))
        return bool(done.value)

    def close(self):
        """Leaves the job. Returns None, or the error that ended the job (as an
        exception object, not raised: closing always succeeds)."""
        if self._closed:
            return None
        self._closed = True
        s = self._lib.bytecomp_close(self._c)
        self._c = None
        if s == OK:
            return None
        try:
            _raise(s)
        except BytecompError as e:
            return e

    @property
    def closed(self):
        return self._closed
