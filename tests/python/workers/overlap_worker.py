"""DistributedOptimizer(overlap_forward=model) against the default, for
test_overlap. Every rank runs the same program; prints 'OK <what>' lines
and exits non-zero (a traceback) on any difference.

    overlap_worker.py --mode equal --steps N       bit-for-bit vs the default
    overlap_worker.py --mode kill|hang --out DIR   a peer fails during a pending sum
    overlap_worker.py --mode refuse                refusals and the stale-use check

equal: two copies of one model (same seed on every rank), one with the
default DistributedOptimizer, one with overlap_forward, the same batches
(each rank its slice). At every step the losses (forwards on the updated
parameters) must be equal bit for bit; at some steps model.state_dict(), an
eval forward under no_grad and the optimizer's state too; at the end every
parameter and every optimizer state tensor. The model has a module used
twice, a parameter the forward never uses, one of the root module's own
and a weight_norm layer (a pre-hook of its own that reads parameters);
zero_grad() comes before the forward on even steps and right after step()
on odd ones; a StepLR scheduler changes lr every 2 steps. Then
bc.shutdown() right after a step() must apply that step's updates."""
import argparse
import os
import signal
import sys
import time

import torch

import bytecomp
import bytecomp.torch as bc

ap = argparse.ArgumentParser()
ap.add_argument("--mode", required=True, choices=["equal", "kill", "hang", "refuse"])
ap.add_argument("--steps", type=int, default=8)
ap.add_argument("--out", default=None)
args = ap.parse_args()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, 3)
        self.fc1 = torch.nn.Linear(4 * 14, 64)
        self.mid = torch.nn.Linear(64, 64)      # called twice per forward
        # weight_norm: its own forward pre-hook computes fc2.weight from
        # weight_g and weight_v, so their updates must come before it.
        self.fc2 = torch.nn.utils.weight_norm(torch.nn.Linear(64, 5))
        self.scale = torch.nn.Parameter(torch.ones(5))  # the root module's own
        self.unused = torch.nn.Parameter(torch.ones(3))  # never in forward

    def forward(self, x):
        h = torch.relu(self.conv(x.unsqueeze(1))).flatten(1)
        h = torch.relu(self.mid(torch.relu(self.mid(torch.relu(self.fc1(h))))))
        return self.fc2(h) * self.scale


def batches(steps, global_batch, seed=7):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield (torch.randn(global_batch, 16, generator=g),
               torch.randint(0, 5, (global_batch,), generator=g))


def same(a, b, what):
    if not torch.equal(a, b):
        raise AssertionError("%s differs: max |diff| %g" % (what, (a - b).abs().max()))


def same_state(sa, sb, what):
    """Optimizer state_dicts: every tensor bit for bit, the rest equal."""
    assert sa["param_groups"] == sb["param_groups"], what
    assert sorted(sa["state"]) == sorted(sb["state"]), what
    for k in sa["state"]:
        for key, va in sa["state"][k].items():
            vb = sb["state"][k][key]
            if torch.is_tensor(va):
                same(va, vb, "%s state[%s][%s]" % (what, k, key))
            else:
                assert va == vb, (what, k, key, va, vb)


def equal_run(name, make_opt, passes=1):
    r, n = bc.rank(), bc.size()
    torch.manual_seed(100)
    a = Net()
    b = Net()
    b.load_state_dict(a.state_dict())
    oa = bc.DistributedOptimizer(make_opt(a), named_parameters=a.named_parameters(),
                                 backward_passes_per_step=passes)
    ob = bc.DistributedOptimizer(make_opt(b), named_parameters=b.named_parameters(),
                                 backward_passes_per_step=passes, overlap_forward=b)
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=2, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=2, gamma=0.5)
    init = {k: v.clone() for k, v in a.state_dict().items()}
    batch = 4
    data = list(batches(args.steps * passes, batch * n))
    for step in range(args.steps):
        if step % 2 == 0:
            oa.zero_grad()
            ob.zero_grad()
        for k in range(passes):
            x, y = data[step * passes + k]
            sl = slice(r * batch, (r + 1) * batch)
            la = torch.nn.functional.cross_entropy(a(x[sl]), y[sl])
            lb = torch.nn.functional.cross_entropy(b(x[sl]), y[sl])  # pre-hooks apply
            same(la, lb, "%s: loss at step %d pass %d" % (name, step, k))
            la.backward()
            lb.backward()
        before = b.fc1.weight.detach().clone()
        oa.step()
        ob.step()
        # step() left the update pending: the next forward applies it.
        if step == 0 and torch.equal(a.fc1.weight, b.fc1.weight):
            raise AssertionError("%s: overlap_forward's step() applied fc1.weight at once"
                                 % name)
        same(before, b.fc1.weight.detach(), "%s: fc1.weight before its forward" % name)
        if step % 2 == 1:
            oa.zero_grad()
            ob.zero_grad()
        sa.step()
        sb.step()
        if step == 2:
            # model.state_dict() applies what is pending (and only reads).
            da, db = a.state_dict(), b.state_dict()
            for k in da:
                same(da[k], db[k], "%s: state_dict()[%s] after step %d" % (name, k, step))
        if step == 4:
            # An eval forward under no_grad waits too and sees the update.
            a.eval()
            b.eval()
            with torch.no_grad():
                x, _ = data[0]
                same(a(x), b(x), "%s: eval forward after step %d" % (name, step))
            a.train()
            b.train()
        if step == 5:
            same_state(oa.state_dict(), ob.state_dict(),
                       "%s: optimizer state after step %d" % (name, step))
    ob.drain()
    for (k, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        same(pa.detach(), pb.detach(), "%s: parameter %s after %d steps" % (name, k, args.steps))
        if k != "unused" and torch.equal(pa.detach(), init[k]):
            raise AssertionError("%s: %s did not train" % (name, k))
    same_state(oa.state_dict(), ob.state_dict(), "%s: optimizer state at the end" % name)
    print("OK equal %s (%d steps, %d ranks)" % (name, args.steps, n), flush=True)


def mode_equal():
    equal_run("sgd-momentum", lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                                        weight_decay=1e-4))
    equal_run("adam", lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    equal_run("sgd-accumulate-2",
              lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), passes=2)


def close_drains():
    """The last step() is followed by bc.shutdown() directly: shutdown waits
    for the pending sums and applies them (a process leaving with a sum in
    flight would abort the job for its peers)."""
    r, n = bc.rank(), bc.size()
    torch.manual_seed(200)
    a = Net()
    b = Net()
    b.load_state_dict(a.state_dict())
    oa = bc.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9),
                                 named_parameters=a.named_parameters())
    ob = bc.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9),
                                 named_parameters=b.named_parameters(), overlap_forward=b)
    for x, y in batches(3, 4 * n, seed=11):
        sl = slice(r * 4, (r + 1) * 4)
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x[sl]), y[sl]).backward()
            o.step()
    pending = b.fc1.weight.detach().clone()
    bc.shutdown()
    if torch.equal(pending, b.fc1.weight.detach()):
        raise AssertionError("shutdown() did not apply the last step's update")
    for (k, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        same(pa.detach(), pb.detach(), "close: parameter %s after shutdown()" % k)
    print("OK shutdown applied the last step", flush=True)


def wait_file(path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError("%s did not appear within %g s" % (path, timeout))
        time.sleep(0.02)


def touch(path):
    with open(path, "w"):
        pass


def mode_fail():
    """Rank 1 takes step 0 and then fails (killed, or stuck without pushing)
    once rank 0 has pushed step 1's gradients and returned from step():
    rank 0's next forward must raise, naming the cause and the module."""
    r = bc.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = bc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(),
                                  overlap_forward=model)
    x = torch.randn(8, 32)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    if r == 1:
        model(x)  # step 0's sums applied: nothing of this rank is in flight
        wait_file(os.path.join(args.out, "rank0-stepped"))
        if args.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        wait_file(os.path.join(args.out, "rank0-done"))  # stuck: no push, no leave
        os._exit(0)
    opt.zero_grad()
    model(x).pow(2).mean().backward()  # step 0's sums waited for by the pre-hooks
    opt.step()                          # step 1: pushed, not waited for
    touch(os.path.join(args.out, "rank0-stepped"))
    t0 = time.monotonic()
    try:
        model(x)
    except bytecomp.BytecompError as e:
        print("FORWARD RAISED %s %.3f %s" % (type(e).__name__, time.monotonic() - t0, e),
              flush=True)
        try:
            opt.step()
        except bytecomp.BytecompError as e2:
            print("STEP RAISED %s" % type(e2).__name__, flush=True)
        touch(os.path.join(args.out, "rank0-done"))
        return
    touch(os.path.join(args.out, "rank0-done"))
    raise AssertionError("the forward waiting for a failed sum returned")


class SGDSub(torch.optim.SGD):
    pass


class Parent(torch.nn.Module):
    """Uses its child's weight without calling the child."""

    def __init__(self):
        super().__init__()
        self.child = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x @ self.child.weight.t()


def expect(cls, text, fn):
    try:
        fn()
    except cls as e:
        if text not in str(e):
            raise AssertionError("%s without %r: %s" % (cls.__name__, text, e))
        print("OK refused %s: %s" % (cls.__name__, e), flush=True)
        return
    raise AssertionError("no %s (%s)" % (cls.__name__, text))


def mode_refuse():
    m = torch.nn.Linear(4, 4)
    expect(bytecomp.UnsupportedError, "LBFGS", lambda: bc.DistributedOptimizer(
        torch.optim.LBFGS(m.parameters()), named_parameters=m.named_parameters(),
        overlap_forward=m))
    expect(bytecomp.UnsupportedError, "SGDSub", lambda: bc.DistributedOptimizer(
        SGDSub(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
        overlap_forward=m))
    expect(TypeError, "torch.nn.Module", lambda: bc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
        overlap_forward=True))
    other = torch.nn.Linear(4, 4)
    expect(ValueError, "not a parameter of the model", lambda: bc.DistributedOptimizer(
        torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
        overlap_forward=other))
    # After the refusals (no job started) a good one works.
    p = Parent()
    opt = bc.DistributedOptimizer(torch.optim.SGD(p.parameters(), lr=0.1),
                                  named_parameters=p.named_parameters(), overlap_forward=p)
    x = torch.randn(2, 4)
    opt.zero_grad()
    p(x).sum().backward()
    opt.step()
    # child.weight is used by Parent.forward without child's forward: the
    # gradient would be of the old value, so backward refuses it.
    expect(bytecomp.StateError, "'child.weight' was computed from its value before",
           lambda: p(x).sum().backward())
    # drain() first makes the same forward correct.
    opt.drain()
    opt.zero_grad()
    p(x).sum().backward()
    opt.step()
    opt.drain()
    print("OK stale use refused, drain() works", flush=True)


bc.init()
if args.mode == "equal":
    mode_equal()
    close_drains()  # ends with bc.shutdown()
elif args.mode in ("kill", "hang"):
    mode_fail()
else:
    mode_refuse()
bc.shutdown()
print("OK done", flush=True)
