"""scripts/bench-auto: strategy="auto" against the hand strategies it
compares itself with, on the emulated cluster of scripts/bench-cluster
(docs/auto.md, docs/cluster.md).

Per model and bandwidth: one launch runs bc_auto alone (its decision names
the hand strategies and their predicted times: all fp32, all fp16, each
accepted compressor on every tensor, the size threshold); then --runs
launches run bc_auto and every hand strategy in the same processes, in an
order rotated per run (the machine drifts over minutes). Step times are
medians of the slowest rank's; bc_auto's count from two steps after its
switch. Then the re-plan run: bc_auto started at --replan-from, the link
dropped to --replan-to after --replan-at steps, compared with the fresh
runs at --replan-to. Decision times come from the coordinator's decisions
and from planner/bench/online_bench (ResNet-18, Transformer, LSTM). The
last line is JSON.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bytecomp_harness import netns
from bytecomp_harness.bench_cluster import MODEL_DEFAULTS, load_ranks, strategy_yaml
from bytecomp_harness.cluster import NamespacedCluster
from bytecomp.run import find_build_root

HAND = {"fp32": "bc_h_fp32", "fp16": "bc_h_fp16"}


def hand_system(alt):
    if alt in HAND:
        return HAND[alt]
    return "bc_h_" + "".join(ch if ch.isalnum() else "_" for ch in alt)


def median(xs):
    return statistics.median(xs) if xs else None


def slowest(ranks, system, start):
    """Per step the slowest rank's time, from step `start` on."""
    per = [r["systems"].get(system) for r in ranks]
    if not per or any(p is None or "error" in p for p in per):
        errs = [p.get("error") for p in per if p and "error" in p]
        raise RuntimeError("%s: %s" % (system, errs[0] if errs else "no result"))
    n = min(len(p["step_s"]) for p in per)
    return [max(p["step_s"][i] for p in per) for i in range(start, n)]


class Bench:
    def __init__(self, a):
        self.a = a
        self.tmp = tempfile.mkdtemp(prefix="bench-auto-")
        self.strategies = os.path.join(self.tmp, "strategies")
        os.makedirs(self.strategies)
        with open(os.path.join(self.strategies, "bc_none.yaml"), "w") as f:
            f.write(strategy_yaml("bc_none"))
        self.launches = 0
        self.decisions_ms = {}

    def log(self, msg):
        print("bench-auto: %s" % msg, flush=True)

    def launch(self, cluster, model, systems, steps, auto_extra, progress=None):
        self.launches += 1
        out = os.path.join(self.tmp, "out%d" % self.launches)
        d = MODEL_DEFAULTS.get(model, {"batch": 16, "seq": 16})
        args = ["--model", model, "--systems", ",".join(systems), "--warmup", "1",
                "--steps", str(steps), "--batch", str(self.a.batch or d["batch"]),
                "--seq", str(d["seq"]), "--pool", "2", "--lr", "0.05",
                "--auto-compressors", self.a.compressors, "--auto-exclude", self.a.exclude,
                "--auto-extra-steps", str(auto_extra),
                "--strategy-dir", self.strategies, "--out", out]
        if progress:
            args += ["--progress", progress]
        t0 = time.monotonic()
        rc, lines = cluster.torchrun(args, self.a.launch_limit_s)
        self.log("%s: %s ended (exit %s) after %.0f s" % (model, ",".join(systems), rc,
                                                         time.monotonic() - t0))
        if rc != 0:
            raise RuntimeError("launch of %s failed (exit %s): %s" % (
                ",".join(systems), rc, "".join(lines[-20:])))
        return load_ranks(out)

    def auto_of(self, ranks):
        r0 = [r for r in ranks if r["rank"] == 0][0]
        a = r0["systems"]["bc_auto"].get("auto") or {}
        if "error" in a or "switch_iteration" not in a:
            raise RuntimeError("bc_auto made no decision: %s" % a.get("error", a))
        if a.get("decision_ms") is not None:
            self.decisions_ms.setdefault(self.model, []).append(a["decision_ms"])
        return a

    def pair(self, cluster, model, bw):
        """One (model, bandwidth): the first auto launch, then the rounds."""
        self.model = model
        a = self.a
        cluster.shape(bw)
        extra = a.auto_extra
        ranks = self.launch(cluster, model, ["bc_auto"], a.steps, extra)
        first = self.auto_of(ranks)
        hands = {}
        for alt, text in sorted(first["alternative_strategies"].items()):
            sysname = hand_system(alt)
            hands[sysname] = alt
            with open(os.path.join(self.strategies, sysname + ".yaml"), "w") as f:
                f.write(text)
        systems = ["bc_auto"] + sorted(hands)
        measured = {s: [] for s in systems}
        predicted = {s: [] for s in systems}
        compressed = []
        for run in range(a.runs):
            k = run % len(systems)
            order = systems[k:] + systems[:k]
            ranks = self.launch(cluster, model, order, a.steps, extra)
            auto = self.auto_of(ranks)
            sw = auto["switch_iteration"]
            measured["bc_auto"].append(median(slowest(ranks, "bc_auto", sw + 2)))
            predicted["bc_auto"].append(auto["predicted_s"])
            compressed.append(len(auto["compressed"]))
            for s, alt in hands.items():
                measured[s].append(median(slowest(ranks, s, 1)))
                predicted[s].append(auto["alternatives"].get(alt))
        row = {"hands": hands, "compressed_tensors": compressed, "tensors": first["tensors"],
               "systems": {}}
        for s in systems:
            m, p = median(measured[s]), median([x for x in predicted[s] if x is not None])
            row["systems"][s] = {"measured_s": m, "runs_s": measured[s], "predicted_s": p,
                                 "predict_err": abs(p - m) / m if m and p else None}
        best_hand = min(row["systems"][s]["measured_s"] for s in hands)
        row["best_hand_s"] = best_hand
        row["auto_vs_best_hand"] = row["systems"]["bc_auto"]["measured_s"] / best_hand
        row["auto_strictly_best"] = row["systems"]["bc_auto"]["measured_s"] < best_hand
        return row

    def replan(self, cluster, model, fresh_s):
        a = self.a
        cluster.shape(a.replan_from)
        progress = os.path.join(self.tmp, "progress")
        done = threading.Event()
        dropped_at = {}

        def watch():
            while not done.is_set():
                try:
                    with open(progress) as f:
                        system, step = f.read().split()
                    if system == "bc_auto" and int(step) + 1 >= a.replan_at:
                        cluster.shape(a.replan_to)
                        dropped_at["step"] = int(step) + 1
                        self.log("link %s -> %s after step %s" % (a.replan_from, a.replan_to,
                                                                 int(step) + 1))
                        return
                except (OSError, ValueError):
                    pass
                time.sleep(0.05)
        t = threading.Thread(target=watch, daemon=True)
        if os.path.exists(progress):
            os.unlink(progress)
        t.start()
        try:
            ranks = self.launch(cluster, model, ["bc_auto"], a.replan_at + a.replan_steps, 0,
                                progress=progress)
        finally:
            done.set()
            t.join()
        at = dropped_at.get("step")
        if at is None:
            raise RuntimeError("the link was never dropped")
        steps = slowest(ranks, "bc_auto", 0)
        after = steps[at:]
        within = None
        for i in range(len(after) - 2):
            if all(x <= 1.1 * fresh_s for x in after[i:i + 3]):
                within = i
                break
        tail = after[-8:]
        return {"dropped_after_step": at, "steps_after_s": after, "fresh_s": fresh_s,
                "replan_iterations": within, "replan_vs_fresh": median(tail) / fresh_s}

    def decision_bench(self):
        exe = os.path.join(self.a.build_root, "planner", "online_bench")
        if not os.path.exists(exe):
            self.log("no %s (benchmarks disabled in this build): decision_ms null" % exe)
            return {}
        p = subprocess.run([exe, "--benchmark_format=json", "--benchmark_min_time=0.2"],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            self.log("online_bench failed: %s" % p.stderr[-500:])
            return {}
        # Per model the slowest of its link rates (wall time).
        out = {}
        for b in json.loads(p.stdout)["benchmarks"]:
            for model in ("resnet18", "transformer", "lstm"):
                if model in b["name"].lower():
                    unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
                    out[model] = max(out.get(model, 0.0), b["real_time"] * unit)
        return out


def save(out, doc):
    """results.json, rewritten after every pair: a run cut short keeps what it measured."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json.tmp"), "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(os.path.join(out, "results.json.tmp"), os.path.join(out, "results.json"))


def parse(argv):
    ap = argparse.ArgumentParser(prog="bench-auto", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--models", default="resnet18")
    ap.add_argument("--bandwidths", default="100mbit,1gbit,unshaped")
    ap.add_argument("--compressors", default="efsignsgd")
    ap.add_argument("--exclude", default="")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per system")
    ap.add_argument("--auto-extra", type=int, default=12,
                    help="bc_auto's extra steps before the timed ones (profile, plan, switch)")
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--replan-from", default="1gbit")
    ap.add_argument("--replan-to", default="100mbit")
    ap.add_argument("--replan-at", type=int, default=30)
    ap.add_argument("--replan-steps", type=int, default=40)
    ap.add_argument("--no-replan", action="store_true")
    ap.add_argument("--launch-limit-s", type=float, default=1800)
    ap.add_argument("--build-root", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    a.bandwidths = [b for b in a.bandwidths.split(",") if b]
    for b in a.bandwidths + [a.replan_from, a.replan_to]:
        try:
            netns.parse_rate(b)
        except ValueError as e:
            ap.error(str(e))
    a.build_root = a.build_root or find_build_root()
    return a


def main(argv=None):
    a = parse(argv)
    why = netns.check_permission()
    if why:
        print("bench-auto: network namespaces not permitted here: %s" % why, file=sys.stderr)
        return 77
    b = Bench(a)
    results = {}
    re = None
    c = NamespacedCluster(a.nodes, build_root=a.build_root, timeout_ms=120000)
    with c:
        for model in a.models:
            for bw in a.bandwidths:
                b.log("%s at %s" % (model, bw))
                results.setdefault(model, {})[bw] = b.pair(c, model, bw)
                r = results[model][bw]
                save(a.out, {"results": results, "partial": True})
                b.log("%s at %s: auto %.3f s, best hand %.3f s (x%.3f); %s" % (
                    model, bw, r["systems"]["bc_auto"]["measured_s"], r["best_hand_s"],
                    r["auto_vs_best_hand"], ", ".join(
                        "%s %.3f/%.3f" % (s, v["measured_s"], v["predicted_s"] or 0)
                        for s, v in r["systems"].items())))
        if not a.no_replan and a.replan_to in results.get(a.models[0], {}):
            fresh = results[a.models[0]][a.replan_to]["systems"]["bc_auto"]["measured_s"]
            re = b.replan(c, a.models[0], fresh)
    dec = b.decision_bench()
    errs = [v["predict_err"] for m in results.values() for r in m.values()
            for v in r["systems"].values() if v["predict_err"] is not None]
    final = {
        "predict_err_max": max(errs) if errs else None,
        "auto_vs_best_hand_max": max((r["auto_vs_best_hand"] for m in results.values()
                                      for r in m.values()), default=None),
        "auto_strictly_best": sum(r["auto_strictly_best"] for m in results.values()
                                  for r in m.values()),
        "replan_vs_fresh": re["replan_vs_fresh"] if re else None,
        "replan_iterations": re["replan_iterations"] if re else None,
        "decision_ms": {m: dec.get(m) for m in ("resnet18", "transformer", "lstm")},
        "coordinator_decision_ms": {m: median(v) for m, v in b.decisions_ms.items()},
    }
    save(a.out, {"results": results, "replan": re, "final": final})
    print(json.dumps(final))
    return 0
