"""scripts/bench-cluster: ByteComp against PyTorch DDP on an emulated
cluster of network namespaces with shaped links (docs/cluster.md).

For every model and bandwidth one launch runs every system in the same
training processes (bytecomp_harness.cluster_worker), on the cluster of
bytecomp_harness.cluster (per node a bytecomp-server and a bytecompd from their
YAML files, torchrun --nnodes N --node_rank i). Then per accuracy task
(bytecomp_harness.tasks) one launch trains it --repeats times with every
system: training loss and held-out accuracy against steps and time, time
to the task's target. Prints the tables, writes results.json, results.md,
cluster.png and accuracy-<task>.png into --out, and prints one JSON line
last.
"""

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from bytecomp_harness import bench_accuracy, netns
from bytecomp_harness.cluster import ClusterError, NamespacedCluster, default_threads
from bytecomp_harness.tasks import TASKS, TRAIN
from bytecomp_harness.tasks import settings as task_settings
from bytecomp.run import _can_connect, find_build_root, find_program

DDP_SYSTEMS = ["ddp_fp32", "ddp_fp16", "ddp_powersgd"]
BC_SYSTEMS = ["bc_none", "bc_none_ps", "bc_fp16", "bc_efsignsgd", "bc_topk", "bc_randomk", "bc_dgc", "bc_auto"]
ALL_SYSTEMS = DDP_SYSTEMS + BC_SYSTEMS
# Opt-in (--systems): a base system's strategy with tensor fusion on
# (docs/daemon.md "Tensor fusion"). The workers turn it on for these jobs
# only, through a drop-in in every daemon's daemon.yaml.d and `bytecompctl
# reload` (cluster_worker.set_fusion), so they run in the same launch as
# their base system.
FUSED_SYSTEMS = ["bc_none_fused", "bc_none_ps_fused", "bc_fp16_fused"]
KNOWN_SYSTEMS = ALL_SYSTEMS + FUSED_SYSTEMS
FUSED_SUFFIX = "_fused"
# Goodput probes, one per uncompressed path: push/pull and the ring.
PROBES = ["bc_pushpull", "bc_ringprobe"]
PROBE_PATH = {"bc_pushpull": "ps", "bc_ringprobe": "ring"}
# Run last in a launch: on torch 1.13 + gloo the PowerSGD hook aborts the
# process (gloo EnforceNotMet), which would cost a fresh launch for the rest.
RISKY = ["ddp_powersgd"]
MODELS = ["resnet18", "transformer", "lstm"]
BANDWIDTHS = ["100mbit", "1gbit", "10gbit", "unshaped"]
# Per-process batch and sequence length: the models' compute per step is
# of the same order (a few GFLOP), so no model takes the whole budget.
MODEL_DEFAULTS = {"resnet18": {"batch": 32, "seq": 16}, "transformer": {"batch": 2, "seq": 16},
                  "lstm": {"batch": 4, "seq": 20}}
# Gradient float32 bytes per model (for the duration estimate only).
MODEL_BYTES = {"resnet18": 4 * 11181642, "transformer": 4 * 23015434, "lstm": 4 * 11312672,
               "digits": 4 * 166666, "cancer": 4 * 147202, "mlp": 4 * 399370}
# Seconds per sample on one free core (rough, this machine): the estimate only.
COMPUTE_PER_SAMPLE = {"resnet18": 0.012, "transformer": 0.15, "lstm": 0.12, "digits": 0.0002,
                      "cancer": 0.0002, "mlp": 0.0004}
# Share of float32 bytes each system sends (the estimate only).
WIRE_SHARE = {"ddp_fp32": 1.0, "ddp_fp16": 0.5, "ddp_powersgd": 0.05, "bc_none": 1.0,
              "bc_none_ps": 1.0, "bc_fp16": 0.5, "bc_efsignsgd": 0.04, "bc_topk": 0.02, "bc_randomk": 0.01,
              "bc_dgc": 0.02, "bc_auto": 0.5, "compute": 0.0, "bc_none_fused": 1.0,
              "bc_none_ps_fused": 1.0, "bc_fp16_fused": 0.5}

_OPTION = ("{compressor: %s, params: {%s}, error_feedback: %s, comp_device: cpu, "
           "decomp_device: cpu, inter: alltoall_allgather}")
# The smallest tensor the sparsifiers and efsignsgd compress: auto's
# guard.min_bytes. Until issue 29 it was 64 KiB, which on digits also
# compressed the input layer fc1.weight (128 KiB); dgc, topk and efsignsgd
# then ended 1.4-7 points below DDP fp32 on 4 nodes, and within 0.5 points
# with it uncompressed (docs/cluster.md, "Which tensors a compressor covers").
COMPRESS_MIN_BYTES = 256 << 10
# (compressor, params, error feedback, smallest tensor compressed)
STRATEGIES = {
    "bc_fp16": ("fp16", "", "false", 0),
    "bc_efsignsgd": ("efsignsgd", "", "false", COMPRESS_MIN_BYTES),
    "bc_topk": ("topk", 'ratio: "0.01"', "true", COMPRESS_MIN_BYTES),
    "bc_randomk": ("randomk", 'ratio: "0.01"', "true", COMPRESS_MIN_BYTES),
    "bc_dgc": ("dgc", 'ratio: "0.01"', "false", COMPRESS_MIN_BYTES),
}


def strategy_yaml(system, min_bytes=None):
    """The strategy file of a ByteComp system (docs/strategy-format.md):
    bytecomp.torch's control tensor always uncompressed; every tensor of at
    least the size in STRATEGIES (or `min_bytes`, for every system that
    does not compress every tensor) compressed on the daemons' CPUs, the
    servers decompress-sum-recompress their shard."""
    # Uncompressed tensors take the daemons' ring (`inter: allreduce`), as
    # in Espresso, which sends fp32/fp16 through an allreduce and uses the
    # servers only for compressed tensors; `bc_none_ps` keeps push/pull.
    name = system
    if system.endswith(FUSED_SUFFIX):
        system = system[:-len(FUSED_SUFFIX)]  # fusion is the daemons' setting, not a strategy's
    inter = "reduce_scatter_allgather" if system in ("bc_none_ps", "bc_pushpull") else "allreduce"
    head = ("version: 1\nmeta: {written_by: \"bench-cluster\", system: \"%s\"}\n"
            "default: {compressor: none, inter: %s}\nrules:\n  - match: \"bytecomp.*\"\n"
            "    option: {compressor: none}\n" % (name, inter))
    if system in ("bc_none", "bc_none_ps", "bc_pushpull", "bc_ringprobe"):
        return head
    if system == "bc_fp16":
        return head + "  - match: \"*\"\n    option: {compressor: fp16, inter: allreduce}\n"
    comp, params, ef, own_min = STRATEGIES[system]
    if min_bytes is None or not own_min:
        min_bytes = own_min
    rule = "  - match: \"*\"\n"
    if min_bytes:
        rule += "    min_bytes: %d\n" % min_bytes
    return head + rule + "    option: " + _OPTION % (comp, params, ef) + "\n"


def detect_auto(build_root, timeout=10.0):
    """Whether bytecompd accepts `strategy: {mode: auto}`: None if it does,
    else the reason (the daemon's own error line)."""
    exe = find_program("bytecompd", build_root, "daemon")
    if not exe:
        return "bytecompd not found"
    d = tempfile.mkdtemp(prefix="bench-cluster-auto-")
    sock = os.path.join(d, "ctl.sock")
    cfg = os.path.join(d, "daemon.yaml")
    with open(cfg, "w") as f:
        f.write("version: 1\ncontrol: {socket: %s, socket_mode: 384}\n"
                "shm: {instance: bcauto%d}\nstrategy: {mode: auto}\n" % (sock, os.getpid()))
    p = subprocess.Popen([exe, "--config", cfg], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p.poll() is not None:
                out = p.stdout.read().strip().splitlines()
                err = next((ln for ln in out if "mode" in ln), out[-1] if out else "")
                return "bytecompd does not support strategy: {mode: auto} (%s)" % err.strip()
            if _can_connect(sock):
                return None
            time.sleep(0.05)
        return "bytecompd neither started nor refused strategy: {mode: auto} within %.0f s" % (
            timeout)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        p.stdout.close()
        import shutil
        shutil.rmtree(d, ignore_errors=True)


# -- aggregation ---------------------------------------------------------------
def median(xs):
    return statistics.median(xs) if xs else None


def load_ranks(out_dir):
    ranks = []
    for name in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                ranks.append(json.load(f))
    return ranks


def summarize(ranks, system, world):
    """One system of one launch: step time (median over the timed steps of
    the slowest rank's), node means of bytes and service CPU; for an
    accuracy task its curves and time to the target (summarize_task)."""
    per = [r["systems"].get(system) for r in ranks]
    if len(per) < world or any(p is None for p in per):
        return {"error": "no result from %d of %d processes (the launch failed; see its "
                         "output)" % (sum(p is None for p in per) + world - len(per), world)}
    errs = sorted({p["error"] for p in per if "error" in p})
    if errs:
        return {"error": errs[0]}
    out = {}
    if "step_s" in per[0]:
        w = per[0].get("warmup", 0)
        timed = [max(p["step_s"][i] for p in per) for i in range(w, len(per[0]["step_s"]))]
        out["step_ms"] = 1000 * median(timed)
        out["timed_steps"] = len(timed)
    nodes = [p for r, p in zip(ranks, per) if r["local_rank"] == 0]
    tx = [p["tx_bytes_per_step"] for p in nodes if "tx_bytes_per_step" in p]
    if tx:
        out["bytes_per_node_step"] = statistics.mean(tx)
    cpu = [p["service_cpu_s_per_step"] for p in nodes if "service_cpu_s_per_step" in p]
    if cpu:
        c = statistics.mean(cpu)
        srv = [p["servers_cpu_s_per_step"] for p in nodes if "servers_cpu_s_per_step" in p]
        if srv:
            c += sum(srv) / len(nodes)
        out["service_cpu_ms_per_step"] = 1000 * c
    if "bytes" in per[0]:
        out["bytes"] = per[0]["bytes"]
    auto = per[0].get("auto")
    if auto is not None:
        out["auto"] = {k: auto.get(k) for k in ("predicted_s", "profiled_s", "decision_ms",
                                                "tensors", "compressed", "switch_iteration",
                                                "error")}
        sw = auto.get("switch_iteration")
        if sw is None:
            out["auto"]["note"] = "no switch seen: the timed steps ran the profiling strategy"
        elif sw > per[0].get("warmup", 0):
            out["auto"]["note"] = ("switched at iteration %d, after the timed steps began at %d"
                                   % (sw, per[0].get("warmup", 0)))
    if "broadcast_s" in per[0]:
        out.update(summarize_broadcast(per))
    if "runs" in per[0]:
        out.update(bench_accuracy.summarize_task(per))
    return out


def summarize_broadcast(per):
    """System 'broadcast': per way, the median over the repetitions of the
    slowest rank's time (a broadcast is done when the last rank has it)."""
    out = {}
    for way in ("ddp", "bytecomp"):
        reps = len(per[0]["broadcast_s"][way])
        slowest = [max(p["broadcast_s"][way][i] for p in per) for i in range(reps)]
        out["broadcast_%s_ms" % way] = 1000 * median(slowest) if slowest else None
    return out


def crash_message(lines):
    """The first line of a launch's output that says why a process died."""
    text = [ln.split("]:", 1)[-1].strip() for ln in lines]
    for key in ("what():", "Segmentation fault", "Killed", "Error:", "Error"):
        for ln in text:
            if key in ln and "elastic" not in ln:
                return ln[:300]
    return "no message (see the launch's output)"


def fmt(x, spec="%.1f", none="-"):
    return none if x is None else spec % x


def human_bytes(b):
    if b is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(b) < 1000 or unit == "GB":
            return "%.1f %s" % (b, unit) if unit != "B" else "%d B" % b
        b /= 1000.0


class Bench:
    def __init__(self, args):
        self.args = args
        self.results = {}      # model -> bw -> system -> summary
        self.compute = {}      # model -> bw -> ms
        self.compute_ends = {}  # model -> bw -> [start ms, end ms]
        self.goodput = {}      # bw -> {ratio, ...}
        self.accuracy = {}     # task -> system -> summary (summarize_task)
        self.broadcast = {}    # model -> bw -> {"ddp": ms, "bytecomp": ms} (or an error)
        self.notes = []
        self.t_start = time.monotonic()

    def log(self, msg):
        print("bench-cluster: " + msg, flush=True)

    # -- planning --------------------------------------------------------------
    def steps_for(self, bw, model):
        """Timed steps (after the warm-up)."""
        return self.args.steps

    def estimate_s(self, model, bw, systems):
        a = self.args
        rate = netns.parse_rate(bw)
        cores = os.cpu_count() or 1
        procs = a.nodes * a.nproc_per_node
        if model in TASKS:
            st = task_settings(model, {"steps": a.accuracy_steps or None, "lr": a.accuracy_lr or None})
            batch = st["batch"]
        else:
            batch = a.batch or MODEL_DEFAULTS[model]["batch"]
        compute = COMPUTE_PER_SAMPLE[model] * batch * max(1.0, procs / cores)
        wire = 2.0 * (a.nodes - 1) / a.nodes * MODEL_BYTES[model]
        total = 40.0  # torchrun, imports, process group
        for s in systems:
            comm = 0.0 if rate is None else wire * WIRE_SHARE.get(s, 1.0) * 8 / rate
            steps = (st["steps"] * a.repeats if model in TASKS
                     else a.warmup + self.steps_for(bw, model))
            if s == "bc_auto":  # its profile runs uncompressed
                steps += a.auto_extra_steps
                total += a.auto_extra_steps * wire * 8 / rate if rate else 0
            total += steps * (compute + comm)
            if s.startswith("ddp"):
                total += 0 if rate is None else MODEL_BYTES[model] * 8 / rate  # constructor broadcast
            if s == "broadcast":
                total += 2 * a.broadcast_reps * (
                    2.0 if rate is None else MODEL_BYTES[model] * 8 / rate + 2.0)
        return total

    # -- running ---------------------------------------------------------------
    def launch(self, cluster, model, bw, systems, extra, tmp):
        """`model`: a model of MODELS (step times) or a task of TASKS
        (accuracy runs)."""
        return self._launch(cluster, model, bw, systems, extra, tmp)

    def _launch(self, cluster, model, bw, systems, extra, tmp):
        """Runs `systems` in one launch. A system that kills the training
        processes (e.g. a gloo abort) is recorded with the crash's message
        and the systems after it run in a fresh launch."""
        results = {}
        todo = list(systems)
        attempt = 0
        rc = 0
        while todo:
            attempt += 1
            res, rc, lines = self._launch_once(cluster, model, bw, todo, extra, tmp, attempt)
            done = [s for s in todo if "no result from" not in res[s].get("error", "")]
            for s in done:
                results[s] = res[s]
            left = [s for s in todo if s not in done]
            if not left:
                break
            if rc == 124:
                for s in left:
                    results[s] = {"error": "not finished within the launch's time limit "
                                           "(4x its estimate + 2 min)"}
                break
            culprit = left[0]
            results[culprit] = {"error": "the training processes died during this system "
                                         "(launch exit %s): %s" % (rc, crash_message(lines))}
            self.log("%s at %s: %s crashed the launch: %s" % (model, bw, culprit,
                                                             results[culprit]["error"]))
            todo = left[1:]
            if culprit == "compute":
                break
        for s in systems:
            results.setdefault(s, {"error": "not run: the launch failed before it"})
        return results, rc

    def _launch_once(self, cluster, model, bw, systems, extra, tmp, attempt):
        a = self.args
        out = os.path.join(tmp, "out-%s-%s-%d" % (model, bw, attempt))
        if model in TASKS:
            what = ["--task", model, "--repeats", str(a.repeats),
                    "--task-steps", str(a.accuracy_steps), "--task-lr", str(a.accuracy_lr)]
        else:
            d = MODEL_DEFAULTS[model]
            what = ["--model", model, "--warmup", str(a.warmup),
                    "--steps", str(self.steps_for(bw, model)),
                    "--batch", str(a.batch or d["batch"]), "--seq", str(d["seq"])]
        args = what + ["--systems", ",".join(systems), "--seed", str(a.seed),
                "--strategy-dir", os.path.join(tmp, "strategies"),
                "--out", out, "--auto-compressors", a.auto_compressors,
                "--auto-extra-steps", str(a.auto_extra_steps),
                "--broadcast-reps", str(a.broadcast_reps)] + extra
        est = self.estimate_s(model, bw, systems)
        limit = max(300.0, 4 * est + 120)
        self.log("%s at %s: %s (estimate %.0f s, limit %.0f s)" % (model, bw, ", ".join(systems),
                                                                   est, limit))
        cluster.shape(bw)
        t0 = time.monotonic()
        rc, lines = cluster.torchrun(args, limit)
        self.log("%s at %s: launch ended (%s) after %.0f s" % (
            model, bw, "exit 0" if rc == 0 else "exit %s" % rc, time.monotonic() - t0))
        ranks = load_ranks(out)
        world = a.nodes * a.nproc_per_node
        return {s: summarize(ranks, s, world) for s in systems}, rc, lines

    def total_estimate_s(self, runnable):
        a = self.args
        total = sum(self.estimate_s(m, b, ["compute", "compute_end"] + runnable)
                    for m in a.models for b in a.bandwidths)
        for t in a.accuracy_tasks:
            total += self.estimate_s(t, a.accuracy_bandwidth, self.accuracy_systems(runnable))
        return total

    def accuracy_systems(self, runnable):
        return [s for s in (self.args.accuracy_systems or runnable) if s in runnable]

    def run(self):
        a = self.args
        self.auto_reason = detect_auto(a.build_root) if "bc_auto" in a.systems else None
        if self.auto_reason:
            self.log("bc_auto: null (%s)" % self.auto_reason)
        runnable = [s for s in a.systems if s != "bc_auto" or self.auto_reason is None]
        total = self.total_estimate_s(runnable)
        self.log("%d node(s) x %d process(es), servers %s, %d thread(s) per training process; "
                 "models %s; bandwidths %s; systems %s" % (
                     a.nodes, a.nproc_per_node, a.servers, a.threads, ",".join(a.models),
                     ",".join(a.bandwidths), ",".join(a.systems)))
        self.log("estimated duration %.0f min (from assumed compute per sample and the "
                 "bytes each system sends at each rate; a loaded machine takes longer)" %
                 (total / 60))
        tmp = tempfile.mkdtemp(prefix="bench-cluster-out-")
        os.makedirs(os.path.join(tmp, "strategies"))
        for s in BC_SYSTEMS + FUSED_SYSTEMS + PROBES:
            if s != "bc_auto":
                with open(os.path.join(tmp, "strategies", s + ".yaml"), "w") as f:
                    f.write(strategy_yaml(s, a.compress_min_bytes))
        if a.keep_strategies:
            self.log("strategies in %s" % os.path.join(tmp, "strategies"))
        cluster = NamespacedCluster(a.nodes, a.nproc_per_node, servers=a.servers,
                                    n_dedicated=a.dedicated_servers, threads=a.threads,
                                    build_root=a.build_root, partition_bytes=a.partition_bytes,
                                    link_window=a.link_window)
        with cluster:
            for i, model in enumerate(a.models):
                for bw in a.bandwidths:
                    systems = ["compute"] + [x for x in runnable if x not in RISKY]
                    extra = []
                    if i == 0 and netns.parse_rate(bw) is not None and "bc_none" in runnable:
                        systems += PROBES
                        extra = ["--pushpull-bytes", str(self.pushpull_bytes(bw)),
                                 "--pushpull-rounds", str(a.pushpull_rounds)]
                    systems += self.broadcast_systems(runnable)
                    systems += ["compute_end"] + [x for x in runnable if x in RISKY]
                    res, rc = self.launch(cluster, model, bw, systems, extra, tmp)
                    # The machine's load drifts during a launch: the bound is
                    # the mean of the compute-only runs at its start and end.
                    ends = [res[k].get("step_ms") for k in ("compute", "compute_end")]
                    ends = [x for x in ends if x is not None]
                    self.compute.setdefault(model, {})[bw] = statistics.mean(ends) if ends else None
                    self.compute_ends.setdefault(model, {})[bw] = ends
                    for probe in PROBES:
                        if probe in res:
                            self.goodput.setdefault(bw, {})[PROBE_PATH[probe]] = \
                                self.goodput_of(res[probe], bw)
                    self.record_broadcast(model, bw, res)
                    self.results.setdefault(model, {})[bw] = {
                        s: res[s] for s in runnable}
                    self.log("elapsed %.0f min" % ((time.monotonic() - self.t_start) / 60))
            acc = self.accuracy_systems(runnable)
            for t in a.accuracy_tasks:
                res, rc = self.launch(cluster, t, a.accuracy_bandwidth,
                                      [x for x in acc if x not in RISKY] +
                                      [x for x in acc if x in RISKY], [], tmp)
                self.accuracy[t] = res
                self.log("elapsed %.0f min" % ((time.monotonic() - self.t_start) / 60))
        if not a.keep_strategies:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)

    # -- broadcast of the model's state: bc.broadcast_parameters vs DDP's ------
    def broadcast_systems(self, runnable):
        """The 'broadcast' measurement runs in every launch with a ByteComp
        system (it needs bytecomp.torch and torch.distributed)."""
        return ["broadcast"] if self.args.broadcast_reps > 0 and any(
            s.startswith("bc_") for s in runnable) else []

    def record_broadcast(self, model, bw, res):
        r = res.get("broadcast")
        if r is None:
            return
        if "error" in r:
            self.broadcast.setdefault(model, {})[bw] = {"error": r["error"]}
            return
        self.broadcast.setdefault(model, {})[bw] = {
            "ddp": r.get("broadcast_ddp_ms"), "bytecomp": r.get("broadcast_bytecomp_ms"),
            "bytes": r.get("bytes")}

    def broadcast_json(self):
        return {m: {bw: ({"ddp": round(v["ddp"], 1) if v.get("ddp") is not None else None,
                          "bytecomp": round(v["bytecomp"], 1)
                          if v.get("bytecomp") is not None else None}
                         if "error" not in v else {"ddp": None, "bytecomp": None})
                    for bw, v in bws.items()} for m, bws in self.broadcast.items()}

    def broadcast_table(self):
        if not self.broadcast:
            return ""
        out = ("\n\nBroadcast of the model's state from rank 0 (bc.broadcast_parameters vs "
               "DDP's constructor broadcast, torch.distributed._broadcast_coalesced, same "
               "launch; median of %d, slowest rank):\n\n| model | bandwidth | bytes | DDP ms | "
               "ByteComp ms | ByteComp / DDP |\n|---|---|---|---|---|---|\n" %
               self.args.broadcast_reps)
        for m, bws in self.broadcast.items():
            for bw, v in bws.items():
                if "error" in v:
                    out += "| %s | %s | | null: %s | | |\n" % (m, bw, v["error"])
                    continue
                d, b = v.get("ddp"), v.get("bytecomp")
                out += "| %s | %s | %s | %s | %s | %s |\n" % (
                    m, bw, human_bytes(v.get("bytes")), fmt(d), fmt(b),
                    fmt(b / d if d and b is not None else None, "%.2f"))
        return out

    def pushpull_bytes(self, bw):
        """About 2 s of link time per round, at least 4 MiB, at most 128 MiB."""
        a = self.args
        share = 2.0 * (a.nodes - 1) / a.nodes if a.servers == "colocated" else 1.0
        b = netns.parse_rate(bw) / 8 * 2.0 / max(share, 1e-9)
        return int(min(128 << 20, max(4 << 20, b)) // 4 * 4)

    def goodput_of(self, r, bw):
        """Payload bytes a node's link carries per round over the round
        time, divided by the link rate. Colocated servers: a node pushes
        (N-1)/N of the tensor to the other nodes' servers and its server
        answers the other nodes' pulls of its 1/N share: 2(N-1)/N; the ring
        sends the same 2(N-1)/N (reduce-scatter, then allgather). Dedicated
        servers: the node pushes the whole tensor once (the ring still
        2(N-1)/N; the probe's share is the push/pull one, so a dedicated
        run's ring figure is a lower bound)."""
        if "error" in r or "step_ms" not in r:
            return {"ratio": None, "error": r.get("error", "no figure")}
        a = self.args
        share = 2.0 * (a.nodes - 1) / a.nodes if a.servers == "colocated" else 1.0
        payload = share * r["bytes"]
        rate = netns.parse_rate(bw) / 8
        out = {"ratio": payload / (r["step_ms"] / 1000) / rate, "round_ms": r["step_ms"],
               "tensor_bytes": r["bytes"]}
        if "bytes_per_node_step" in r:
            out["wire_vs_link"] = r["bytes_per_node_step"] / (r["step_ms"] / 1000) / rate
        return out

    # -- output ----------------------------------------------------------------
    def reason(self, system, r):
        if system == "bc_auto" and self.auto_reason:
            return self.auto_reason
        return r.get("error") if r else "not run"

    def final_json(self):
        res = {}
        for m, bws in self.results.items():
            res[m] = {}
            for bw, systems in bws.items():
                res[m][bw] = {s: (round(r["step_ms"], 2) if r.get("step_ms") else None)
                              for s, r in systems.items()}
                if "bc_auto" in self.args.systems and "bc_auto" not in res[m][bw]:
                    res[m][bw]["bc_auto"] = None
        comp = {m: (round(median([v for v in d.values() if v]), 2)
                    if any(d.values()) else None) for m, d in self.compute.items()}
        good = {bw: {path: (round(g["ratio"], 3) if g.get("ratio") is not None else None)
                     for path, g in paths.items()}
                for bw, paths in self.goodput.items()}
        acc = bench_accuracy.accuracy_json(self.accuracy)
        return {"results": res, "compute_only_ms": comp, "goodput_vs_link": good,
                "accuracy": acc, "broadcast_ms": self.broadcast_json()}

    def table(self):
        a = self.args
        rows = ["| model | bandwidth | system | step ms | / compute | vs DDP fp32 | vs DDP fp16 "
                "| bytes sent / node / step | daemon+server CPU ms / step |", "|" + "---|" * 9]
        for m, bws in self.results.items():
            for bw, systems in bws.items():
                comp = self.compute[m].get(bw)
                ends = self.compute_ends.get(m, {}).get(bw, [])
                rows.append("| %s | %s | compute-only | %s (start/end %s) | 1.00 | | | | |"
                            % (m, bw, fmt(comp), "/".join("%.0f" % x for x in ends)))
                ref32 = systems.get("ddp_fp32", {}).get("step_ms")
                ref16 = systems.get("ddp_fp16", {}).get("step_ms")
                for s in a.systems:
                    r = systems.get(s)
                    if not r or r.get("step_ms") is None:
                        rows.append("| %s | %s | %s | null: %s | | | | | |" % (
                            m, bw, s, self.reason(s, r)))
                        continue
                    t = r["step_ms"]
                    rows.append("| %s | %s | %s | %.1f | %s | %s | %s | %s | %s |" % (
                        m, bw, s, t, fmt(t / comp if comp else None, "%.2f"),
                        fmt(ref32 / t if ref32 else None, "%.2f"),
                        fmt(ref16 / t if ref16 else None, "%.2f"),
                        human_bytes(r.get("bytes_per_node_step")),
                        fmt(r.get("service_cpu_ms_per_step"))))
        out = "\n".join(rows)
        if self.goodput:
            out += ("\n\nUncompressed goodput per node, push/pull (`ps`) and the ring "
                    "(payload / round time / link rate):\n\n| bandwidth | path | tensor | "
                    "round ms | goodput / link | wire bytes / link |\n|---|---|---|---|---|---|\n")
            for bw, paths in self.goodput.items():
                for path, g in paths.items():
                    out += "| %s | %s | %s | %s | %s | %s |\n" % (
                        bw, path, human_bytes(g.get("tensor_bytes")), fmt(g.get("round_ms")),
                        fmt(g.get("ratio"), "%.3f", "null: %s" % g.get("error")),
                        fmt(g.get("wire_vs_link"), "%.3f"))
        out += self.broadcast_table()
        out += bench_accuracy.accuracy_table(a, self.accuracy, self.accuracy_systems(a.systems),
                                             self.reason)
        autos = [(m, bw, systems["bc_auto"]["auto"]) for m, bws in self.results.items()
                 for bw, systems in bws.items() if (systems.get("bc_auto") or {}).get("auto")]
        if autos:
            out += ("\n\nbc_auto's decisions (accepted: %s; the first %d steps profile, plan "
                    "and switch, untimed):\n\n| model | bandwidth | compressed tensors | "
                    "predicted step ms | switch iteration | note |\n|---|---|---|---|---|---|\n"
                    % (a.auto_compressors, a.auto_extra_steps + a.warmup))
            for m, bw, au in autos:
                n = len(au.get("compressed") or [])
                out += "| %s | %s | %s | %s | %s | %s |\n" % (
                    m, bw, "%d of %s" % (n, au.get("tensors")) if au.get("tensors") else "-",
                    fmt(au["predicted_s"] * 1000 if au.get("predicted_s") else None),
                    au.get("switch_iteration", "-"), au.get("note") or au.get("error") or "")
        return out

    def plot(self, path):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            self.log("no plot: matplotlib missing (%s; scripts/install-deps installs "
                     "python3-matplotlib)" % e)
            return None
        models = list(self.results)
        panels = len(models)
        fig, axes = plt.subplots(1, max(1, panels), figsize=(5.5 * max(1, panels), 4.5),
                                 squeeze=False)
        for ax, m in zip(axes[0], models):
            bws = list(self.results[m])
            xs = range(len(bws))
            for s in self.args.systems:
                ys = [self.results[m][bw].get(s, {}).get("step_ms") for bw in bws]
                if any(y is not None for y in ys):
                    ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o",
                            label=s, linestyle="--" if s.startswith("ddp") else "-")
            comp = [self.compute[m].get(bw) for bw in bws]
            ax.plot(xs, [c if c else float("nan") for c in comp], color="black", linewidth=2,
                    label="compute-only")
            ax.set_xticks(list(xs))
            ax.set_xticklabels(bws)
            ax.set_yscale("log")
            ax.set_title("%s, %d nodes" % (m, self.args.nodes))
            ax.set_xlabel("link bandwidth")
            ax.set_ylabel("median step time (ms)")
            ax.grid(True, which="both", alpha=0.3)
        if models:
            axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def parse(argv):
    ap = argparse.ArgumentParser(prog="bench-cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--nproc-per-node", type=int, default=1)
    ap.add_argument("--servers", choices=["colocated", "dedicated"], default="colocated")
    ap.add_argument("--dedicated-servers", type=int, default=0,
                    help="server namespaces with --servers dedicated (default: --nodes)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--bandwidths", default=",".join(BANDWIDTHS))
    ap.add_argument("--systems", default=",".join(ALL_SYSTEMS),
                    help="default: all but the fused ones (%s)" % ", ".join(FUSED_SYSTEMS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per system (>= 10)")
    ap.add_argument("--batch", type=int, default=0, help="per process (default: per model)")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS per training process (default cores / processes)")
    ap.add_argument("--accuracy-tasks", default=",".join(TASKS),
                    help="accuracy runs (bytecomp_harness.tasks: %s; '' or 'off': none): "
                         "training loss and held-out accuracy against steps and time, time "
                         "to the task's target" % ", ".join(TASKS))
    ap.add_argument("--accuracy-bandwidth", default="100mbit")
    ap.add_argument("--accuracy-systems", default="",
                    help="systems of the accuracy runs (default: --systems)")
    ap.add_argument("--accuracy-steps", type=int, default=0,
                    help="training steps per accuracy run (default: the task's)")
    ap.add_argument("--accuracy-lr", type=float, default=0,
                    help="learning rate of every accuracy run (default: each task's swept one)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="accuracy runs per task and system (seeds --seed, --seed+1, ...)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pushpull-rounds", type=int, default=5)
    ap.add_argument("--broadcast-reps", type=int, default=3,
                    help="timed broadcasts of the model's state per way and launch (0: off)")
    ap.add_argument("--partition-bytes", default="1MiB",
                    help="the servers' and daemons' partition size (default 1MiB, as "
                         "bytecomp-run)")
    ap.add_argument("--link-window", type=int, default=None,
                    help="the daemons' scheduler.link_window (default: the daemon's, 2; "
                         "0: no per-server credit window)")
    ap.add_argument("--compress-min-bytes", type=int, default=COMPRESS_MIN_BYTES,
                    help="smallest tensor bc_efsignsgd, bc_topk, bc_randomk and bc_dgc compress "
                         "(default %d; bc_fp16 compresses every tensor)" % COMPRESS_MIN_BYTES)
    ap.add_argument("--auto-compressors", default="efsignsgd",
                    help="bc_auto: the compressors its planner may use (comma-separated specs)")
    ap.add_argument("--auto-extra-steps", type=int, default=12,
                    help="bc_auto: untimed steps before its timed ones (profile, plan, switch)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: resnet18, 1gbit and unshaped, 2 nodes, small batch, "
                         "one 60-step accuracy run of cancer unshaped with ddp_fp32 and "
                         "bc_none (under 4 minutes on a quiet machine)")
    ap.add_argument("--build-root", default=None)
    ap.add_argument("--out", default=None, help="directory for results.json, results.md, "
                    "cluster.png (default build/bench-cluster)")
    ap.add_argument("--keep-strategies", action="store_true")
    ap.add_argument("--estimate-only", action="store_true",
                    help="print the duration estimate and exit (nothing is started)")
    a = ap.parse_args(argv)
    if a.quick:
        a.nodes, a.models, a.bandwidths = 2, "resnet18", "1gbit,unshaped"
        a.warmup, a.steps = 1, 10
        a.accuracy_tasks, a.accuracy_bandwidth = "cancer", "unshaped"
        a.accuracy_systems, a.accuracy_steps, a.repeats = "ddp_fp32,bc_none", 60, 1
        a.batch = a.batch or 4
        a.pushpull_rounds = 3
        a.broadcast_reps = min(a.broadcast_reps, 2)
    a.models = [m for m in a.models.split(",") if m]
    a.bandwidths = [b for b in a.bandwidths.split(",") if b]
    a.systems = [s for s in a.systems.split(",") if s]
    a.accuracy_tasks = [t for t in a.accuracy_tasks.split(",") if t and t not in ("off",
                                                                                 "none")]
    a.accuracy_systems = [s for s in a.accuracy_systems.split(",") if s]
    if a.quick:  # the smoke run's pair, as far as --systems has it
        a.accuracy_systems = [s for s in a.accuracy_systems if s in a.systems] or a.systems
    for t in a.accuracy_tasks:
        if t not in TRAIN:
            ap.error("--accuracy-tasks: %r is not one of %s" % (t, ", ".join(TRAIN)))
    for s in a.accuracy_systems:
        if s not in a.systems:
            ap.error("--accuracy-systems: %r is not in --systems" % s)
    if a.repeats < 1:
        ap.error("--repeats must be >= 1")
    for m in a.models:
        if m not in MODELS:
            ap.error("--models: %r is not one of %s" % (m, ", ".join(MODELS)))
    for s in a.systems:
        if s not in KNOWN_SYSTEMS:
            ap.error("--systems: %r is not one of %s" % (s, ", ".join(KNOWN_SYSTEMS)))
    for b in a.bandwidths + ([a.accuracy_bandwidth] if a.accuracy_tasks else []):
        try:
            netns.parse_rate(b)
        except ValueError as e:
            ap.error(str(e))
    if a.nodes < 2:
        ap.error("--nodes %d: the cluster needs at least 2 nodes" % a.nodes)
    if a.steps < 10 and not a.quick:
        ap.error("--steps %d: the median needs at least 10 timed steps" % a.steps)
    if a.nproc_per_node < 1 or a.warmup < 0:
        ap.error("--nproc-per-node must be >= 1 and --warmup >= 0")
    a.dedicated_servers = a.dedicated_servers or a.nodes
    a.build_root = find_build_root(a.build_root)
    if not a.build_root:
        ap.error("no build with daemon/bytecompd found: run meson compile -C build (or "
                 "scripts/test) first, or pass --build-root")
    a.threads = a.threads or default_threads(a.nodes * a.nproc_per_node)
    a.out = a.out or os.path.join(a.build_root, "bench-cluster")
    return a


def main(argv=None):
    a = parse(argv)
    bench = Bench(a)
    if a.estimate_only:
        t = bench.total_estimate_s(a.systems)
        print("bench-cluster: estimated duration %.0f min" % (t / 60))
        return 0
    why = netns.check_permission()
    if why:
        print("bench-cluster: refusing to run: %s" % why, file=sys.stderr)
        return 77

    def on_term(sig, _frame):
        raise KeyboardInterrupt("signal %d" % sig)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    started = datetime.datetime.utcnow()
    load0 = os.getloadavg()
    try:
        bench.run()
    except ClusterError as e:
        print("bench-cluster: error: %s" % e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench-cluster: interrupted; the cluster was removed", file=sys.stderr)
        return 130
    os.makedirs(a.out, exist_ok=True)
    summary = bench.final_json()
    table = bench.table()
    load1 = os.getloadavg()
    header = ("bench-cluster %s UTC, %.0f min, %d cores, load average %.1f at start, %.1f at "
              "end; %d nodes x %d, servers %s, %d thread(s) per training process\n" % (
                  started.strftime("%Y-%m-%d %H:%M"), (time.monotonic() - bench.t_start) / 60,
                  os.cpu_count() or 1, load0[0], load1[0], a.nodes, a.nproc_per_node, a.servers,
                  a.threads))
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write(header + "\n" + table + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"summary": summary, "details": bench.results, "compute": bench.compute,
                   "compute_start_end": bench.compute_ends,
                   "goodput": bench.goodput, "accuracy": bench.accuracy,
                   "args": {k: v for k, v in vars(a).items()}}, f, indent=1, default=str)
    png = bench.plot(os.path.join(a.out, "cluster.png"))
    pngs = bench_accuracy.plot_accuracy(a, bench.accuracy, a.out)
    print()
    print(header)
    print(table)
    print()
    print("bench-cluster: results in %s%s%s" % (a.out, ", plot %s" % png if png else "",
                                               "".join(", %s" % x for x in pngs)))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
