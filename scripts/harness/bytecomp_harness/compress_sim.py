"""bench-cluster's accuracy task trained by N simulated nodes in one
process, each node's compressor and the servers' recompression taken from
the documented algorithms (tests/python/semantics_ref.py, which
`python_semantics` checks against the real system). For narrowing down
why a compressor misses (docs/cluster.md, "Which tensors a compressor
covers"): vary one thing at a time, where a cluster run costs minutes.

    cd scripts/harness && python3 -m bytecomp_harness.compress_sim --comp efsignsgd \\
        --min-bytes 262144 --seeds 1,2

Per step every node computes its rank's gradient of its share of the
global batch (tasks.Task.batch); per tensor of at least --min-bytes
bytes each node's codec (with its state: residual, DGC's momentum)
decodes(compresses) it, the pushes are summed in float32 and, with
--server recompress (alltoall_allgather), recompressed by the server's
codec (no momentum; a residual for the compressors with error
feedback); smaller tensors are summed exactly. The optimizer (SGD, the
task's momentum; none on the tensors of a compressor with a momentum of
its own unless --sgd-momentum-on-compressed 1) steps on the mean. One JSON
line per run set.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

from bytecomp_harness.tasks import Task, lr_at, settings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "tests", "python"))
import semantics_ref as R  # noqa: E402


def run(a, seed):
    st = settings(a.task, {"lr": a.lr or None, "steps": a.steps or None})
    task = Task(a.task, seed)
    torch.manual_seed(seed)
    model = task.model()
    params = list(model.named_parameters())
    comp = {n for n, p in params
            if a.comp != "none" and p.numel() * p.element_size() >= a.min_bytes}
    own = a.comp in ("dgc", "signum")
    mom_on = (not own) if a.sgd_momentum_on_compressed < 0 else bool(a.sgd_momentum_on_compressed)
    plain = [p for n, p in params if n not in comp or mom_on]
    bare = [p for n, p in params if n in comp and not mom_on]
    opt = torch.optim.SGD([{"params": plain, "momentum": st["momentum"]}] +
                          ([{"params": bare, "momentum": 0.0}] if bare else []),
                          lr=st["lr"], momentum=st["momentum"])
    worker_ef = a.comp in R.BUILTIN_EF or (a.error_feedback and a.comp in R.EF_PARAM_DEFAULT)
    server_ef = a.comp in R.BUILTIN_EF or bool(a.error_feedback)
    momentum = {"dgc": R.DGC_MOMENTUM, "signum": R.SIGNUM_MOMENTUM}.get(a.comp)
    cp = {"ratio": a.ratio}
    codecs = {n: ([R.Codec(a.comp, p.numel(), worker_ef, momentum, cp) for _ in range(a.nodes)],
                  R.Codec(a.comp, p.numel(), server_ef, None, cp))
              for n, p in params if n in comp}
    evals = []

    def evaluate(step):
        _, correct, count = task.evaluate(model)
        evals.append((step, 100.0 * correct / count))
    evaluate(0)
    for step in range(st["steps"]):
        grads = {n: [] for n, _ in params}
        for r in range(a.nodes):
            x, y = task.batch(step, r, a.nodes, st["batch"])
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for n, p in params:
                grads[n].append(p.grad.detach().numpy().ravel().astype(np.float32).copy())
        for n, p in params:
            total = np.zeros(p.numel(), np.float32)
            if n in comp:
                nodes, server = codecs[n]
                for codec, g in zip(nodes, grads[n]):
                    total = (total + codec(g, step)).astype(np.float32)
                if a.server == "recompress" and a.nodes > 1:
                    total = server(total, step)
            else:
                for g in grads[n]:
                    total = (total + g).astype(np.float32)
            p.grad = torch.from_numpy(total / a.nodes).reshape(p.shape)
        for g in opt.param_groups:
            g["lr"] = lr_at(st, step)
        opt.step()
        if (step + 1) % st["eval_every"] == 0 or step + 1 == st["steps"]:
            evaluate(step + 1)
    hit = next((s for s, acc in evals if acc >= st["target"]), None)
    return {"seed": seed, "final_accuracy": round(evals[-1][1], 2),
            "best_accuracy": round(max(e[1] for e in evals), 2), "step_to_target": hit,
            "curve": [round(e[1], 2) for e in evals]}, sorted(comp), st


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="digits")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--comp", default="none", help="none or a compressor of semantics_ref "
                    "with a deterministic reference (efsignsgd, topk, dgc, fp16, ...)")
    ap.add_argument("--ratio", default="0.01", help="sparsifiers' share of the elements")
    ap.add_argument("--min-bytes", type=int, default=262144,
                    help="smallest tensor compressed (bench-cluster's --compress-min-bytes)")
    ap.add_argument("--error-feedback", type=int, default=1,
                    help="topk/randomk: node and server residuals (bench-cluster: 1)")
    ap.add_argument("--server", choices=("recompress", "exact"), default="recompress",
                    help="the servers recompress the sum (alltoall_allgather) or sum exactly")
    ap.add_argument("--sgd-momentum-on-compressed", type=int, default=-1,
                    help="-1: as bench-cluster (none under dgc/signum); 0 or 1: forced")
    ap.add_argument("--lr", type=float, default=0, help="default: the task's")
    ap.add_argument("--steps", type=int, default=0, help="default: the task's")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    if a.nodes < 1:
        ap.error("--nodes must be >= 1")
    torch.set_num_threads(a.threads)
    runs = []
    for seed in [int(s) for s in a.seeds.split(",") if s]:
        r, comp, st = run(a, seed)
        runs.append(r)
    print(json.dumps({"args": vars(a), "lr": st["lr"], "compressed": comp, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
