"""Learning-rate sweep of bench-cluster's accuracy tasks under exact
averaging (docs/cluster.md, "Accuracy").

    cd scripts/harness && python3 -m bytecomp_harness.lr_sweep --tasks digits,cancer,mlp \\
        --world 2 --lrs 0.003,0.01,0.03,0.05,0.1,0.2 --seeds 1,2

One process trains on the global batch of a `--world`-process run (every
rank's share concatenated): with exact averaging of equal shares that is
the very update each process of the cluster applies. Per task and rate it
reports the training loss per evaluation interval (mean), whether it falls
steadily (finite, no interval mean above the lowest before it by more
than 10 % of the first interval's mean, and the last below the first), the held-out accuracy at the end and the first
step at which it reached the task's target. The chosen rate: the steady
one with the best median final held-out accuracy (ties: the earliest to the
target). Prints a table, then one JSON line.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bytecomp_harness.tasks import TASKS, Task, lr_at, settings


def run(name, lr, seed, world, steps):
    st = settings(name, {"lr": lr, "steps": steps or None})
    task = Task(name, seed)
    torch.manual_seed(seed)
    model = task.model()
    opt = torch.optim.SGD(model.parameters(), lr=st["lr"], momentum=st["momentum"])
    losses, evals = [], []

    def evaluate(step):
        model.eval()
        loss, correct, n = task.evaluate(model)
        model.train()
        evals.append({"step": step, "loss": loss / n, "accuracy": 100.0 * correct / n})

    evaluate(0)
    for step in range(st["steps"]):
        parts = [task.batch(step, r, world, st["batch"]) for r in range(world)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        for g in opt.param_groups:
            g["lr"] = lr_at(st, step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        if (step + 1) % st["eval_every"] == 0 or step + 1 == st["steps"]:
            evaluate(step + 1)
    k = st["eval_every"]
    means = [statistics.mean(losses[i:i + k]) for i in range(0, len(losses), k)]
    # A rise above the lowest interval mean so far, in units of the first
    # interval's mean: late noise around a small loss is not a rise.
    worst = max((max(0.0, means[i] - min(means[:i])) / means[0] for i in range(1, len(means))),
                default=0.0)
    finite = all(math.isfinite(m) for m in means)
    reached = next((e["step"] for e in evals if e["accuracy"] >= st["target"]), None)
    return {"interval_loss": means, "worst_rise": worst,
            "steady": finite and worst <= 0.10 and means[-1] < means[0],
            "final_accuracy": evals[-1]["accuracy"], "heldout_loss": evals[-1]["loss"],
            "step_to_target": reached, "evals": evals, "settings": st}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lrs", default="0.003,0.01,0.03,0.05,0.1,0.2")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--world", type=int, default=2, help="processes of the run it stands for")
    ap.add_argument("--steps", type=int, default=0, help="default: the task's")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    lrs = [float(x) for x in a.lrs.split(",") if x]
    seeds = [int(x) for x in a.seeds.split(",") if x]
    out = {}
    t0 = time.monotonic()
    for name in [t for t in a.tasks.split(",") if t]:
        rows = {}
        for lr in lrs:
            rs = [run(name, lr, s, a.world, a.steps) for s in seeds]
            reach = [r["step_to_target"] for r in rs]
            rows[lr] = {"steady": all(r["steady"] for r in rs),
                        "worst_rise": max(r["worst_rise"] for r in rs),
                        "first_loss": statistics.median(r["interval_loss"][0] for r in rs),
                        "last_loss": statistics.median(r["interval_loss"][-1] for r in rs),
                        "final_accuracy": statistics.median(r["final_accuracy"] for r in rs),
                        "step_to_target": (statistics.median(reach)
                                           if all(x is not None for x in reach) else None)}
        steady = [lr for lr in lrs if rows[lr]["steady"]]
        chosen = (max(steady, key=lambda lr: (round(rows[lr]["final_accuracy"], 1),
                                              -(rows[lr]["step_to_target"] or 1e9)))
                  if steady else None)
        st = settings(name, {"steps": a.steps or None})
        print("\n%s: world %d x batch %d, %d steps, eval every %d, target %.0f%%, seeds %s "
              "(chosen: %s)" % (name, a.world, st["batch"], st["steps"], st["eval_every"],
                                st["target"], a.seeds, chosen))
        print("| lr | steady | worst rise / first loss | train loss first -> last interval | "
              "held-out accuracy % | step to target |\n|---|---|---|---|---|---|")
        for lr in lrs:
            r = rows[lr]
            print("| %g | %s | %.2f | %.3f -> %.3f | %.1f | %s |" % (
                lr, "yes" if r["steady"] else "no", r["worst_rise"], r["first_loss"],
                r["last_loss"], r["final_accuracy"],
                "%g" % r["step_to_target"] if r["step_to_target"] is not None else "-"))
        out[name] = {"chosen_lr": chosen,
                     "rows": {str(lr): {k: (round(v, 4) if isinstance(v, float) else v)
                                        for k, v in r.items()} for lr, r in rows.items()}}
    print("\nlr_sweep: %.0f s" % (time.monotonic() - t0))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
