"""Trains a small model until told to stop; used by test_faults.

    fault_worker.py --steps N [--die-rank R --die-step S] [--report FILE]

Rank R SIGKILLs itself at step S (a crash without any goodbye); with
--hang-rank R it stops calling bytecomp instead (a stuck process). A process
whose bytecomp call raises prints 'RAISED <class> <seconds> <message>',
where seconds is the time from the start of the failing step to the
exception, and exits 3. Each process prints 'PID <pid>' first and 'STEP s'
after every step.
"""
import argparse
import os
import signal
import sys
import time

import torch

import bytecomp
import bytecomp.torch as bc

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=100000)
ap.add_argument("--die-rank", type=int, default=-1)
ap.add_argument("--die-step", type=int, default=-1)
ap.add_argument("--hang-rank", type=int, default=-1, help="this rank stops calling at --die-step")
ap.add_argument("--sleep", type=float, default=0.0)
args = ap.parse_args()

print("PID", os.getpid(), flush=True)
bc.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
opt = bc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters())
t0 = time.monotonic()
try:
    for step in range(args.steps):
        t0 = time.monotonic()
        if bc.rank() == args.die_rank and step == args.die_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if bc.rank() == args.hang_rank and step == args.die_step:
            print("HANGING", flush=True)
            time.sleep(3600)
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        print("STEP", step, flush=True)
        if args.sleep:
            time.sleep(args.sleep)
except bytecomp.BytecompError as e:
    print("RAISED %s %.3f %s" % (type(e).__name__, time.monotonic() - t0, e), flush=True)
    sys.exit(3)
