"""What a compressor can keep of each tensor's gradient, per tensor, on
bench-cluster's accuracy tasks (docs/cluster.md, "Why a compressor misses").

    cd scripts/harness && python3 -m bytecomp_harness.grad_stats --task digits --world 4

One process follows the exact-averaging trajectory of a `--world`-process
run (as lr_sweep: the task's learning rate, SGD momentum, every rank's
share of the global batch) and at every step takes each rank's own
gradient, the input of that rank's node compressor. Per tensor it reports
medians over ranks and steps of:

  zeros      the share of elements that are exactly 0
  sign_keep  ||g||_1^2 / (n ||g||_2^2): the share of the gradient's energy
             that a scaled sign, (||g||_1 / n) sign(g) (efsignsgd), keeps in
             one step (1: every element of one magnitude; 2/pi for Gaussian
             elements; small for a few large elements among many small ones)
  topk_keep  the share of the energy in the largest --ratio of the elements
             (topk, dgc)

What one step does not keep, error feedback carries to later steps.
Prints a table, then one JSON line.
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from bytecomp_harness.tasks import Task, lr_at, settings


def stats_of(g, ratio):
    g = g.detach().reshape(-1).double()
    n = g.numel()
    e = float((g * g).sum())
    if e == 0.0:
        return {"zeros": 1.0, "sign_keep": 0.0, "topk_keep": 0.0}
    k = max(1, int(ratio * n + 0.5))
    top = torch.topk(g.abs(), k).values
    return {"zeros": float((g == 0).sum()) / n,
            "sign_keep": float(g.abs().sum()) ** 2 / (n * e),
            "topk_keep": float((top * top).sum()) / e}


def run(name, world, seed, steps, lr, ratio):
    st = settings(name, {"steps": steps or None, "lr": lr or None})
    task = Task(name, seed)
    torch.manual_seed(seed)
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=st["lr"], momentum=st["momentum"])
    per = {n: {"zeros": [], "sign_keep": [], "topk_keep": []}
           for n, _ in model.named_parameters()}
    for step in range(st["steps"]):
        for g in opt.param_groups:
            g["lr"] = lr_at(st, step)
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for r in range(world):
            x, y = task.batch(step, r, world, st["batch"])
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for n, p in model.named_parameters():
                for k, v in stats_of(p.grad, ratio).items():
                    per[n][k].append(v)
                total[n] += p.grad
        for n, p in model.named_parameters():
            p.grad = total[n] / world
        opt.step()
    return st, {n: {k: statistics.median(v) for k, v in d.items()} for n, d in per.items()}, {
        n: p.numel() * p.element_size() for n, p in model.named_parameters()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="digits")
    ap.add_argument("--world", type=int, default=4, help="processes of the run it stands for")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="default: the task's")
    ap.add_argument("--lr", type=float, default=0, help="default: the task's")
    ap.add_argument("--ratio", type=float, default=0.01, help="topk's share of the elements")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    if a.world < 1 or not 0 < a.ratio <= 1:
        ap.error("--world must be >= 1 and --ratio in (0, 1]")
    torch.set_num_threads(a.threads)
    st, stats, sizes = run(a.task, a.world, a.seed, a.steps, a.lr, a.ratio)
    print("%s: world %d x batch %d, lr %g, %d steps, seed %d; medians over ranks and steps\n"
          % (a.task, a.world, st["batch"], st["lr"], st["steps"], a.seed))
    print("| tensor | bytes | zeros | sign_keep | top %g%% keep |\n|---|---|---|---|---|"
          % (100 * a.ratio))
    for n, s in stats.items():
        print("| %s | %d | %.3f | %.3f | %.3f |" % (n, sizes[n], s["zeros"], s["sign_keep"],
                                                  s["topk_keep"]))
    print(json.dumps({"task": a.task, "world": a.world, "lr": st["lr"], "steps": st["steps"],
                      "seed": a.seed, "ratio": a.ratio,
                      "tensors": {n: dict(bytes=sizes[n], **{k: round(v, 4) for k, v in s.items()})
                                  for n, s in stats.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
