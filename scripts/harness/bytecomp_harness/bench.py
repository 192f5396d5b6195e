"""Worker side of scripts/bench-torch (run under bytecomp-run).

    python3 -m bytecomp_harness.bench small RUNS ITERS BC_BENCH   # Python path overhead
    python3 -m bytecomp_harness.bench resnet RUNS ITERS PORT      # ResNet-18: bytecomp vs gloo

small: every run, all local processes do round trips of one 4-byte tensor
    through the Python binding (push_pull + wait) and with the C client
    (BC_BENCH, tests/daemon/bc_bench) on the same daemon, in 10 alternating
    blocks of ITERS/10; then DistributedOptimizer.synchronize() against the
    bare binding on 62 one-element tensors. Rank 0 prints 'small RUN py_us
    C_us binding_cpu_us optimizer_cpu_us': wall-clock round trips (medians)
    and the CPU time per call/tensor the binding adds over C and the
    optimizer adds over the binding (medians of paired block differences).
resnet: the 62 gradient tensors of ResNet-18 (11.7M parameters) are averaged
    over every process, alternately through bytecomp.torch (a
    DistributedOptimizer's synchronize(): push all, wait all, divide) and
    through torch.distributed gloo allreduce of the same tensors (async per
    tensor, wait all, divide), ITERS iterations each per run. Rank 0 prints
    'resnet RUN bytecomp_ms gloo_ms gloo_flat_ms' (medians of the run);
    gloo_flat is one allreduce of all gradients flattened into one buffer
    (what DDP's bucketing approaches), for context.
"""

import ctypes
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import bytecomp.torch as bc
from bytecomp import _lib


def _child_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _bc_bench(bc_bench, s, job, iters):
    """Runs the C client for `iters` round trips; (wall RTT median in us as
    bc_bench prints it on rank 0 else None, CPU seconds the child used)."""
    c0 = _child_cpu()
    out = subprocess.run([bc_bench, s.socket_path, job, str(s.local_rank), str(s.local_size),
                          "small", str(iters)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit("bc_bench failed: " + out.stderr)
    wall = float(out.stdout.split()[1]) if s.rank == 0 else None
    return wall, _child_cpu() - c0


def _small(runs, iters, bc_bench, blocks=10):
    """Per run, `blocks` alternating blocks of round trips of a 4-byte tensor
    through the Python binding and through the C client. Overhead is
    measured in CPU time (time.process_time; the C client's from rusage of
    two bc_bench runs of N and 2N round trips, whose difference cancels its
    start-up), which a loaded machine disturbs far less than wall time;
    wall-clock round trips are printed alongside."""
    bc.init()
    s = bc._ctx.settings
    per = max(50, iters // blocks)
    for run in range(runs):
        job = "%s.small%d" % (s.job_id, run)
        c = _lib.Client(job, s.local_rank, s.local_size, socket_path=s.socket_path)
        t = c.declare("t", 1, _lib.FLOAT32)
        c.start(30000)
        addr, n = c.buffer(t)
        ctypes.memset(addr, 0, n)  # zeros stay zeros however often summed
        it = 0
        walls, cpu_diffs = [], []
        for b in range(blocks):
            rtt = []
            cpu0 = time.process_time()
            for k in range(per):
                t0 = time.perf_counter()
                h = c.push_pull(t, it)
                while not c.wait_once(h, 60000):
                    pass
                it += 1
                rtt.append(time.perf_counter() - t0)
            py_cpu = (time.process_time() - cpu0) / per
            c_wall, c1 = _bc_bench(bc_bench, s, "%s.c%d.%da" % (s.job_id, run, b), per)
            _, c2 = _bc_bench(bc_bench, s, "%s.c%d.%db" % (s.job_id, run, b), 2 * per)
            c_cpu = (c2 - c1) / per
            cpu_diffs.append(1e6 * (py_cpu - c_cpu))
            if s.rank == 0:
                walls.append((1e6 * statistics.median(rtt), c_wall))
        c.close()
        extra = _optimizer_extra(s, run, per)
        bc.barrier()
        if s.rank == 0:
            print("small %d %.2f %.2f %.2f %.2f" % (
                run, statistics.median(p for p, _ in walls),
                statistics.median(q for _, q in walls), statistics.median(cpu_diffs), extra),
                flush=True)


def _sum_once(opt):
    """One synchronize() (push all, wait all, average) without the wrapped
    optimizer's step: synchronize() alone does nothing a second time before
    a step() (it is there for clipping), so mark the sums as not done."""
    opt._bc_synced = False
    opt.synchronize()


def _optimizer_extra(s, run, iters, n=62, blocks=5):
    """CPU time DistributedOptimizer adds per tensor over the bare binding:
    62 one-element tensors, one step = push all, wait all (bare) vs
    synchronize() (push all, wait all, average), alternating blocks; median
    of the blocks' per-tensor differences, in microseconds."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(n)]
    opt = bc.DistributedOptimizer(torch.optim.SGD(params, lr=0.0),
                                  named_parameters=[("t%02d" % i, p) for i, p in
                                                    enumerate(params)])
    c = _lib.Client("%s.bare%d" % (s.job_id, run), s.local_rank, s.local_size,
                    socket_path=s.socket_path)
    ids = [c.declare("t%02d" % i, 1, _lib.FLOAT32) for i in range(n)]
    c.start(30000)
    for t in ids:
        addr, nb = c.buffer(t)
        ctypes.memset(addr, 0, nb)
    it = 0
    per = max(20, iters // 10)
    diffs = []
    for _ in range(blocks):
        t0 = time.process_time()
        for _ in range(per):
            hs = [c.push_pull(t, it) for t in ids]
            for h in hs:
                while not c.wait_once(h, 60000):
                    pass
            it += 1
        bare = time.process_time() - t0
        t0 = time.process_time()
        for _ in range(per):
            _sum_once(opt)
        full = time.process_time() - t0
        diffs.append(1e6 * (full - bare) / per / n)
    c.close()
    opt._bytecomp_detach()
    return statistics.median(diffs)


def resnet18_shapes():
    """Parameter shapes of torchvision's resnet18 (62 tensors, 11,689,512)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inp = 64
    for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            s = stride if block == 0 else 1
            shapes += [(planes, inp, 3, 3), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,)]
            if block == 0 and (s != 1 or inp != planes):
                shapes += [(planes, inp, 1, 1), (planes,), (planes,)]
            inp = planes
    shapes += [(1000, 512), (1000,)]
    return shapes


def _resnet(runs, iters, port):
    bc.init()
    s = bc._ctx.settings
    shapes = resnet18_shapes()
    assert len(shapes) == 62 and sum(torch.Size(x).numel() for x in shapes) == 11689512
    torch.manual_seed(s.rank)
    params = [torch.nn.Parameter(torch.zeros(x)) for x in shapes]
    named = [("p%02d" % i, p) for i, p in enumerate(params)]
    opt = bc.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=named)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=s.rank, world_size=s.size)
    grads = [torch.randn(x) for x in shapes]
    flat = torch.cat([g.reshape(-1) for g in grads])
    for p, g in zip(params, grads):
        p.grad.copy_(g)          # p.grad is the shared-memory buffer
    ref = [g.clone() for g in grads]
    for t in ref:
        dist.all_reduce(t)
        t /= s.size
    opt.synchronize()
    for p, r in zip(params, ref):  # both paths average the same values
        if not torch.allclose(p.grad, r, rtol=1e-5, atol=1e-5):
            raise SystemExit("bytecomp and gloo averages differ")
    for run in range(runs):
        bt, gt, ft = [], [], []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            _sum_once(opt)                     # push all 62, wait, average
            bt.append(time.perf_counter() - t0)
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            works = [dist.all_reduce(g, async_op=True) for g in reversed(grads)]
            for w in works:
                w.wait()
            torch._foreach_mul_(grads, 1.0 / s.size)
            gt.append(time.perf_counter() - t0)
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            flat /= s.size
            ft.append(time.perf_counter() - t0)
        if s.rank == 0:
            print("resnet %d %.2f %.2f %.2f" % (run, 1e3 * statistics.median(bt),
                                                1e3 * statistics.median(gt),
                                                1e3 * statistics.median(ft)), flush=True)
    dist.destroy_process_group()


def main(argv):
    mode = argv[0]
    if mode == "small":
        _small(int(argv[1]), int(argv[2]), argv[3])
    elif mode == "resnet":
        _resnet(int(argv[1]), int(argv[2]), int(argv[3]))
    else:
        raise SystemExit("usage: bench.py small|resnet ...")


if __name__ == "__main__":
    main(sys.argv[1:])
