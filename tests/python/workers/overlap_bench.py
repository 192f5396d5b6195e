"""Step time of DistributedOptimizer with and without overlap_forward, in the
same processes (run under bytecomp-run; not a test):

    bytecomp-run [--nodes 2] --nproc-per-node N overlap_bench.py [--blocks 9 --iters 5]

Two copies of one MLP (same seed), one per mode, trained on the same
batches in alternating blocks of --iters iterations (zero_grad, forward,
backward, step); the time of a block is the slowest rank's (through
bc.allgather). Rank 0 prints the median time per iteration of each mode
and ends with one JSON line. The parameters of both copies are compared
at the end (they must be equal bit for bit)."""
import argparse
import json
import statistics
import time

import torch

import bytecomp.torch as bc

ap = argparse.ArgumentParser()
ap.add_argument("--blocks", type=int, default=9)
ap.add_argument("--iters", type=int, default=5)
ap.add_argument("--width", type=int, default=1024)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--batch", type=int, default=32)
args = ap.parse_args()

bc.init()
torch.set_num_threads(1)


def mlp():
    torch.manual_seed(1)
    mods = []
    for _ in range(args.layers):
        mods += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(args.width, 10))


models = {"default": mlp(), "overlap": mlp()}
opts = {
    "default": bc.DistributedOptimizer(
        torch.optim.SGD(models["default"].parameters(), lr=0.01, momentum=0.9),
        named_parameters=models["default"].named_parameters()),
    "overlap": bc.DistributedOptimizer(
        torch.optim.SGD(models["overlap"].parameters(), lr=0.01, momentum=0.9),
        named_parameters=models["overlap"].named_parameters(),
        overlap_forward=models["overlap"]),
}
g = torch.Generator().manual_seed(5 + bc.rank())
data = [(torch.randn(args.batch, args.width, generator=g),
         torch.randint(0, 10, (args.batch,), generator=g)) for _ in range(args.iters)]
times = {"default": [], "overlap": []}
for b in range(args.blocks + 1):  # block 0 of each mode: warm-up, not counted
    for mode in (("default", "overlap") if b % 2 == 0 else ("overlap", "default")):
        model, opt = models[mode], opts[mode]
        bc.barrier()
        t0 = time.perf_counter()
        for x, y in data:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        # The overlapping mode's last updates are still pending here: they are
        # part of its next block (the next forward), as in training.
        gathered = bc.allgather(dt, name="block")
        if b > 0:
            times[mode].append(float(gathered.max()) / args.iters)
opts["overlap"].drain()
for (k, a), (_, o) in zip(models["default"].named_parameters(),
                          models["overlap"].named_parameters()):
    if not torch.equal(a, o):
        raise AssertionError("parameter %s differs between the modes" % k)
if bc.rank() == 0:
    d = statistics.median(times["default"]) * 1000
    o = statistics.median(times["overlap"]) * 1000
    print("per iteration, median of %d blocks of %d: default %.2f ms, overlap_forward %.2f ms"
          % (args.blocks, args.iters, d, o))
    print("default blocks (ms):", " ".join("%.2f" % (t * 1000) for t in times["default"]))
    print("overlap blocks (ms):", " ".join("%.2f" % (t * 1000) for t in times["overlap"]))
    print(json.dumps({"default_ms": round(d, 3), "overlap_ms": round(o, 3),
                      "overlap_over_default": round(o / d, 4), "ranks": bc.size(),
                      "params_equal": True}))
bc.shutdown()
