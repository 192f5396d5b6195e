"""Elastic training with checkpoints: the digits MLP under `torchrun
--max_restarts K`, resuming from its last checkpoint after a failure.

On each node (docs/reliability.md, "Elastic restarts"):

    torchrun --nnodes 2 --nproc_per_node 2 --max_restarts 3 \\
        --rdzv_backend c10d --rdzv_endpoint HOST0:29400 --rdzv_id digits \\
        --redirects 1 --tee 1 \\
        client/python/bytecomp/examples/elastic_digits.py --checkpoint-dir /shared/ckpt

When a rank, a node's daemon or a parameter server dies, every rank's next
bytecomp call raises, torchrun stops the node's workers and starts them
again (after a new rendezvous of every node), and this script picks up at
the last checkpoint: rank 0 loads it and broadcasts the step, the
parameters and the optimizer state to the others.

Every step is a function of its number only (the global batch of step s is
the same slice of the same permutation, the learning rate is constant), so
with uncompressed sums a run that was interrupted and resumed ends with the
same parameters, bit for bit, as one that never stopped. Rank 0 writes a
checkpoint every --checkpoint-every steps (a temporary file renamed over
the name: a rank killed while writing leaves the previous one intact).
"""

import argparse
import glob
import hashlib
import os
import re
import time

import torch
import torch.nn.functional as F

import bytecomp.torch as bc
from bytecomp.examples.digits import load_data

_CKPT_RE = re.compile(r"^ckpt-(\d{8})\.pt$")


class MLP(torch.nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def latest_checkpoint(directory):
    """(step, path) of the newest checkpoint in `directory`, or (0, None)."""
    best = (0, None)
    for path in glob.glob(os.path.join(directory, "ckpt-*.pt")):
        m = _CKPT_RE.match(os.path.basename(path))
        if m and int(m.group(1)) > best[0]:
            best = (int(m.group(1)), path)
    return best


def save_checkpoint(directory, step, model, opt, keep=2):
    path = os.path.join(directory, "ckpt-%08d.pt" % step)
    tmp = os.path.join(directory, ".ckpt-%08d.pt.%d.tmp" % (step, os.getpid()))
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in sorted(glob.glob(os.path.join(directory, "ckpt-*.pt")))[:-keep]:
        os.unlink(old)


def digest(model):
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint-dir", required=True,
                    help="where rank 0 writes its checkpoints and reads the last one at start")
    ap.add_argument("--checkpoint-every", type=int, default=20, metavar="N")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps in all")
    ap.add_argument("--batch-size", type=int, default=16, help="per process")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=10, metavar="N")
    ap.add_argument("--step-sleep", type=float, default=0.0, metavar="S",
                    help="pause after every step (paces a demonstration or a test)")
    ap.add_argument("--out", default=None, help="rank 0 saves the final parameters here")
    args = ap.parse_args()
    if args.checkpoint_every < 1 or args.steps < 1:
        ap.error("--checkpoint-every and --steps must be >= 1")

    bc.init()
    rank, size = bc.rank(), bc.size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data()
    model = MLP(args.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    start = 0
    if rank == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
        # What a rank 0 killed while saving left (never a checkpoint: only
        # the rename makes one).
        for tmp in glob.glob(os.path.join(args.checkpoint_dir, ".ckpt-*.tmp")):
            os.unlink(tmp)
        start, path = latest_checkpoint(args.checkpoint_dir)
        if path:
            ckpt = torch.load(path)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
    # Every process continues from rank 0's step, weights and optimizer state
    # (bit for bit: broadcasts copy bytes).
    start = bc.broadcast_object(start, root_rank=0, name="elastic.start")
    bc.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = bc.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    bc.broadcast_optimizer_state(opt, root_rank=0)
    if rank == 0:
        print("restart %s: %s, %d processes on %d node(s)" %
              (restart, "resumed from the checkpoint of step %d" % start if start
               else "no checkpoint, starting at step 0", size, bc.num_nodes()), flush=True)

    global_batch = args.batch_size * size
    per_epoch = len(y_train) // global_batch
    perm, perm_epoch = None, -1
    for step in range(start, args.steps):
        epoch = step // per_epoch
        if epoch != perm_epoch:
            perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(
                args.seed * 1000 + epoch))
            perm_epoch = epoch
        base = (step % per_epoch) * global_batch + rank * args.batch_size
        idx = perm[base:base + args.batch_size]
        opt.zero_grad()
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        opt.step()
        done = step + 1
        if rank == 0 and (done % args.checkpoint_every == 0 or done == args.steps):
            save_checkpoint(args.checkpoint_dir, done, model, opt)
        if rank == 0 and done % args.log_every == 0:
            print("step %d loss %.4f" % (done, loss.item()), flush=True)
        if args.step_sleep > 0:
            time.sleep(args.step_sleep)

    model.eval()
    with torch.no_grad():
        shard = slice(rank, len(y_test), size)
        correct = (model(x_test[shard]).argmax(1) == y_test[shard]).sum()
    correct = float(bc.allreduce(correct.double().reshape(1), average=False).item())
    print("rank %d final parameters sha256 %s" % (rank, digest(model)), flush=True)
    if rank == 0:
        print("finished %d steps: test accuracy %.2f%%" % (args.steps, 100.0 * correct /
                                                           len(y_test)), flush=True)
        if args.out:
            torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
