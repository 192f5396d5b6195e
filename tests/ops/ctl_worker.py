"""One rank of a two-node job under bytecomp-run, for test_ctl's TwoNodes:
runs push_pulls, then local rank 0 of each node asks its daemon with
bytecompctl while the job runs and prints `CTL <node> <json>`; a final
allreduce keeps every rank in the job until both nodes asked."""
import json
import os
import subprocess
import sys

import torch

import bytecomp.torch as bc

ITERATIONS = int(sys.argv[1])
bc.init()
for i in range(ITERATIONS):
    got = bc.allreduce(torch.full((1000,), float(bc.rank() + i)), average=False)
    want = sum(r + i for r in range(bc.size()))
    assert torch.all(got == want), (i, got[:3], want)
if os.environ["LOCAL_RANK"] == "0":
    ctl = os.path.join(os.environ["BYTECOMP_BUILD_ROOT"], "scripts", "bytecompctl")
    answers = {}
    for cmd in (["jobs"], ["status"]):
        r = subprocess.run(["/usr/bin/python3", ctl, "--json", *cmd], capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        answers[cmd[0]] = json.loads(r.stdout)
    print("CTL %s %s" % (os.environ["BYTECOMP_NODE_RANK"], json.dumps(answers)), flush=True)
bc.allreduce(torch.zeros(1), average=False)
print("DONE", flush=True)
