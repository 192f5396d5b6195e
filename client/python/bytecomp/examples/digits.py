"""Data-parallel training of an MLP on scikit-learn's handwritten digits
(1797 8x8 images shipped by Debian's python3-sklearn) with bytecomp.torch.

Run under a launcher, e.g. from the source tree:

    scripts/bytecomp-run --nodes 2 --nproc-per-node 2 --strategy configs/demo-strategy.yaml \\
        client/python/bytecomp/examples/digits.py

Each process trains on its shard of every global batch; gradients are
summed by the ByteComp daemons (compressed per the strategy) and averaged.
Rank 0 prints one line per epoch (mean training loss, test accuracy,
samples/s) and, with --out, writes the run's figures as JSON.
"""

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import bytecomp.torch as bc


def load_data(seed=0, test_size=360):
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    perm = np.random.RandomState(seed).permutation(len(y))
    test, train = perm[:test_size], perm[test_size:]
    return (torch.from_numpy(x[train]), torch.from_numpy(y[train]),
            torch.from_numpy(x[test]), torch.from_numpy(y[test]))


class MLP(torch.nn.Module):
    def __init__(self, hidden=512):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden // 2)
        self.fc3 = torch.nn.Linear(hidden // 2, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=16, help="per process")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--strategy", default=os.environ.get("BYTECOMP_STRATEGY"),
                    help="strategy file the daemons run (default: $BYTECOMP_STRATEGY, set by "
                         "bytecomp-run --strategy; none: uncompressed)")
    ap.add_argument("--label", default="", help="name of this run in the output")
    ap.add_argument("--out", default=None, help="rank 0 writes a JSON summary here")
    args = ap.parse_args()

    bc.init()
    rank, size = bc.rank(), bc.size()
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data()
    model = MLP(args.hidden)
    # Every process starts from rank 0's weights and optimizer state.
    bc.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    opt = bc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  strategy=args.strategy)
    bc.broadcast_optimizer_state(opt, root_rank=0)
    # Cosine decay to zero: the last epochs settle instead of oscillating, so
    # final accuracies of two runs are comparable.
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)

    global_batch = args.batch_size * size
    steps = len(y_train) // global_batch
    label = args.label or ("compressed" if args.strategy else "uncompressed")
    if rank == 0:
        print("%s: %d processes on %d node(s), %d train / %d test samples, %d steps/epoch, "
              "global batch %d, strategy %s" % (label, size, bc.num_nodes(), len(y_train),
                                                len(y_test), steps, global_batch,
                                                args.strategy or "none"), flush=True)
    history = []
    train_time = 0.0
    for epoch in range(args.epochs):
        # The same permutation everywhere; each process takes its slice of
        # every global batch, so together they cover the epoch once.
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(
            args.seed * 1000 + epoch))
        model.train()
        loss_sum = torch.zeros(1, dtype=torch.float64)
        t0 = time.perf_counter()
        for s in range(steps):
            idx = perm[s * global_batch + rank * args.batch_size:
                       s * global_batch + (rank + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item()
        dt = time.perf_counter() - t0
        sched.step()
        # Each process times its own loop; the slowest sets the pace.
        dt = float(bc.allreduce(torch.tensor([dt]), average=False).item()) / size
        train_time += dt
        mean_loss = float(bc.allreduce(loss_sum / steps).item())
        model.eval()
        with torch.no_grad():
            shard = slice(rank, len(y_test), size)
            correct = (model(x_test[shard]).argmax(1) == y_test[shard]).sum()
        correct = float(bc.allreduce(correct.double().reshape(1), average=False).item())
        acc = 100.0 * correct / len(y_test)
        sps = steps * global_batch / dt
        history.append({"epoch": epoch + 1, "loss": mean_loss, "accuracy": acc,
                        "samples_per_s": sps})
        if rank == 0:
            print("%s epoch %2d/%d  loss %.4f  test accuracy %6.2f%%  %7.0f samples/s" %
                  (label, epoch + 1, args.epochs, mean_loss, acc, sps), flush=True)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"label": label, "strategy": args.strategy, "processes": size,
                       "nodes": bc.num_nodes(), "epochs": history,
                       "final_accuracy": history[-1]["accuracy"],
                       "final_loss": history[-1]["loss"],
                       "samples_per_s": args.epochs * steps * global_batch / train_time},
                      f, indent=1)


if __name__ == "__main__":
    main()
