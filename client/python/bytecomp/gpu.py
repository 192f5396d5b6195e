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

    def __init__(self, spec, count):
        lib = library()
        if lib is None:
            raise _lib.UnsupportedError("BYTECOMP_ERR_UNSUPPORTED",
                                        "libbytecomp_gpu not found (tried %s)" %
                                        ", ".join(_candidates()))
        self._lib = lib
        h = ctypes.c_void_p()
        _check(lib, lib.bytecomp_gpu_compressor_create(spec.encode(), count, ctypes.byref(h)),
               "GPU compressor %r for %d elements" % (spec, count))
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
