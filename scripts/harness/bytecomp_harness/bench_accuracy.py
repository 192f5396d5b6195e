"""bench-cluster's accuracy runs (docs/cluster.md, "Accuracy"): the
per-system summary of a task's runs (curves, time and step to the target,
bc_auto's decisions and re-plans per run), their table, their JSON and
their plots. The runs themselves are cluster_worker.run_accuracy's."""

import math
import os
import statistics


def _median(xs):
    return statistics.median(xs) if xs else None


def _fmt(x, spec="%.1f", none="-"):
    return none if x is None else spec % x


def steps_per_epoch(task, world, batch):
    """Steps of one pass over a real set's training split (None for the
    synthetic task, whose samples are fresh every step)."""
    from bytecomp_harness.tasks import Task
    t = Task(task)
    if t.x_train is None:
        return None
    return len(t.y_train) // (world * batch)


def _auto_of_run(rr):
    """bc_auto's record of one run over every node's first process (each
    node's daemon has its own view: the decisions it applied, the
    re-profile requests it received, whether its loss guard or another
    node's rolled the job back)."""
    nodes = [r["auto"] for r in rr if r.get("auto")]
    if not nodes:
        return None
    views = [n.get("view") or {} for n in nodes]
    first = nodes[0]
    return {"compressed": first.get("compressed"), "tensors": first.get("tensors"),
            "switch_iteration": first.get("switch_iteration"),
            "decisions": max((v.get("decisions") or 0) for v in views),
            "replans": max((v.get("replans") or 0) for v in views),
            "states": sorted({v.get("state") for v in views if v.get("state")}),
            "rollback": next((n["rollback"] for n in nodes if n.get("rollback")), None),
            "error": first.get("error") or next((v["error"] for v in views if "error" in v),
                                                None)}


def summarize_task(per):
    """An accuracy task's runs (cluster_worker.run_accuracy) for one system.
    Per run: the step's time is the slowest rank's (a step is done when the
    last rank has stepped), the time axis the sum of those over the steps so
    far (training only: batch preparation and evaluations are not counted),
    the training loss the mean over ranks, the held-out figures over every
    rank's shard. Over the runs: medians; a run that never reached the
    target counts as slower than any that did (the median is null when
    most did not)."""
    st = per[0]["settings"]
    runs = []
    for i in range(len(per[0]["runs"])):
        rr = [p["runs"][i] for p in per]
        step = [max(r["step_s"][j] for r in rr) for j in range(len(rr[0]["step_s"]))]
        cum = [0.0]
        for t in step:
            cum.append(cum[-1] + t)
        loss = [statistics.mean(r["loss"][j] for r in rr) for j in range(len(step))]
        evals = rr[0]["evals"]
        k = st["eval_every"]
        curve = []
        for e in evals:
            lo = max(0, e["step"] - k)
            curve.append({"step": e["step"], "time_s": cum[e["step"]],
                          "train_loss": (statistics.mean(loss[lo:e["step"]])
                                         if e["step"] else None),
                          "heldout_loss": e["loss"], "accuracy": e["accuracy"]})
        hit = next((c for c in curve if c["accuracy"] >= st["target"]), None)
        run = {"seed": rr[0]["seed"], "curve": curve, "step_ms": 1000 * _median(step),
               "final_accuracy": curve[-1]["accuracy"],
               "best_accuracy": max(c["accuracy"] for c in curve),
               "time_to_target_s": hit["time_s"] if hit else None,
               "step_to_target": hit["step"] if hit else None}
        auto = _auto_of_run(rr)
        if auto is not None:
            run["auto"] = auto
        runs.append(run)

    def med(key):
        xs = [r[key] if r[key] is not None else math.inf for r in runs]
        m = _median(xs)
        return None if m is None or m == math.inf else m
    n = len(runs[0]["curve"])
    curve = [{key: _median([r["curve"][j][key] for r in runs])
              if runs[0]["curve"][j][key] is not None else None
              for key in ("step", "time_s", "train_loss", "heldout_loss", "accuracy")}
             for j in range(n)]
    return {"task": per[0]["task"], "settings": st, "momentum_params": per[0]["momentum_params"],
            "repeats": len(runs), "runs": runs, "curve": curve,
            "step_ms": _median([r["step_ms"] for r in runs]),
            "final_accuracy": _median([r["final_accuracy"] for r in runs]),
            "final_accuracy_range": [min(r["final_accuracy"] for r in runs),
                                     max(r["final_accuracy"] for r in runs)],
            "time_to_target_s": med("time_to_target_s"),
            "step_to_target": med("step_to_target"),
            "reached": sum(r["time_to_target_s"] is not None for r in runs)}


def accuracy_json(accuracy):
    """The accuracy part of bench-cluster's last line."""
    acc = {}
    for t, systems in accuracy.items():
        acc[t] = {}
        for sname, r in systems.items():
            if not r or "error" in r or "curve" not in r:
                acc[t][sname] = None
                continue
            acc[t][sname] = {
                "final_accuracy": round(r["final_accuracy"], 2),
                "time_to_target_s": (round(r["time_to_target_s"], 3)
                                     if r["time_to_target_s"] is not None else None),
                "step_to_target": r["step_to_target"], "target": r["settings"]["target"],
                "reached": r["reached"], "repeats": r["repeats"],
                "step_ms": round(r["step_ms"], 2)}
            autos = [x["auto"] for x in r["runs"] if x.get("auto")]
            if autos:
                acc[t][sname]["replans"] = [x["replans"] for x in autos]
    return acc


def accuracy_table(a, accuracy, systems_order, reason):
    """Per task: the settings, and per system the median final held-out
    accuracy (range over the runs), the step, epoch and training time at
    which it first reached the target, the median step time; below it
    bc_auto's decisions and re-plans per run."""
    from bytecomp_harness.tasks import settings as task_settings
    out = ""
    for t, systems in accuracy.items():
        st = task_settings(t, {"steps": a.accuracy_steps or None, "lr": a.accuracy_lr or None})
        per_epoch = steps_per_epoch(t, a.nodes * a.nproc_per_node, st["batch"])
        out += ("\n\nAccuracy: %s at %s, %d nodes x %d, batch %d per process, SGD lr %g "
                "(%s) momentum %g, %d steps%s, held-out evaluation every %d, target %.0f%%; "
                "compressors other than fp16 on tensors of at least %d bytes; "
                "medians of %d run(s) (seeds %d..%d):\n\n| system | SGD momentum on "
                "(params) | final held-out accuracy %% (range) | best %% | step to target | "
                "epoch to target | time to target s | vs DDP fp32 | step ms | reached |\n"
                "|---|---|---|---|---|---|---|---|---|---|\n" % (
                    t, a.accuracy_bandwidth, a.nodes, a.nproc_per_node, st["batch"],
                    st["lr"], st["schedule"], st["momentum"], st["steps"],
                    " (%.1f epochs of %d steps)" % (st["steps"] / per_epoch, per_epoch)
                    if per_epoch else "", st["eval_every"],
                    st["target"], a.compress_min_bytes, a.repeats,
                    a.seed, a.seed + a.repeats - 1))
        ref = (systems.get("ddp_fp32") or {}).get("time_to_target_s")
        autos = []
        for s in systems_order:
            r = systems.get(s)
            if not r or "error" in r or "curve" not in r:
                out += "| %s | null: %s | | | | | | | | |\n" % (s, reason(s, r))
                continue
            mp = r["momentum_params"]
            tt = r["time_to_target_s"]
            stt = r["step_to_target"]
            out += ("| %s | %d of %d | %.2f (%.2f-%.2f) | %.2f | %s | %s | %s | %s | %.1f "
                    "| %d/%d |\n" % (
                        s, mp["sgd_momentum"], mp["sgd_momentum"] + mp["none"],
                        r["final_accuracy"], r["final_accuracy_range"][0],
                        r["final_accuracy_range"][1],
                        _median([x["best_accuracy"] for x in r["runs"]]),
                        _fmt(stt, "%d", "not reached"),
                        _fmt(stt / per_epoch if stt is not None and per_epoch else None,
                             "%.1f", "not reached" if stt is None else "-"),
                        _fmt(tt, "%.2f", "not reached"),
                        _fmt(tt / ref if tt is not None and ref else None, "%.2f"),
                        r["step_ms"], r["reached"], r["repeats"]))
            autos += [(s, x) for x in r["runs"] if x.get("auto")]
        if autos:
            out += ("\n%s, bc_auto per run (each run is a job of its own; re-plans: the "
                    "coordinator's re-profile requests, the most any node's daemon "
                    "received):\n\n| seed | compressed tensors | switch iteration | decisions "
                    "| re-plans | state (per node) | rollback |\n|---|---|---|---|---|---|---|\n"
                    % t)
            for s, x in autos:
                au = x["auto"]
                out += "| %d | %s | %s | %d | %d | %s | %s |\n" % (
                    x["seed"], ", ".join(au["compressed"] or []) or "none",
                    _fmt(au["switch_iteration"], "%d"), au["decisions"], au["replans"],
                    ", ".join(au["states"]) or au.get("error") or "-",
                    au["rollback"] or "-")
    return out


def plot_accuracy(a, accuracy, out_dir):
    """Per task accuracy-<task>.png: training loss (mean over each
    evaluation interval) and held-out accuracy against steps and against
    training time, every system (medians over the runs)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    for t, systems in accuracy.items():
        ok = [(s, r) for s, r in systems.items() if r and "curve" in r]
        if not ok:
            continue
        fig, axes = plt.subplots(2, 2, figsize=(11, 8))
        for s, r in ok:
            c = r["curve"]
            style = "--" if s.startswith("ddp") else "-"
            tl = [(x["step"], x["time_s"], x["train_loss"]) for x in c
                  if x["train_loss"] is not None]
            axes[0][0].plot([x[0] for x in tl], [x[2] for x in tl], style, label=s)
            axes[0][1].plot([x[1] for x in tl], [x[2] for x in tl], style, label=s)
            axes[1][0].plot([x["step"] for x in c], [x["accuracy"] for x in c], style,
                            label=s)
            axes[1][1].plot([x["time_s"] for x in c], [x["accuracy"] for x in c], style,
                            label=s)
        target = ok[0][1]["settings"]["target"]
        for ax in axes[1]:
            ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
            ax.set_ylabel("held-out accuracy %")
        for ax in axes[0]:
            ax.set_ylabel("training loss (interval mean)")
            ax.set_yscale("log")
        for ax in (axes[0][0], axes[1][0]):
            ax.set_xlabel("step")
        for ax in (axes[0][1], axes[1][1]):
            ax.set_xlabel("training time s (slowest rank, evaluations excluded)")
        for ax in axes.flat:
            ax.grid(True, alpha=0.3)
        axes[1][1].legend(fontsize=7)
        st = ok[0][1]["settings"]
        fig.suptitle("%s, %d nodes at %s, lr %g %s, momentum %g; medians of %d run(s)" % (
            t, a.nodes, a.accuracy_bandwidth, st["lr"], st["schedule"],
            st["momentum"], a.repeats))
        fig.tight_layout()
        path = os.path.join(out_dir, "accuracy-%s.png" % t)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
