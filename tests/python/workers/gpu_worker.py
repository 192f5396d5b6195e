"""GPU training through bytecompd for test_gpu (under bytecomp-run; issue 27).

    gpu_worker.py exact DEVICE STEPS       uncompressed: every synced gradient
                                           is the exact sum (op=Sum)
    gpu_worker.py digest DEVICE STEPS      every rank prints a digest of each
                                           step's synced gradients (the test runs
                                           it under bytecomp-run --strategy, on
                                           cuda and on cpu: the same bytes)
    gpu_worker.py kill DEVICE STEPS        rank 1 dies in step 3 after backward
                                           (mid-iteration): rank 0 must raise
    gpu_worker.py auto DEVICE STEPS        strategy="auto" (efsignsgd): prints what
                                           the GPU profile said and the daemon's
                                           answer to it ('GPU_PROFILE ...')
DEVICE: cpu | cuda (every rank on cuda:LOCAL_RANK % device_count()).
Gradients are exact by construction (loss = sum(p * w), so grad = w, a
function of rank and step): the daemon sees the same bytes on either device.
Prints 'OK <mode> ...', 'DIGEST <step> <hex>' or 'RAISED <class>: <message>'
(then exits 3)."""
import hashlib
import os
import sys

import torch

import bytecomp.torch as bc

mode, device, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
bc.init()
r, n = bc.rank(), bc.size()
if device == "cuda":
    dev = torch.device("cuda", bc.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
else:
    dev = torch.device("cpu")
shapes = [(1000, 64), (64,), (4096, 3), (7,)]  # a few sizes, not partition multiples
params = [torch.nn.Parameter(torch.zeros(s, device=dev)) for s in shapes]
named = [("layer%d" % i, p) for i, p in enumerate(params)]
opt = bc.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=named,
                              op=bc.Sum,
                              **({"strategy": "auto", "compressors": ["efsignsgd"]}
                                 if mode == "auto" else {}))
if mode == "auto" and opt.gpu_profile is not None:
    gp = opt.gpu_profile
    print("GPU_PROFILE %s | %s | %s" % (gp["note"], ",".join(sorted(gp["compressors"])),
                                        gp.get("daemon")), flush=True)
mem0 = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
print("PLACED %d" % sum(1 for sl in opt._bc_slots if sl.place is not None), flush=True)
for sl in opt._bc_slots:
    if sl.codec is not None:  # cpu_share: leading partitions left to the daemon
        print("SPLIT %s %d/%d" % (sl.name, sl.codec.dense,
                                  sl.codec.dense + len(sl.codec.parts)), flush=True)
# Elements this process sends through its daemon (the shard's, with the
# intra-node shard flow of BYTECOMP_INTRA_NODE).
print("DAEMON_ELEMENTS %d %s" % (sum(sl.buf.numel() for sl in opt._bc_slots),
                                 opt._bc_intra.mode if opt._bc_intra.flow else "daemon"),
      flush=True)


def weights(rank, step, i, shape):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
    return (torch.randint(-64, 64, shape, generator=g).float() / 8.0)


try:
    for step in range(steps):
        opt.zero_grad()
        ws = [weights(r, step, i, p.shape).to(dev) for i, p in enumerate(params)]
        loss = sum((p * w).sum() for p, w in zip(params, ws))
        loss.backward()
        if mode == "kill" and r == 1 and step == 3:
            os._exit(9)  # mid-iteration: gradients pushed, never waited for
        opt.step()
        got = [p.grad.detach().cpu() for p in params]
        if mode == "exact":
            for i, (p, g) in enumerate(zip(params, got)):
                want = sum(weights(k, step, i, p.shape) for k in range(n))
                assert torch.equal(g, want), "step %d layer%d: not the exact sum" % (step, i)
        elif mode == "digest":
            h = hashlib.sha256()
            for g in got:
                h.update(g.numpy().tobytes())
            print("DIGEST %d %s" % (step, h.hexdigest()[:16]), flush=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if mode == "auto":
        # The node's profile, once the daemon sent it (docs/auto.md: run dir).
        import time
        import yaml
        job = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in opt._bc_job)
        path = os.path.join(os.path.dirname(opt._bc_ctx.settings.socket_path), "runs", job,
                            "profile-node%d.yaml" % opt._bc_ctx.settings.node_rank)
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)
        with open(path) as f:
            prof = yaml.safe_load(f)
        print("PROFILE_GPU %s | %s" % (prof.get("gpu_note"),
                                       ",".join(sorted(c["spec"] for c in
                                                       prof.get("gpu_compressors") or []))),
              flush=True)
    print("OK %s %s rank %d" % (mode, device, r), flush=True)
    bc.shutdown()
except Exception as e:  # noqa: BLE001 - the test reads the class and message
    leaked = (torch.cuda.memory_allocated(dev) - mem0) if dev.type == "cuda" else 0
    print("RAISED %s: %s" % (type(e).__name__, str(e).splitlines()[0]), flush=True)
    print("DEVICE_BYTES_AFTER_FAILURE %d" % leaked, flush=True)
    sys.exit(3)
