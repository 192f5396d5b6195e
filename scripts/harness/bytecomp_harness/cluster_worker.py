"""Worker side of scripts/bench-cluster: one training process of the
emulated cluster, started per node by torchrun.

    torchrun --nnodes N --node_rank i ... -m bytecomp_harness.cluster_worker \\
        --model resnet18 --systems compute,ddp_fp32,bc_none --out DIR ...

Runs every system of --systems one after the other in the same processes
(same model init, same batches per rank: synthetic, fixed seed), so all
systems see the same machine load and the same data. With --task instead of
--model it trains a task of bytecomp_harness.tasks (held-out data, the
task's swept learning rate) --repeats times per system and records the
training loss per step and the held-out loss and accuracy every few steps
(run_accuracy). Systems:

  compute        no communication: the compute-only bound (compute_end:
                 the same again, last, so the bound sees the launch's load)
  ddp_fp32       torch DDP over gloo
  ddp_fp16       DDP + fp16_compress_hook
  ddp_powersgd   DDP + powerSGD_hook (rank 1, from the 3rd step)
  bc_*           bytecomp.torch DistributedOptimizer with the strategy file
                 DIR/../strategies/<system>.yaml (or --strategy-dir); SGD
                 momentum on every tensor except those the strategy gives to
                 a compressor with a momentum of its own (dgc: optimizer_for)
  bc_auto        the same with strategy="auto" (--auto-compressors,
                 --auto-exclude): the runtime profiles, plans and applies;
                 the result records the decision of the daemons' run
                 directory (predicted time, compressed tensors, the switch)
  bc_pushpull    goodput probe: one --pushpull-bytes float32 tensor pushed
                 and pulled through bytecomp uncompressed, no compute
  bc_ringprobe   the same over the daemons' ring (`inter: allreduce`)

Per system each rank writes its step times and losses; the first process of
each node also writes the node's link bytes sent (eth0 of its namespace,
/proc/net/dev) and the CPU seconds of the pids in BENCH_WATCH_PIDS (its
node's daemon and colocated server, /proc/PID/stat; with dedicated servers
node 0 also the servers' in BENCH_SERVER_PIDS), over the timed window. A system
that raises is recorded with its error and the next one runs.
"""

import argparse
import json
import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

MODELS = ("resnet18", "transformer", "lstm", "mlp")


# -- workloads ---------------------------------------------------------------
class TransformerClassifier(torch.nn.Module):
    """6-layer encoder, d_model 512: 23.5M parameters."""

    def __init__(self, vocab=8000, d_model=512, layers=6, heads=8, ff=2048, classes=10):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(d_model, classes)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(1))


class LstmLM(torch.nn.Module):
    """2-layer LSTM language model, 20000-word embedding and decoder: 11.3M parameters."""

    def __init__(self, vocab=20000, emb=256, hidden=256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, emb)
        self.lstm = torch.nn.LSTM(emb, hidden, num_layers=2, batch_first=True)
        self.decoder = torch.nn.Linear(hidden, vocab)
        self.vocab = vocab

    def forward(self, x):
        out, _ = self.lstm(self.embed(x))
        return self.decoder(out)


class Mlp(torch.nn.Module):
    """256 -> 512 -> 512 -> 10: 0.4M parameters (the tests' small model)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(256, 512)
        self.fc2 = torch.nn.Linear(512, 512)
        self.head = torch.nn.Linear(512, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build_model(name):
    if name == "mlp":
        return Mlp()
    if name == "resnet18":
        import torchvision
        return torchvision.models.resnet18(num_classes=10)
    if name == "transformer":
        return TransformerClassifier()
    if name == "lstm":
        return LstmLM()
    raise ValueError("model %r: expected one of %s" % (name, ", ".join(MODELS)))


def make_batches(name, rank, batch, pool, seed, seq):
    """`pool` fixed batches of this rank: the same for every system. Labels
    come from a fixed random teacher (the same on every rank), so the loss
    falls by learning, not only by memorising a few batches: a comparison
    of losses after k steps then says how well a system follows DDP."""
    teacher = torch.Generator().manual_seed(12345)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    if name == "mlp":
        w = torch.randn(256, 10, generator=teacher)
        for _ in range(pool):
            x = torch.randn(batch, 256, generator=g)
            out.append((x, (x @ w).argmax(1)))
    elif name == "resnet18":
        w = torch.randn(3 * 8 * 8, 10, generator=teacher)
        for _ in range(pool):
            x = torch.randn(batch, 3, 32, 32, generator=g)
            y = (F.avg_pool2d(x, 4).reshape(batch, -1) @ w).argmax(1)
            out.append((x, y))
    elif name == "transformer":
        w = torch.randn(8000, 10, generator=teacher)
        for _ in range(pool):
            x = torch.randint(0, 8000, (batch, seq), generator=g)
            out.append((x, w[x].sum(1).argmax(1)))
    else:
        # A fixed random Markov chain: the next word is succ[word] with
        # probability 0.9, else uniform.
        succ = torch.randperm(20000, generator=teacher)
        for _ in range(pool):
            tokens = torch.empty(batch, seq + 1, dtype=torch.int64)
            tokens[:, 0] = torch.randint(0, 20000, (batch,), generator=g)
            for t in range(1, seq + 1):
                jump = torch.rand(batch, generator=g) < 0.1
                tokens[:, t] = torch.where(jump, torch.randint(0, 20000, (batch,), generator=g),
                                           succ[tokens[:, t - 1]])
            out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def loss_of(name, model, x, y):
    out = model(x)
    if name == "lstm":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


# -- node counters -----------------------------------------------------------
def link_tx_bytes(dev="eth0"):
    with open("/proc/net/dev") as f:
        for ln in f:
            name, _, rest = ln.partition(":")
            if name.strip() == dev:
                return int(rest.split()[8])
    return None


def cpu_seconds(pids):
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open("/proc/%d/stat" % pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            return None
    return total


class Counters:
    def __init__(self, active, pids, server_pids):
        self.active = active
        self.pids = pids
        self.server_pids = server_pids

    def read(self):
        if not self.active:
            return None
        return {"tx": link_tx_bytes(), "cpu": cpu_seconds(self.pids) if self.pids else None,
                "scpu": cpu_seconds(self.server_pids) if self.server_pids else None}

    @staticmethod
    def delta(a, b, steps):
        if a is None or b is None:
            return {}
        out = {}
        if a["tx"] is not None and b["tx"] is not None:
            out["tx_bytes_per_step"] = (b["tx"] - a["tx"]) / steps
        if a["cpu"] is not None and b["cpu"] is not None:
            out["service_cpu_s_per_step"] = (b["cpu"] - a["cpu"]) / steps
        if a["scpu"] is not None and b["scpu"] is not None:
            out["servers_cpu_s_per_step"] = (b["scpu"] - a["scpu"]) / steps
        return out


# -- systems -----------------------------------------------------------------
# Compressors whose algorithm has a momentum of its own (the daemons apply
# u = m u + g before selecting): SGD momentum on the tensors they compress
# would apply momentum twice.
OWN_MOMENTUM = ("dgc", "signum")


def resolve_option(strategy, name, nbytes):
    """The option a strategy file (docs/strategy-format.md) gives tensor
    `name` of `nbytes`: exact entry, else the first rule whose glob and byte
    window match, else the default; as planner/strategy resolves it."""
    import fnmatch

    def size(v):
        if v is None or isinstance(v, int):
            return v
        units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
        for u, m in units.items():
            if str(v).endswith(u):
                return int(str(v)[:-len(u)]) * m
        return int(v)
    for e in strategy.get("entries") or []:
        if e.get("tensor") == name:
            return e.get("option") or {}
    for r in strategy.get("rules") or []:
        lo, hi = size(r.get("min_bytes")), size(r.get("max_bytes"))
        if (fnmatch.fnmatchcase(name, r.get("match", "*")) and (lo is None or nbytes >= lo)
                and (hi is None or nbytes <= hi)):
            return r.get("option") or {}
    return strategy.get("default") or {}


def optimizer_for(system, model, lr, momentum, args):
    """SGD with `momentum` on every parameter, except the tensors that the
    system's strategy gives to a compressor with its own momentum (dgc:
    its momentum correction is the momentum, as the DGC paper prescribes):
    those get none. Under bc_dgc the tensors below its size window stay
    uncompressed and keep SGD momentum."""
    own = []
    path = os.path.join(args.strategy_dir, system + ".yaml") if system.startswith("bc_") else ""
    if path and os.path.isfile(path):
        import yaml
        with open(path) as f:
            strategy = yaml.safe_load(f) or {}
        own = [p for n, p in model.named_parameters()
               if resolve_option(strategy, n, p.numel() * p.element_size()).get(
                   "compressor") in OWN_MOMENTUM]
    ids = {id(p) for p in own}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups = [{"params": rest, "momentum": momentum}]
    if own:
        groups.append({"params": own, "momentum": 0.0})
    return torch.optim.SGD(groups, lr=lr, momentum=momentum)


def momentum_split(opt):
    """(parameters with SGD momentum, parameters without) of an optimizer."""
    groups = getattr(opt, "param_groups", [])
    return (sum(len(g["params"]) for g in groups if g.get("momentum")),
            sum(len(g["params"]) for g in groups if not g.get("momentum")))


def wrap(system, model, opt, args):
    """Returns (module to call, optimizer to step)."""
    if system in ("compute", "compute_end"):
        return model, opt
    if system.startswith("ddp_"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model)
        if system == "ddp_fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif system == "ddp_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif system != "ddp_fp32":
            raise ValueError("unknown DDP system %r" % system)
        return ddp, opt
    if system == "bc_auto":
        import bytecomp.torch as bc
        from bytecomp import strategy as bc_strategy
        settings = {}
        if args.auto_loss_window:
            settings["loss_guard"] = {"window": args.auto_loss_window}
        return model, bc.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(),
            strategy=bc_strategy.auto([c for c in args.auto_compressors.split(",") if c],
                                      [e for e in args.auto_exclude.split(",") if e],
                                      **settings))
    if system.startswith("bc_"):
        import bytecomp.torch as bc
        strategy = os.path.join(args.strategy_dir, system + ".yaml")
        if not os.path.isfile(strategy):
            raise FileNotFoundError("strategy file %s of system %s is missing" % (strategy,
                                                                                 system))
        return model, bc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                              strategy=strategy)
    raise ValueError("unknown system %r" % system)


FUSION_DROP_IN = "90-bench-fusion.yaml"


def set_fusion(on, local_rank):
    """Tensor fusion on (or off) for the jobs started next, on every node:
    the first process of each node writes (removes) a drop-in in its
    daemon's daemon.yaml.d ($BENCH_DAEMON_DROPIN) and has the daemon reload
    it (`bytecompctl reload`, which answers once applied); then every
    process waits for all, since the coordinator refuses a job whose nodes'
    fusion settings differ. Raises naming what failed."""
    err = None
    if local_rank == 0:
        try:
            d = os.environ.get("BENCH_DAEMON_DROPIN", "")
            if not d:
                raise RuntimeError("BENCH_DAEMON_DROPIN is not set (the daemon's drop-in "
                                   "directory; bytecomp_harness.cluster sets it)")
            path = os.path.join(d, FUSION_DROP_IN)
            if on:
                os.makedirs(d, exist_ok=True)
                with open(path + ".tmp", "w") as f:
                    f.write("version: 1\nfusion: {enabled: true}\n")
                os.replace(path + ".tmp", path)
            elif os.path.exists(path):
                os.remove(path)
            from bytecomp import ctl
            answer = ctl.request(os.environ["BYTECOMP_SOCKET"], "reload")
            want = "fusion %s" % ("on" if on else "off")
            if want not in answer:
                raise RuntimeError("bytecompctl reload answered %r, not %r" % (answer.strip(),
                                                                               want))
        except Exception as e:  # noqa: BLE001 - every rank must reach the barrier
            err = "%s: %s" % (type(e).__name__, e)
    all_errs = [None] * dist.get_world_size()
    dist.all_gather_object(all_errs, err)
    bad = [e for e in all_errs if e]
    if bad:
        raise RuntimeError("turning tensor fusion %s failed: %s" % ("on" if on else "off",
                                                                   bad[0]))


def release(opt):
    """Leaves the system's bytecomp job so its shared memory goes before the next."""
    detach = getattr(opt, "_bytecomp_detach", None)
    if detach is not None:
        detach()
        import bytecomp.torch as bc
        ctx = getattr(bc, "_ctx", None)
        if ctx is not None and opt in getattr(ctx, "optimizers", []):
            ctx.optimizers.remove(opt)


def auto_record(opt, wait_s=0.0):
    """What the daemon of this node decided for the auto job of `opt`
    (its run directory, docs/auto.md): predicted and measured iteration
    times, the switch iteration, how many tensors are compressed."""
    import yaml
    s = opt._bc_ctx.settings
    job = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in opt._bc_job)
    d = os.path.join(os.path.dirname(s.socket_path), "runs", job)
    rec = {"run_dir": d}
    node = opt._bc_ctx.settings.node_rank
    # This node's measurement (measured.yaml is node rank 0's; the folder
    # may be shared by every node's daemon).
    measured = os.path.join(d, "measured-node%d.yaml" % node)
    deadline = time.monotonic() + wait_s
    while not os.path.exists(measured) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        with open(os.path.join(d, "plan.yaml")) as f:
            plan = yaml.safe_load(f)
        rec["predicted_s"] = plan["predicted_us"] / 1e6
        rec["profiled_s"] = plan["measured_us"] / 1e6
        rec["decision_ms"] = plan.get("decision_ms")
        rec["tensors"] = len(plan["tensors"])
        rec["compressed"] = [t["name"] for t in plan["tensors"]
                             if not t["option"].startswith("none")]
        rec["alternatives"] = {a["name"]: a["predicted_us"] / 1e6
                               for a in plan.get("alternatives") or []}
        rec["alternative_strategies"] = {a["name"]: a.get("strategy")
                                         for a in plan.get("alternatives") or []}
        rec["meta"] = (yaml.safe_load(plan.get("strategy") or "") or {}).get("meta") or {}
        with open(os.path.join(d, "profile-node%d.yaml" % node)) as f:
            text = f.read()
        prof = yaml.safe_load(text)
        # Whole, so that a bench's decisions can be replayed offline
        # (bytecomp-plan decide on the merged nodes' profiles).
        rec["profile_yaml"] = text
        rec["profile"] = {k: prof.get(k) for k in ("iteration_us", "link_gbps", "link_latency_us",
                                                   "reduce")}
        rec["profile"]["ready_us"] = {t["name"]: t["ready_us"] for t in prof.get("tensors") or []}
    except (OSError, KeyError, TypeError, ValueError) as e:
        rec["error"] = "no decision in %s (%s)" % (d, e)
    try:
        with open(measured) as f:
            m = yaml.safe_load(f)
        rec["switch_iteration"] = m["switch_iteration"]
        rec["measured_s"] = m["iteration_us"] / 1e6
    except (OSError, KeyError, TypeError, ValueError):
        pass
    try:
        with open(os.path.join(d, "rollback.txt")) as f:
            rec["rollback"] = f.read().strip()
    except OSError:
        pass
    return rec


def auto_view(opt):
    """This node's daemon's view of the auto job of `opt`, as `bytecompctl
    jobs` shows it (docs/auto.md): state, decisions, re-plans (the
    coordinator's re-profile requests this node received), last message;
    None when the daemon does not list the job."""
    from bytecomp import ctl
    try:
        jobs = json.loads(ctl.request(opt._bc_ctx.settings.socket_path, "jobs"))["jobs"]
    except (ctl.CtlError, OSError, ValueError, KeyError) as e:
        return {"error": "bytecompctl jobs: %s" % e}
    for j in jobs:
        if j.get("id") == opt._bc_job:
            a = (j.get("strategy") or {}).get("auto")
            if a:
                return {k: a.get(k) for k in ("state", "epoch", "decisions", "replans",
                                                "message")}
    return None


def auto_switched(opt):
    """Whether this node's daemon has run the auto job of `opt` under its
    decided strategy for a few iterations (its run directory's
    measured-node<r>.yaml, written 5 iterations after the switch by every
    node's daemon; remembered once true). Only then is a reported loss
    surely stamped after the switch."""
    if getattr(opt, "_bc_test_switched", False):
        return True
    s = opt._bc_ctx.settings
    job = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in opt._bc_job)
    switched = os.path.exists(os.path.join(os.path.dirname(s.socket_path), "runs", job,
                                           "measured-node%d.yaml" % s.node_rank))
    opt._bc_test_switched = switched
    return switched


def fake_here(args):
    """Whether --auto-fake-divergence applies to this process's node."""
    nodes = [int(n) for n in args.auto_fake_divergence_nodes.split(",") if n]
    return not nodes or int(os.environ.get("GROUP_RANK", "0")) in nodes


def run_training(system, args, rank, counters):
    torch.manual_seed(args.seed)
    model = build_model(args.model)
    batches = make_batches(args.model, rank, args.batch, args.pool, args.seed, args.seq)
    opt = optimizer_for(system, model, args.lr, 0.9, args)
    fwd, opt = wrap(system, model, opt, args)
    # bc_auto's extra steps come before the timed ones: its profile, plan
    # and switch are not what is timed.
    warmup = args.warmup + (args.auto_extra_steps if system == "bc_auto" else 0)
    steps = warmup + args.steps
    times, losses = [], []
    first_loss = None  # bc_auto's --auto-fake-divergence
    before = after = None
    auto = None
    try:
        for s in range(steps):
            if s == warmup:
                before = counters.read()
            x, y = batches[s % len(batches)]
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_of(args.model, fwd, x, y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.item()))
            if system == "bc_auto":
                # What a user of strategy="auto" does: the loss guard
                # compares these with the uncompressed warm-up's.
                reported = float(loss.item())
                if first_loss is None:
                    first_loss = reported
                if (args.auto_fake_divergence and fake_here(args) and auto_switched(opt)):
                    reported = first_loss * args.auto_fake_divergence
                opt.report_loss(reported)
            if args.progress and rank == 0:
                with open(args.progress + ".tmp", "w") as f:
                    f.write("%s %d\n" % (system, s))
                os.replace(args.progress + ".tmp", args.progress)
        after = counters.read()
        auto = auto_record(opt, 5.0) if system == "bc_auto" else None
    finally:
        release(opt)
    r = {"step_s": times, "loss": losses, "warmup": warmup,
         "params": sum(p.numel() for p in model.parameters())}
    if auto is not None:
        r["auto"] = auto
        r["auto_extra_steps"] = args.auto_extra_steps
    r.update(Counters.delta(before, after, args.steps))
    return r


def train_task(task, st, system, fwd, model, opt, rank, world):
    """One training run of `task` with settings `st` (tasks.TRAIN): per step
    this rank's time (zero_grad + forward + backward + step: what is timed,
    not the batch's preparation nor the evaluations) and training loss; every
    st["eval_every"] steps (and before the first) the held-out loss and
    accuracy, over every rank's shard (gloo all_reduce)."""
    from bytecomp_harness.tasks import lr_at
    times, losses, evals = [], [], []

    def evaluate(step):
        model.eval()
        loss, correct, n = task.evaluate(model, rank, world)
        model.train()
        t = torch.tensor([loss, correct, n], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t)
        evals.append({"step": step, "loss": float(t[0] / t[2]),
                      "accuracy": 100.0 * float(t[1] / t[2])})

    evaluate(0)
    for step in range(st["steps"]):
        x, y = task.batch(step, rank, world, st["batch"])
        for g in opt.param_groups:
            g["lr"] = lr_at(st, step)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if system == "bc_auto":
            opt.report_loss(loss)  # the loss guard's input, as a user would
        losses.append(float(loss.item()))
        if (step + 1) % st["eval_every"] == 0 or step + 1 == st["steps"]:
            evaluate(step + 1)
    out = {"step_s": times, "loss": losses, "evals": evals}
    if system == "bc_auto":
        # What the daemon decided and how often it re-planned during this
        # run (each run is a job of its own), read before the job ends.
        out["auto"] = auto_record(opt)
        out["auto"]["view"] = auto_view(opt)
    return out


def run_accuracy(system, args, rank, size):
    """--task: args.repeats training runs of the task (seeds seed, seed+1,
    ...) with the system, each from the same initial model of its seed.
    Records the settings used and, per parameter group, whether SGD
    momentum applies."""
    from bytecomp_harness.tasks import Task, settings
    st = settings(args.task, {"steps": args.task_steps or None, "lr": args.task_lr or None})
    runs = []
    for r in range(args.repeats):
        seed = args.seed + r
        task = Task(args.task, seed)
        torch.manual_seed(seed)
        model = task.model()
        opt = optimizer_for(system, model, st["lr"], st["momentum"], args)
        split = momentum_split(opt)
        fwd, opt = wrap(system, model, opt, args)
        try:
            run = train_task(task, st, system, fwd, model, opt, rank, size)
        finally:
            release(opt)
        run["seed"] = seed
        runs.append(run)
        if system.startswith("ddp_"):
            dist.barrier()
    return {"task": args.task, "settings": st, "runs": runs,
            "momentum_params": {"sgd_momentum": split[0], "none": split[1]}}


def run_pushpull(args, counters, system):
    """Uncompressed rounds of one tensor, no compute, on the path of
    `system`'s strategy (push/pull or the ring): the goodput probe."""
    import bytecomp.torch as bc
    n = max(1, args.pushpull_bytes // 4)
    p = torch.nn.Parameter(torch.zeros(n))
    opt = bc.DistributedOptimizer(torch.optim.SGD([p], lr=0.0),
                                  named_parameters=[("pushpull", p)],
                                  strategy=os.path.join(args.strategy_dir, system + ".yaml"))
    times = []
    before = after = None
    try:
        for s in range(1 + args.pushpull_rounds):
            if s == 1:
                before = counters.read()
            t0 = time.perf_counter()
            p.sum().backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            opt.zero_grad()
        after = counters.read()
    finally:
        release(opt)
    r = {"step_s": times[1:], "bytes": n * 4}
    r.update(Counters.delta(before, after, args.pushpull_rounds))
    return r


def run_broadcast(args, rank):
    """The model's state (parameters and buffers) from rank 0 to every rank,
    timed both ways in the same launch: DDP's constructor broadcast
    (torch.distributed._broadcast_coalesced in 250 MiB buckets over the same
    tensors, as DistributedDataParallel's _sync_module_states does) and
    bc.broadcast_parameters. Then checks that both made the ranks equal."""
    import bytecomp.torch as bc
    torch.manual_seed(args.seed + rank)
    model = build_model(args.model)
    tensors = list(model.state_dict().values())
    pg = dist.distributed_c10d._get_default_group()
    coalesced = getattr(dist, "_broadcast_coalesced", None)
    ddp, byc = [], []
    for _ in range(args.broadcast_reps):
        for t in tensors:  # the root's values differ from the others' again
            if rank != 0:
                with torch.no_grad():
                    t.add_(1)
        dist.barrier()
        t0 = time.perf_counter()
        if coalesced is not None:
            coalesced(pg, tensors, 250 * 1024 * 1024, 0)
        else:
            for t in tensors:
                dist.broadcast(t, 0)
        ddp.append(time.perf_counter() - t0)
        ref = [t.clone() for t in tensors]
        for t in tensors:
            if rank != 0:
                with torch.no_grad():
                    t.add_(1)
        dist.barrier()
        t0 = time.perf_counter()
        bc.broadcast_parameters(model.state_dict(), root_rank=0)
        byc.append(time.perf_counter() - t0)
        if not all(torch.equal(a, b) for a, b in zip(tensors, ref)):
            raise RuntimeError("bc.broadcast_parameters left rank %d with other values than "
                               "DDP's broadcast" % rank)
    return {"broadcast_s": {"ddp": ddp, "bytecomp": byc},
            "bytes": sum(t.numel() * t.element_size() for t in tensors)}


def main(argv=None):
    ap = argparse.ArgumentParser(description="worker of scripts/bench-cluster")
    ap.add_argument("--model", choices=MODELS, help="step-time runs")
    ap.add_argument("--task", default="", help="accuracy runs instead: a task of "
                    "bytecomp_harness.tasks (digits, cancer, mlp) with its training settings")
    ap.add_argument("--task-steps", type=int, default=0,
                    help="--task: training steps (default: the task's)")
    ap.add_argument("--task-lr", type=float, default=0,
                    help="--task: learning rate (default: the task's swept one)")
    ap.add_argument("--repeats", type=int, default=1, help="--task: runs per system")
    ap.add_argument("--systems", required=True, help="comma-separated, run in this order")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    ap.add_argument("--batch", type=int, default=32, help="per process")
    ap.add_argument("--seq", type=int, default=16, help="sequence length (transformer, lstm)")
    ap.add_argument("--pool", type=int, default=16, help="distinct batches per rank")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pushpull-bytes", type=int, default=16 << 20)
    ap.add_argument("--pushpull-rounds", type=int, default=5)
    ap.add_argument("--broadcast-reps", type=int, default=3,
                    help="system 'broadcast': timed broadcasts of the model's state per way")
    ap.add_argument("--strategy-dir", required=True)
    ap.add_argument("--auto-compressors", default="efsignsgd",
                    help="bc_auto: compressors the planner may use (comma-separated specs)")
    ap.add_argument("--auto-extra-steps", type=int, default=0,
                    help="bc_auto: steps run before the timed ones (profile and switch)")
    ap.add_argument("--progress", default="",
                    help="rank 0 writes '<system> <step>' here after every step")
    ap.add_argument("--auto-loss-window", type=int, default=0,
                    help="bc_auto: loss_guard.window (0: the default)")
    ap.add_argument("--auto-fake-divergence", type=float, default=0,
                    help="bc_auto, for tests: once the daemon's compressed strategy is in "
                         "force, report this factor times the first step's loss (a diverged "
                         "run; the loss guard's rollback)")
    ap.add_argument("--auto-fake-divergence-nodes", default="",
                    help="--auto-fake-divergence only on these node ranks (comma-separated; "
                         "default every node)")
    ap.add_argument("--auto-exclude", default="",
                    help="bc_auto: tensors never compressed (comma-separated globs)")
    ap.add_argument("--out", required=True, help="directory; rank<r>.json is written there")
    ap.add_argument("--timeout-s", type=float, default=300.0,
                    help="gloo collectives' timeout (DDP and the barriers between systems)")
    args = ap.parse_args(argv)
    if bool(args.model) == bool(args.task):
        ap.error("give either --model or --task")
    systems = [s for s in args.systems.split(",") if s]

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    if any(s.startswith("bc_") or s == "broadcast" for s in systems):
        import bytecomp.torch as bc
        bc.init()
    pids = [int(x) for x in os.environ.get("BENCH_WATCH_PIDS", "").split(",") if x]
    server_pids = [int(x) for x in os.environ.get("BENCH_SERVER_PIDS", "").split(",") if x]
    counters = Counters(local_rank == 0, pids, server_pids)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "rank%d.json" % rank)
    results = {"rank": rank, "local_rank": local_rank,
               "node_rank": int(os.environ.get("GROUP_RANK", "0")),
               "threads": torch.get_num_threads(), "systems": {}}
    # With a fused system in the launch, the daemons' setting is set before
    # the first system (a crashed launch may have left it on) and put back
    # off after the last.
    fusion = None if any(x.endswith("_fused") for x in systems) else False
    for system in systems:
        dist.barrier()
        t0 = time.monotonic()
        try:
            fused = system.endswith("_fused")
            if fused != fusion:
                fusion = None  # unknown until every daemon answered: the next system retries
                set_fusion(fused, local_rank)
                fusion = fused
            if system in ("bc_pushpull", "bc_ringprobe"):
                r = run_pushpull(args, counters, system)
            elif system == "broadcast":
                r = run_broadcast(args, rank)
            elif args.task:
                r = run_accuracy(system, args, rank, int(os.environ["WORLD_SIZE"]))
            else:
                r = run_training(system, args, rank, counters)
        except Exception as e:  # noqa: BLE001 - recorded in the table; the next system runs
            r = {"error": "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")}
            if rank == 0:
                traceback.print_exc()
        r["wall_s"] = time.monotonic() - t0
        results["systems"][system] = r
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)
        if rank == 0:
            if "error" in r:
                what = r["error"]
            elif "step_s" in r:
                what = "median step %.1f ms" % (1000 * sorted(r["step_s"])[len(r["step_s"]) // 2])
            elif "broadcast_s" in r:
                what = "broadcast of the model's state: DDP %s s, bytecomp %s s" % (
                    ",".join("%.2f" % x for x in r["broadcast_s"]["ddp"]),
                    ",".join("%.2f" % x for x in r["broadcast_s"]["bytecomp"]))
            else:
                what = "held-out accuracy %s after %d steps" % (
                    ", ".join("%.1f%%" % run["evals"][-1]["accuracy"] for run in r["runs"]),
                    r["settings"]["steps"])
            print("cluster_worker: %s %s: %s (%.1f s)" % (args.model or args.task, system, what,
                                                         r["wall_s"]), flush=True)
    dist.barrier()
    if fusion is not False:
        try:
            set_fusion(False, local_rank)
        except RuntimeError as e:
            print("cluster_worker: %s" % e, flush=True)
    if any(s.startswith("bc_") or s == "broadcast" for s in systems):
        import bytecomp.torch as bc
        bc.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
