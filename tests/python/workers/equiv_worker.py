"""Data-parallel SGD for test_training's equivalence check.

Every rank builds the same global batches (fixed seed) and trains on its
slice of each; the model starts from rank 0's weights (each rank first
initialises with its own seed, so the broadcast matters). After --steps
steps each rank saves its parameters to OUT/rank<r>.pt."""
import argparse
import os

import torch

import bytecomp.torch as bc
from equiv_model import Net, batches

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, required=True)
ap.add_argument("--batch", type=int, required=True, help="per rank")
ap.add_argument("--out", required=True)
args = ap.parse_args()

bc.init()
r, n = bc.rank(), bc.size()
torch.manual_seed(100 + r)
model = Net()
bc.broadcast_parameters(model.state_dict(), root_rank=0)
opt = bc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              named_parameters=model.named_parameters())
for x, y in batches(args.steps, args.batch * n):
    opt.zero_grad()
    sl = slice(r * args.batch, (r + 1) * args.batch)
    torch.nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
    opt.step()
torch.save(model.state_dict(), os.path.join(args.out, "rank%d.pt" % r))
