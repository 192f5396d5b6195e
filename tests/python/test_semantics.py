"""Issue 29: every shipped compressor under every inter-node scheme it
supports, run through the real system (bytecomp-run: training processes,
bytecompd per node, bytecomp-server), compared step by step with the
documented algorithm (semantics_ref.py). Exact where the algorithm is exact
(casts, topk, dgc, the sign family's signs, randomk's kept values), within
float tolerance where the C++ sums in another order (efsignsgd's and
onebit's means, momentum), and by structure and mean for the stochastic
quantisers; answers must be the same on every rank.

One bytecomp-run per shape (nodes x ranks), every case a tensor of its own
with its own strategy entry, so a shape costs one launch."""
import json
import os
import shutil
import subprocess
import tempfile
import unittest
import uuid

import numpy as np

import helpers
import semantics_ref as ref

WORKER = os.path.join(helpers.TESTS_DIR, "workers", "semantics_worker.py")
CHECK = os.path.join(helpers.BUILD_ROOT, "tests", "python", "strategy_check")
STEPS = 12
N = 50


def compressors():
    """Every compressor a strategy may name, from the catalogue itself."""
    out = subprocess.run([CHECK, "--compressors"], check=True, capture_output=True, text=True)
    return out.stdout.split()


def inters(name):
    if name == "none":
        return sorted(ref.REDUCING)
    gathering = sorted(ref.GATHERING) + ["allgather"]
    return sorted(ref.REDUCING) + gathering if name in ref.ADDITIVE else gathering


def params_of(name):
    if name in ("topk", "randomk"):
        return {"ratio": "0.1"}
    if name == "dgc":
        # Every element sampled: the threshold is exact, so is the reference.
        return {"ratio": "0.1", "sample_ratio": "1"}
    return {}


def cases(nodes):
    out = []
    for name in compressors():
        for inter in inters(name):
            for ef in ([False] if name == "none" else [False, True]):
                # error_feedback on a compressor without it is refused.
                if ef and name not in ref.EF_PARAM_DEFAULT and name not in ref.BUILTIN_EF:
                    continue
                out.append({"name": "%s.%s.%s" % (name, inter, "ef" if ef else "noef"),
                            "compressor": name, "inter": inter, "ef": ef, "count": N,
                            "params": params_of(name),
                            "kind": "constant" if name in ref.STOCHASTIC else "mixed"})
    # The reproduction of issue 29: DGC k = 1 of 100, a constant gradient.
    for inter in sorted(ref.GATHERING) if nodes > 1 else []:
        out.append({"name": "dgc-k1.%s" % inter, "compressor": "dgc", "inter": inter,
                    "ef": False, "count": 100, "kind": "constant",
                    "params": {"ratio": "0.01", "sample_ratio": "1"}})
    return out


def strategy_yaml(cs):
    lines = ["version: 1", "default: {compressor: none}", "entries:"]
    for c in cs:
        params = ", ".join("%s: '%s'" % kv for kv in sorted(c["params"].items()))
        if c["compressor"] == "none":
            opt = "{compressor: none, inter: %s}" % c["inter"]
        else:
            opt = ("{compressor: %s, params: {%s}, error_feedback: %s, inter: %s}"
                   % (c["compressor"], params, "true" if c["ef"] else "false", c["inter"]))
        lines.append("  - {tensor: '%s', option: %s}" % (c["name"], opt))
    return "\n".join(lines) + "\n"


def check_stochastic(c, nodes, ranks, got):
    """qsgd/terngrad: on one node each answer has the quantiser's structure
    around the (residual-corrected) sum; everywhere the mean over steps is
    the pushed mean within a bound of 5 standard deviations of the rounding
    noise (unbiased without error feedback; with it, residuals stay
    bounded)."""
    name, n = c["compressor"], c["count"]
    x = np.zeros(n, np.float32)
    for g in range(nodes * ranks):
        x = (x + ref.gradient(c["kind"], n, 0, g)).astype(np.float32)
    problems = []
    if nodes == 1:
        r = np.zeros(n, np.float32)
        ef = ref.worker_ef(c, 1)
        for s in range(STEPS):
            p = (x + r).astype(np.float32) if ef else x
            a = got[s]
            nz = a != 0
            if np.any(np.signbit(a[nz]) != np.signbit(p[nz])):
                problems.append("step %d: an answer's sign differs from the sum's" % s)
            if name == "qsgd":
                unit = np.linalg.norm(p.astype(np.float64)) / ref.QSGD_LEVELS
                lv = np.abs(a) / unit
                lo = np.floor(np.abs(p) / unit)
                if np.any(np.abs(lv - np.round(lv)) > 1e-3) or np.any(lv < lo - 1e-3) or \
                        np.any(lv > lo + 1 + 1e-3):
                    problems.append("step %d: levels %s not floor or ceil of %s" %
                                    (s, np.round(lv[:6], 4), np.round(np.abs(p[:6]) / unit, 4)))
            else:
                scale = min(np.abs(p).max(), 2.5 * p.astype(np.float64).std())
                if not np.allclose(np.abs(a[nz]), scale, rtol=1e-5):
                    problems.append("step %d: terngrad values %s, expected 0 or +-%g" %
                                    (s, np.unique(np.abs(a))[:6], scale))
            if ef:
                r = (p - a).astype(np.float32)
    # Variance of one rounding of v: qsgd (unit^2)/4 at most per element,
    # terngrad |v| * scale - v^2.
    def var(v):
        if name == "qsgd":
            return (np.linalg.norm(v) / ref.QSGD_LEVELS) ** 2 / 4 * np.ones(n)
        return np.abs(v) * np.abs(v).max() - v ** 2
    per_node = x.astype(np.float64) / nodes
    v = sum(var(per_node) for _ in range(nodes))
    if nodes > 1 and c["inter"] in ref.GATHERING:
        v = v + var(x.astype(np.float64))
    bound = 5 * np.sqrt(v.sum() / STEPS) + 1e-6
    err = np.linalg.norm(got.mean(axis=0).astype(np.float64) - x)
    if err > bound:
        problems.append("mean over %d steps is %.4g from the pushed sum (bound %.4g): %s vs %s"
                        % (STEPS, err, bound, np.round(got.mean(axis=0)[:5], 3),
                           np.round(x[:5], 3)))
    return problems


def check_case(c, nodes, ranks, got):
    name = c["compressor"]
    if name in ref.STOCHASTIC:
        return check_stochastic(c, nodes, ranks, got)
    want, residuals = ref.expected(c, nodes, ranks, STEPS, got)
    # Error feedback loses nothing: where every party keeps a residual, what
    # was answered plus what they still hold is what was pushed (the
    # reference's bookkeeping, which the system's answers then must match).
    if ref.conserves(c, nodes):
        held = want.astype(np.float64).sum(axis=0) + sum(r.astype(np.float64) for r in residuals)
        total = ref.pushed_total(c, nodes, ranks, STEPS)
        if not np.allclose(held, total, rtol=1e-4, atol=1e-4 * np.abs(total).max()):
            return ["the reference does not conserve the pushed total (a bug of the test)"]
    if name in ("efsignsgd", "onebit"):
        tol = dict(rtol=2e-5, atol=2e-5 * float(np.abs(want).max()))
    elif name in ("dgc", "signum"):
        tol = dict(rtol=1e-5, atol=1e-6)  # momentum: FMA or not
    else:
        tol = dict(rtol=0, atol=0)
    bad = [s for s in range(STEPS) if not np.allclose(got[s], want[s], **tol)]
    if not bad:
        return []
    s = bad[0]
    diff = np.nonzero(~np.isclose(got[s], want[s], **tol))[0][:4]
    return ["steps %s differ; step %d at %s: got %s, expected %s; totals per step got %s, "
            "expected %s" % (bad, s, diff.tolist(), got[s][diff].tolist(), want[s][diff].tolist(),
                             np.round(got.sum(axis=1), 3).tolist(),
                             np.round(want.sum(axis=1), 3).tolist())]


class Semantics(unittest.TestCase):
    def run_shape(self, nodes, ranks):
        cs = cases(nodes)
        tmp = tempfile.mkdtemp(prefix="bc-semantics-")
        try:
            with open(os.path.join(tmp, "cases.json"), "w") as f:
                json.dump({"steps": STEPS, "tensors": cs}, f)
            with open(os.path.join(tmp, "strategy.yaml"), "w") as f:
                f.write(strategy_yaml(cs))
            run_id = "sem" + uuid.uuid4().hex[:8]
            rc, out, pid = helpers.launch(
                ["--nodes", str(nodes), "--nproc-per-node", str(ranks), "--job-id", run_id,
                 "--strategy", os.path.join(tmp, "strategy.yaml"), "--timeout-ms", "20000",
                 "--start-timeout", "20", "--time-limit", "90", WORKER,
                 os.path.join(tmp, "cases.json"), tmp], timeout=120)
            self.assertEqual(rc, 0, out)
            self.assertEqual(helpers.run_leftovers(run_id, pid), ([], []), out)
            results = [np.load(os.path.join(tmp, "rank%d.npz" % g)) for g in range(nodes * ranks)]
            problems = []
            for c in cs:
                got = results[0][c["name"]]
                for g in range(1, nodes * ranks):
                    if not np.array_equal(results[g][c["name"]], got):
                        problems.append("%s: rank %d's answers differ from rank 0's" % (c["name"], g))
                for p in check_case(c, nodes, ranks, got):
                    problems.append("%s: %s" % (c["name"], p))
            self.assertEqual(problems, [], "\n%d of %d cases wrong on %d node(s) x %d rank(s):\n%s"
                             % (len(problems), len(cs), nodes, ranks, "\n".join(problems)))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_one_node_two_ranks(self):
        self.run_shape(1, 2)

    def test_two_nodes_one_rank(self):
        self.run_shape(2, 1)

    def test_two_nodes_two_ranks(self):
        self.run_shape(2, 2)


if __name__ == "__main__":
    unittest.main()
