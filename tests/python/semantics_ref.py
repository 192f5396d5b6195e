"""The documented algorithms in numpy, for test_semantics: what a job's
push_pull must hand back, step by step, for each compressor and inter-node
scheme (docs/compress.md, docs/server.md "Strategy option -> plan").

Every transfer in the system is decode(compress(x)); a party's compressor
is modelled as a function x -> decoded value that keeps that party's state
(momentum, error-feedback residual). Parties:
  - each node compresses the sum of its local ranks' gradients ("worker");
  - under alltoall_allgather / gather_broadcast a server sums the decoded
    pushes in float32 and recompresses the sum ("server"): no momentum, and
    a residual of its own only when the plan says server error feedback;
  - under a reducing scheme (additive compressors) the server adds the
    compressed pushes (fp16/bf16: the float32 sum rounded once);
  - under allgather every node decodes every push and sums them;
  - under allreduce with none/fp16/bf16 the daemons run a ring
    (daemon/ring_allreduce.h): segment k of M is summed in the order
    x_k, x_{k+1}, ..., x_{k-1} of the nodes' float32 sums, fp16/bf16
    rounding the partial sum at every hop and the owner's final sum once
    more (ring_sum below);
  - a one-node job compresses and decompresses its own sum.

randomk's indices come from a hash shared by all parties and qsgd/terngrad
round stochastically: for randomk the reference takes the kept indices from
the answer (and checks there are exactly k of them, the same for every
party); qsgd/terngrad are checked by their structure on one node and by
their mean over steps (unbiased, residuals conserve the total) across nodes.
"""
import numpy as np

F32 = np.float32

# Default parameters of the catalogue entries the test uses (compress/catalogue.cc).
DGC_MOMENTUM = F32(0.9)
SIGNUM_MOMENTUM = F32(0.9)
QSGD_LEVELS = 16

# Compressors with error feedback built in (no "ef" parameter; catalogue.cc).
BUILTIN_EF = {"dgc", "efsignsgd", "onebit"}  # dgc: its accumulation v
# Compressors with an "ef" parameter, and its default.
EF_PARAM_DEFAULT = {"fp16": False, "bf16": False, "randomk": True, "topk": True,
                    "signsgd": False, "qsgd": False, "terngrad": False}
ADDITIVE = {"fp16", "bf16", "randomk"}
REDUCING = {"allreduce", "reduce_scatter_allgather", "reduce_broadcast"}
GATHERING = {"alltoall_allgather", "gather_broadcast"}
STOCHASTIC = {"qsgd", "terngrad"}

CONSTANT_STEPS = 4  # "mixed" gradients: constant for these steps, then varying


def gradient(kind, n, step, rank):
    """The gradient global rank `rank` pushes at `step` (float32, n elements).
    "constant": the same every step. "mixed": constant for CONSTANT_STEPS
    steps (exposes momentum and residual mistakes), then random with the
    sign flipping every step (exposes momentum that outlives a sign)."""
    base = np.random.default_rng(1000 + rank).uniform(0.25, 1.5, n)
    base *= np.where(np.arange(n) % 3 == 1, -1.0, 1.0)
    base *= 1.0 + 0.5 * rank
    if kind == "constant" or step < CONSTANT_STEPS:
        return base.astype(F32)
    g = np.random.default_rng((7 + rank) * 1000 + step).normal(0.0, 1.0, n)
    return (g * (-1.0) ** step).astype(F32)


def sparse_k(n, ratio):
    return int(min(max(np.floor(ratio * n + 0.5), 1), n))


def negative(x):
    return np.signbit(x)  # the sign family: "negative" means the sign bit is set


def topk_indices(v, k):
    """The k largest |v|, ties: lower index first."""
    order = np.lexsort((np.arange(v.size), -np.abs(v)))
    return np.sort(order[:k])


def dgc_indices(v, k):
    """DGC's selection with sample_ratio 1 (every element sampled): the
    threshold is the k-th largest |v|; every element at or above it is kept
    unless that is more than 1.3 k, then the k largest (ties: lower index)."""
    a = np.abs(v)
    thr = np.sort(a)[::-1][k - 1]
    idx = np.nonzero(a >= thr)[0]
    if idx.size * 10 > k * 13:
        return topk_indices(v, k)
    return idx


def bf16_round(x):
    u = x.astype(F32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(F32)


class Codec:
    """One party's compressor with its state: __call__(x) -> decoded value."""

    def __init__(self, name, n, ef, momentum, params, observe=None):
        self.name, self.n, self.ef, self.momentum = name, n, ef, momentum
        self.params = params
        self.observe = observe  # per-step info taken from the answer (randomk's indices)
        self.r = np.zeros(n, F32)  # error-feedback residual (dgc: its accumulation v)
        self.u = np.zeros(n, F32)  # momentum (dgc, signum)

    def residual(self):
        return self.r

    def __call__(self, x, step):
        x = x.astype(F32)
        name = self.name
        if name == "dgc":
            k = sparse_k(self.n, float(self.params["ratio"]))
            if self.momentum is not None:  # worker: momentum correction
                self.u = (self.momentum * self.u + x).astype(F32)
                g = self.u
            else:
                g = x
            if self.ef:
                self.r = (self.r + g).astype(F32)
                v = self.r
            else:
                v = g
            idx = dgc_indices(v, k)
            y = np.zeros(self.n, F32)
            y[idx] = v[idx]
            if self.ef:
                self.r[idx] = 0
            if self.momentum is not None:
                self.u[idx] = 0
            return y
        if name == "signum" and self.momentum is not None:
            self.u = (self.momentum * self.u + (F32(1) - self.momentum) * x).astype(F32)
            return np.where(negative(self.u), F32(-1), F32(1)).astype(F32)
        p = (x + self.r).astype(F32) if self.ef else x
        y = self.plain(p, step)
        if self.ef:
            self.r = (p - y).astype(F32)
        return y

    def plain(self, p, step):
        name = self.name
        if name == "fp16":
            return p.astype(np.float16).astype(F32)
        if name == "bf16":
            return bf16_round(p)
        if name == "topk":
            idx = topk_indices(p, sparse_k(self.n, float(self.params["ratio"])))
            y = np.zeros(self.n, F32)
            y[idx] = p[idx]
            return y
        if name == "randomk":
            return np.where(self.observe[step], p, F32(0)).astype(F32)
        if name in ("signsgd", "signum"):
            return np.where(negative(p), F32(-1), F32(1)).astype(F32)
        if name == "efsignsgd":
            scale = F32(np.mean(np.abs(p.astype(np.float64))))
            return np.where(negative(p), -scale, scale).astype(F32)
        if name == "onebit":
            neg = negative(p)
            pos = F32(p[~neg].astype(np.float64).mean()) if (~neg).any() else F32(0)
            ngv = F32(p[neg].astype(np.float64).mean()) if neg.any() else F32(0)
            return np.where(neg, ngv, pos).astype(F32)
        raise ValueError("no deterministic reference for " + name)


def worker_ef(case, nodes):
    """Whether each node keeps an error-feedback residual (planner/strategy/plan.h)."""
    name, inter, ef = case["compressor"], case["inter"], case["ef"]
    if name in BUILTIN_EF:
        return True
    if name not in EF_PARAM_DEFAULT:
        return False  # dgc's accumulation is modelled separately; signum has none
    if nodes > 1 and inter in REDUCING:
        return EF_PARAM_DEFAULT[name]  # the servers sum compressed: the compressor's default
    return ef


def server_ef(case):
    """Whether the server recompressing a sum keeps a residual of its own."""
    return case["ef"] or case["compressor"] in BUILTIN_EF


def conserves(case, nodes):
    """Whether every party of `case` keeps an error-feedback residual and
    nothing else changes the total (no momentum, no rounding without one)."""
    name, inter = case["compressor"], case["inter"]
    if name in ("none", "dgc", "signum") or not worker_ef(case, nodes):
        return False
    if nodes == 1 or inter == "allgather":
        return True
    if name in ("fp16", "bf16") and (inter in REDUCING or name == "fp16"):
        return False  # the servers round the sum and keep no residual
    return inter in REDUCING or server_ef(case)


def expected(case, nodes, ranks, steps, answers):
    """The answers [steps, n] the system must give for `case`, and the parties'
    residuals at the end (for the conservation check). `answers` (what the
    system gave) is only read for randomk's indices."""
    name, inter, n = case["compressor"], case["inter"], case["count"]
    params = case.get("params", {})
    observe = None
    if name == "randomk":
        observe = answers != 0
        k = sparse_k(n, float(params["ratio"]))
        for s in range(steps):
            assert observe[s].sum() == k, "randomk step %d kept %d elements, not k = %d" % (
                s, observe[s].sum(), k)
    dgc_ef = name == "dgc"  # DGC's accumulation v is its residual on every node

    def momentum():
        return {"dgc": DGC_MOMENTUM, "signum": SIGNUM_MOMENTUM}.get(name)

    workers = [Codec(name, n, dgc_ef or worker_ef(case, nodes), momentum(), params, observe)
               for _ in range(nodes)] if name != "none" else []
    server = None
    if nodes > 1 and inter in GATHERING and name not in ("none", "fp16"):
        server = Codec(name, n, server_ef(case), None, params, observe)
    out = np.zeros((steps, n), F32)
    for s in range(steps):
        xs = []
        for node in range(nodes):
            x = np.zeros(n, F32)
            for r in range(ranks):
                x = (x + gradient(case["kind"], n, s, node * ranks + r)).astype(F32)
            xs.append(x)
        if name == "none":
            total = np.zeros(n, F32)
            for x in xs:
                total = (total + x).astype(F32)
            out[s] = total
            continue
        if nodes > 1 and inter == "allreduce" and name in ("fp16", "bf16"):
            out[s] = ring_sum(xs, lambda v: workers[0].plain(v, s))
            continue
        ys = [w(x, s) for w, x in zip(workers, xs)]
        total = np.zeros(n, F32)
        for y in ys:
            total = (total + y).astype(F32)
        if nodes > 1 and inter in REDUCING and name in ("fp16", "bf16"):
            # The float32 sum of the decoded pushes, rounded once.
            total = workers[0].plain(total, s)
        elif server is not None:
            total = server(total, s)
        elif nodes > 1 and inter in GATHERING and name == "fp16":
            total = total.astype(np.float16).astype(F32)  # fp16 answer words, no residual
        out[s] = total
    residuals = [w.residual() for w in workers] + ([server.residual()] if server else [])
    return out, residuals


def ring_sum(xs, rnd):
    """The ring's answer for node sums `xs` (float32, one partition): each
    segment starts at its node, every hop adds its node's float32 sum to
    the incoming partial sum in float32 and rounds (`rnd`) what it sends;
    the owner (the last node) rounds the final sum once more."""
    m, n = len(xs), len(xs[0])
    out = np.zeros(n, F32)
    for k in range(m):
        lo, hi = k * n // m, (k + 1) * n // m
        w = rnd(xs[k][lo:hi])
        for j in range(1, m):
            w = rnd((w + xs[(k + j) % m][lo:hi]).astype(F32))
        out[lo:hi] = w
    return out


def pushed_total(case, nodes, ranks, steps):
    """Sum over steps and ranks of the gradients pushed (float64)."""
    t = np.zeros(case["count"], np.float64)
    for s in range(steps):
        for g in range(nodes * ranks):
            t += gradient(case["kind"], case["count"], s, g)
    return t
