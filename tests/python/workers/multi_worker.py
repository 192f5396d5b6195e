"""Multi-process checks of bytecomp.torch for test_multi (under bytecomp-run).

    multi_worker.py state         broadcast_optimizer_state / broadcast_object /
                                  allreduce give every rank root's values
    multi_worker.py mismatch      rank 1 passes a different state_dict to
                                  broadcast_parameters: every rank must raise
    multi_worker.py declare       rank 1 builds a different model: the job
                                  must not start, each rank raises
    multi_worker.py big           a state of ~21 MB (several 4 MiB chunks, not
                                  a multiple of a partition) from the last
                                  rank, then barriers: bit for bit
Prints 'OK <what>' or 'RAISED <class>: <message>' (then exits 3).

Every wait here is bounded (BYTECOMP_TIMEOUT_MS), yet on Dec 1 2026 the
'big' mode stalled three times at load 9-13 without raising until
bytecomp-run's time limit (docs/daemon.md): should a rank still run
STALL_DUMP_S after it started, it prints every thread's Python stack
(faulthandler) so that a recurrence shows where it waits."""
import faulthandler
import sys

import torch

import bytecomp
import bytecomp.torch as bc

# Below test_multi's --time-limit (60 s), above a loaded run (4-10 s).
STALL_DUMP_S = 45
faulthandler.dump_traceback_later(STALL_DUMP_S, exit=False)
mode = sys.argv[1]
bc.init()
r = bc.rank()
try:
    if mode == "state":
        torch.manual_seed(r)
        m = torch.nn.Linear(5, 3)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        if r == 0:   # only the root has momentum buffers
            m(torch.randn(4, 5)).sum().backward()
            opt.step()
        bc.broadcast_parameters(m.state_dict(), root_rank=0)
        bc.broadcast_optimizer_state(opt, root_rank=0)
        got = [m.weight.detach().clone(), m.bias.detach().clone()] + [
            opt.state[p]["momentum_buffer"].clone() for p in m.parameters()]
        flat = torch.cat([g.reshape(-1) for g in got]).double()
        root = bc.broadcast(flat.clone() if r == 0 else torch.zeros_like(flat), root_rank=0)
        assert torch.equal(root, flat), "ranks differ after the broadcasts"
        assert opt.param_groups[0]["lr"] == 0.1
        obj = bc.broadcast_object({"rank": r, "data": list(range(r + 3))}, root_rank=1)
        assert obj == {"rank": 1, "data": [0, 1, 2, 3]}, obj
        s = bc.allreduce(torch.tensor([float(r)]), average=False)
        assert s.item() == sum(range(bc.size())), s
        # Bit for bit, whatever the control job's dtype.
        odd = {"big": torch.tensor([2 ** 62 + 1, -(2 ** 53) - 1], dtype=torch.int64),
               "nan": torch.tensor([0x7FC00123, 0x7F800001], dtype=torch.int32).view(torch.float32),
               "flags": torch.tensor([True, False, True]),
               "half": torch.tensor([1.0009765625, -3.5], dtype=torch.float16)}
        mine = {k: (v.clone() if r == 0 else torch.zeros_like(v)) for k, v in odd.items()}
        bc.broadcast_parameters(mine, root_rank=0)
        for k, v in odd.items():
            a, b = mine[k], v
            if a.dtype in (torch.float32, torch.float16):
                a, b = a.view(torch.int32 if a.dtype == torch.float32 else torch.int16), \
                    b.view(torch.int32 if b.dtype == torch.float32 else torch.int16)
            assert torch.equal(a, b), (k, mine[k], v)
        print("OK state", flush=True)
    elif mode == "big":
        root = bc.size() - 1
        g = torch.Generator().manual_seed(7)
        want = {"a": torch.randn(2_500_001, generator=g, dtype=torch.float64),
                "b": torch.randint(-128, 127, (12345,), generator=g, dtype=torch.int8),
                "c": torch.randn(333, 77, generator=g).to(torch.bfloat16)}
        mine = {k: (v.clone() if r == root else torch.full_like(v, r + 1))
                for k, v in want.items()}
        for _ in range(2):
            bc.broadcast_parameters(mine, root_rank=root)
            for k, v in want.items():
                assert torch.equal(mine[k].view(torch.uint8) if mine[k].dtype == torch.bfloat16
                                   else mine[k], v.view(torch.uint8)
                                   if v.dtype == torch.bfloat16 else v), k
            bc.barrier()
        got = bc.broadcast_object(list(range(100000)) if r == root else None, root_rank=root)
        assert got == list(range(100000))
        print("OK big", flush=True)
    elif mode == "mismatch":
        sd = {"w": torch.zeros(4)} if r != 1 else {"w": torch.zeros(5)}
        bc.broadcast_parameters(sd, root_rank=0)
        print("OK mismatch (not detected)", flush=True)
    elif mode == "declare":
        m = torch.nn.Linear(4, 2 if r != 1 else 3)
        bc.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=1),
                                named_parameters=m.named_parameters())
        print("OK declare (not detected)", flush=True)
except (ValueError, bytecomp.BytecompError) as e:
    print("RAISED %s: %s" % (type(e).__name__, e), flush=True)
    sys.exit(3)
