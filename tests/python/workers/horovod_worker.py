"""Horovod's semantics of bytecomp.torch across processes, for test_horovod
(under bytecomp-run, 1 or 2 nodes).

    horovod_worker.py semantics   exact integer and float64 sums in the input's
                                  dtype, broadcast vs broadcast_, allreduce_,
                                  allgather with different first dimensions,
                                  async handles, autograd, mismatches that
                                  raise MismatchError and let the job go on,
                                  skip_synchronize
    horovod_worker.py reinit      shutdown(); init() three times while another
                                  rank is still leaving
Prints 'OK <what>' or 'FAILED <what>: <message>' (then exits 3)."""
import sys
import time
import traceback

import torch

import bytecomp.torch as hvd


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def expect_mismatch(fn, fragment):
    try:
        fn()
    except hvd.MismatchError as e:
        check(isinstance(e, RuntimeError) and isinstance(e, ValueError), "classes of %r" % e)
        check(fragment in str(e), "%r not in %s" % (fragment, e))
        return
    raise AssertionError("no MismatchError (%s)" % fragment)


def semantics():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    # 1. Integers: exact in their own dtype, returned in it.
    def mine(k):
        return torch.tensor([2 ** 54 + 3, 2 ** 40 + k, -(2 ** 62) + k, k], dtype=torch.int64)
    got = hvd.allreduce(mine(r), op=hvd.Sum)
    want = mine(0)
    for k in range(1, n):
        want = want + mine(k)  # int64 arithmetic: wraps like the sum must
    check(got.dtype == torch.int64 and torch.equal(got, want), "int64 sum %s != %s" % (got, want))
    avg = hvd.allreduce(torch.tensor([2 ** 54 + 3 + r], dtype=torch.int64))
    check(avg.dtype == torch.int64 and
          avg.item() == (n * (2 ** 54 + 3) + n * (n - 1) // 2) // n, "int64 average %s" % avg)
    wrap = hvd.allreduce(torch.tensor([2 ** 31 - 1, -7], dtype=torch.int32), op=hvd.Sum)
    want32 = torch.tensor([(2 ** 31 - 1) * n, -7 * n], dtype=torch.int64).to(torch.int32)
    check(wrap.dtype == torch.int32 and torch.equal(wrap, want32), "int32 wrap %s" % wrap)
    small = hvd.allreduce(torch.tensor([100, -3], dtype=torch.int8), op=hvd.Sum)
    check(small.dtype == torch.int8 and torch.equal(
        small, torch.tensor([100 * n, -3 * n]).to(torch.int8)), "int8 %s" % small)
    # float64 stays float64 across nodes (float32 would lose the 1.0).
    f = hvd.allreduce(torch.tensor([2.0 ** 40, 1.0 + r], dtype=torch.float64), op=hvd.Sum)
    check(f.dtype == torch.float64 and f.tolist() == [n * 2.0 ** 40, n + n * (n - 1) / 2],
          "float64 %s" % f)
    h = hvd.allreduce(torch.tensor([1.5], dtype=torch.float16), op=hvd.Sum)
    check(h.dtype == torch.float16 and h.item() == 1.5 * n, "float16 %s" % h)
    # 2. broadcast returns a new tensor; broadcast_ and allreduce_ work in place.
    x = torch.full((3,), float(r))
    y = hvd.broadcast(x, root_rank=n - 1)
    check(torch.equal(x, torch.full((3,), float(r))), "broadcast modified its input")
    check(torch.equal(y, torch.full((3,), float(n - 1))), "broadcast result %s" % y)
    z = hvd.broadcast_(x, 0)
    check(z is x and torch.equal(x, torch.zeros(3)), "broadcast_ %s" % x)
    t = torch.tensor([float(r)])
    out = hvd.allreduce_(t, op=hvd.Sum)
    check(out is t and t.item() == n * (n - 1) / 2, "allreduce_ %s" % t)
    # 5. allgather with different first dimensions, in rank order.
    g = hvd.allgather(torch.full((r + 1, 2), r, dtype=torch.int64))
    check(torch.equal(g, torch.cat([torch.full((k + 1, 2), k, dtype=torch.int64)
                                    for k in range(n)])), "allgather %s" % g)
    # Async: several in flight, synchronized in another order.
    hs = [hvd.allreduce_async(torch.tensor([float(r + k)]), op=hvd.Sum, name="a%d" % k)
          for k in range(3)]
    hb = hvd.broadcast_async(torch.tensor([r]), root_rank=0)
    check(hvd.synchronize(hb).item() == 0, "broadcast_async")
    for k in reversed(range(3)):
        v = hvd.synchronize(hs[k]).item()
        check(v == n * (n - 1) / 2 + n * k, "allreduce_async %d: %s" % (k, v))
    h1 = hvd.allreduce_async(torch.ones(2))
    while not hvd.poll(h1):
        time.sleep(0.01)
    check(torch.equal(hvd.synchronize(h1), torch.ones(2)), "poll/synchronize")
    # Autograd through allreduce, allgather, broadcast.
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    hvd.allreduce(a * (r + 1), op=hvd.Sum).sum().backward()
    check(torch.equal(a.grad, torch.full((2,), float(n * (r + 1)))), "allreduce grad %s" % a.grad)
    b = torch.ones(r + 1, 2, requires_grad=True)
    gathered = hvd.allgather(b)
    (gathered * torch.arange(gathered.shape[0]).float().unsqueeze(1)).sum().backward()
    off = sum(k + 1 for k in range(r))
    want_b = n * torch.arange(off, off + r + 1).float().unsqueeze(1).expand(r + 1, 2)
    check(torch.equal(b.grad, want_b), "allgather grad %s != %s" % (b.grad, want_b))
    c = torch.tensor([3.0], requires_grad=True)
    hvd.broadcast(c, root_rank=1 % n).sum().backward()
    check(c.grad.item() == (n if r == 1 % n else 0), "broadcast grad %s" % c.grad)
    check(hvd.broadcast_object({"r": r}, root_rank=0, name="cfg") == {"r": 0}, "broadcast_object")
    # 4. Mismatches raise MismatchError everywhere; the job goes on.
    if n > 1:
        expect_mismatch(lambda: hvd.allreduce(torch.zeros(2 if r == 0 else 3)),
                        "different tensors")
        expect_mismatch(lambda: hvd.broadcast(torch.zeros(4), root_rank=0 if r else 1),
                        "different tensors")
        expect_mismatch(lambda: hvd.broadcast_parameters(
            {"w": torch.zeros(4 if r else 5)}, root_rank=0), "different tensors")
        expect_mismatch(lambda: hvd.allgather(torch.zeros(1, 2 if r else 3)), "different tensors")
    check(hvd.broadcast(torch.tensor([r]), 0).item() == 0, "broadcast after mismatches")
    check(hvd.allreduce(torch.tensor([1]), op=hvd.Sum).item() == n, "allreduce after mismatches")
    # skip_synchronize: clip the summed gradients between synchronize() and step().
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.5),
                                   named_parameters=m.named_parameters())
    torch.manual_seed(r)
    m(torch.randn(3, 4) * 10).pow(2).sum().backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    with opt.skip_synchronize():
        opt.step()
    w = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    check(torch.equal(hvd.broadcast(w, 0), w), "parameters differ after skip_synchronize")
    print("OK semantics", flush=True)


def reinit():
    for k in range(3):
        hvd.init()
        r = hvd.rank()
        s = hvd.allreduce(torch.tensor([k + r], dtype=torch.int64), op=hvd.Sum)
        check(s.item() == hvd.size() * k + hvd.size() * (hvd.size() - 1) // 2, "round %d" % k)
        if r == hvd.size() - 1:
            time.sleep(0.5)  # still leaving while the others init() again
        hvd.shutdown()
    print("OK reinit", flush=True)


mode = sys.argv[1]
try:
    {"semantics": semantics, "reinit": reinit}[mode]()
except Exception as e:  # reported, and the exit status says it failed
    traceback.print_exc()
    print("FAILED %s: %s: %s" % (mode, type(e).__name__, e), flush=True)
    sys.exit(3)
