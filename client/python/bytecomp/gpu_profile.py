"""`mode: auto` profiles the CUDA compressors where a GPU is present (issue
27, docs/gpu.md §4). The daemon that tunes the job never touches a GPU
(docs/daemon.md "Intra-node on GPUs"), so the training process measures
them, through libbytecomp_gpu on its own device, and reports the points to
its daemon (`gpu_profile JOB REPORT`); the daemon fits them as it fits its
CPU measurements (planner/strategy/profile.h parse_gpu_report) and carries
them in the node's profile (gpu_compressors, gpu_note).

select() is pure logic (host-tested: which of the auto candidates to
measure, or why none); measure() runs a `bench` (TorchCudaBench on a device;
tests pass a fake one) over sizes, medians of `reps` calls per size;
report_text() is the request's YAML."""

import yaml

from bytecomp import gpu as _gpu

# Elements per call: from one small partition to a large tensor's.
SIZES = (1 << 16, 1 << 18, 1 << 20, 1 << 22)
REPS = 5


def candidates(doc):
    """The compressor specs an auto strategy chooses among: its
    `compressors` and fp16 (always a candidate, docs/auto.md)."""
    specs = [str(s) for s in (doc.get("compressors") or [])]
    if "fp16" not in specs:
        specs.append("fp16")
    return specs


def select(specs, caps):
    """(specs to measure on the GPU, note). The note says why something is
    not measured: 'skipped: <why>' when nothing is, else '' or the
    compressors left out and why."""
    if not caps.built:
        return [], "skipped: libbytecomp_gpu has no CUDA kernels (not found, or built without CUDA)"
    if caps.devices == 0:
        return [], "skipped: no CUDA device is visible"
    out, missing = [], []
    for spec in specs:
        name = spec.split(":", 1)[0]
        (out if caps.supported(name) else missing).append(spec)
    if not out:
        return [], "skipped: no CUDA kernels for %s" % ", ".join(missing)
    return out, ("" if not missing else "no CUDA kernels for %s" % ", ".join(missing))


def _median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def measure(specs, bench, sizes=SIZES, reps=REPS):
    """{spec: [{n, compress_us, decompress_us, bytes}, ...]}: per size the
    medians of `reps` calls of bench(spec, n) -> (compress_us,
    decompress_us, payload bytes), after one untimed call."""
    out = {}
    for spec in specs:
        points = []
        for n in sizes:
            bench(spec, n)  # warm-up: allocation, first launch
            runs = [bench(spec, n) for _ in range(reps)]
            points.append({"n": int(n),
                           "compress_us": float(_median([r[0] for r in runs])),
                           "decompress_us": float(_median([r[1] for r in runs])),
                           "bytes": int(_median([r[2] for r in runs]))})
        out[spec] = points
    return out


def report_text(note, measured):
    """The `gpu_profile` report (profile.h parse_gpu_report)."""
    doc = {"version": 1, "note": note,
           "compressors": [{"spec": s, "points": p} for s, p in measured.items()]}
    return yaml.safe_dump(doc, sort_keys=False)


class TorchCudaBench:
    """bench(spec, n) on one CUDA device: a compressor per (spec, n) kept
    across calls (its error-feedback state, as in training), timed with CUDA
    events on the current stream. host=True: the same calls on the host
    stand-in (the CPU library behind libbytecomp_gpu's ABI, CPU tensors,
    wall-clock timing), which the tests run where there is no GPU."""

    def __init__(self, device, host=False):
        import torch
        self._torch = torch
        self.host = bool(host)
        self.device = torch.device("cpu") if host else device
        self.name = "the host stand-in" if host else torch.cuda.get_device_name(device)
        self._made = {}
        self.last = None  # (input, decompressed) of the latest call, for tests

    def __call__(self, spec, n):
        torch = self._torch
        key = (spec, n)
        if key not in self._made:
            c = _gpu.GpuCompressor(spec, n, host=self.host)
            g = torch.Generator(device=self.device).manual_seed(12345)
            x = torch.randn(n, device=self.device, generator=g)
            self._made[key] = (c, x, torch.empty(max(c.max_bytes, 8), dtype=torch.uint8,
                                                 device=self.device),
                               torch.empty(n, device=self.device), [0])
        c, x, wire, out, it = self._made[key]
        if self.host:
            import time
            t0 = time.perf_counter()
            ln = c.compress(x.data_ptr(), wire.data_ptr(), c.max_bytes, it[0], n, 0)
            t1 = time.perf_counter()
            c.decompress(wire.data_ptr(), ln, out.data_ptr(), False, it[0], n, 0)
            t2 = time.perf_counter()
            times = ((t1 - t0) * 1e6, (t2 - t1) * 1e6)
        else:
            stream = torch.cuda.current_stream(self.device)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            ev[0].record(stream)
            ln = c.compress(x.data_ptr(), wire.data_ptr(), c.max_bytes, it[0], n,
                            stream.cuda_stream)
            ev[1].record(stream)
            c.decompress(wire.data_ptr(), ln, out.data_ptr(), False, it[0], n,
                         stream.cuda_stream)
            ev[2].record(stream)
            ev[2].synchronize()
            times = (ev[0].elapsed_time(ev[1]) * 1000.0, ev[1].elapsed_time(ev[2]) * 1000.0)
        it[0] += 1
        self.last = (x, out)
        return times[0], times[1], ln

    def close(self):
        for c, *_ in self._made.values():
            c.close()
        self._made = {}


def profile(doc, device, caps=None, bench=None):
    """(note, measured) for an auto strategy `doc` in a process whose
    parameters are on `device` (None: no CUDA parameter, nothing measured)."""
    specs = candidates(doc)
    if device is None:
        return "skipped: the job's parameters are not on a CUDA device", {}
    to_measure, note = select(specs, _gpu.capabilities() if caps is None else caps)
    if not to_measure:
        return note, {}
    own = bench is None
    # The profile is optional: a device that cannot run the measurement
    # (out of memory, a kernel error) leaves auto planning without it, named
    # in the note, rather than failing the optimizer's start.
    try:
        if own:
            bench = TorchCudaBench(device)
        try:
            measured = measure(to_measure, bench)
        finally:
            if own:
                bench.close()
    except Exception as e:  # noqa: BLE001 - any failure of an optional measurement
        return "skipped: measuring on %s failed: %s: %s" % (device, type(e).__name__, e), {}
    head = "measured on %s" % getattr(bench, "name", device)
    return (head + ("; " + note if note else "")), measured
