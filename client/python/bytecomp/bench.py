"""Worker side of scripts/bench-torch (run under bytecomp-run).

    python3 -m bytecomp.bench small RUNS ITERS BC_BENCH   # Python path overhead
    python3 -m bytecomp.bench resnet RUNS ITERS PORT      # ResNet-18: bytecomp vs gloo

small: every run, all local processes do round trips of one 4-byte tensor
    through the Python binding (push_pull + wait) and with the C client
    (BC_BENCH, tests/daemon/bc_bench) on the same daemon, in 10 alternating
    blocks of ITERS/10. Rank 0 prints 'small RUN py_us C_us overhead_us'
    (medians over the blocks; overhead: median of paired differences).
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
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import bytecomp.torch as bc
from bytecomp import _lib


def _small(runs, iters, bc_bench, blocks=10):
    """Per run: `blocks` pairs of (Python block, C block) of iters/blocks round
    trips each, alternating, so both sides see the same machine load; the
    run's overhead is the median of the pairs' differences of medians."""
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
        pairs = []
        for b in range(blocks):
            rtt = []
            for k in range(per + 3):
                t0 = time.perf_counter()
                h = c.push_pull(t, it)
                while not c.wait_once(h, 60000):
                    pass
                it += 1
                if k >= 3:
                    rtt.append(time.perf_counter() - t0)
            out = subprocess.run([bc_bench, s.socket_path, "%s.c%d.%d" % (s.job_id, run, b),
                                  str(s.local_rank), str(s.local_size), "small", str(per)],
                                 capture_output=True, text=True, timeout=120)
            if out.returncode != 0:
                raise SystemExit("bc_bench failed: " + out.stderr)
            if s.rank == 0:
                pairs.append((1e6 * statistics.median(rtt), float(out.stdout.split()[1])))
        c.close()
        bc.barrier()
        if s.rank == 0:
            py_us = statistics.median(p for p, _ in pairs)
            c_us = statistics.median(q for _, q in pairs)
            diff = statistics.median(p - q for p, q in pairs)
            print("small %d %.2f %.2f %.2f" % (run, py_us, c_us, diff), flush=True)


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
            opt.synchronize()                  # push all 62, wait, average
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
