"""A training rank without PyTorch for scripts/chaos and scripts/soak.

    python3 -m bytecomp_harness.chaos_worker --socket S --job J --local-rank R --local-size L
        --node-rank N --num-nodes M --iterations K [--elements E] [--tensors a,b,c]
        [--timeout-ms T] [--report-every P] [--stop-file F]

Every rank writes `global_rank + 1 + iteration` (iteration modulo
--value-period when given) into each of its tensors and
checks after every push_pull that each element is the sum over all ranks
(small integers: exact in fp32 and through fp16, so a compressed tensor is
checked exactly too). With --stop-file, a rank that finds the file ends
after the iteration count written in it (the harness writes one count for
every rank, beyond all of them, so the job ends like a finite one). Starting ctypes instead of torch keeps a job's start
well under a second, which is what lets a chaos run inject 100 faults.

Output, one line each, flushed:
  READY <pid>                  after bytecomp_start
  ITER <i>                     every --report-every iterations (and the first)
  RAISED <class> <status> <message>   a bytecomp call failed (exit 3)
  TIMEOUT <message>            no answer within --timeout-ms (exit 5)
  WRONG <message>              a result differs from the expected sum (exit 4)
  DONE <iterations>            all iterations checked (exit 0)
"""

import argparse
import ctypes
import os
import sys
import time

from bytecomp import _lib


def _parse(argv):
    ap = argparse.ArgumentParser(prog="chaos_worker")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--local-rank", type=int, required=True)
    ap.add_argument("--local-size", type=int, required=True)
    ap.add_argument("--node-rank", type=int, required=True)
    ap.add_argument("--num-nodes", type=int, required=True)
    ap.add_argument("--iterations", type=int, default=1 << 30)
    ap.add_argument("--elements", type=int, default=256)
    ap.add_argument("--tensors", default="a,b,c")
    ap.add_argument("--timeout-ms", type=int, default=6000)
    ap.add_argument("--report-every", type=int, default=5)
    ap.add_argument("--start-timeout-ms", type=int, default=20000)
    ap.add_argument("--value-period", type=int, default=0,
                    help="values repeat every P iterations (0: never); keeps long runs' sums "
                         "small integers, exact through fp16 and bf16")
    ap.add_argument("--stop-file", default="",
                    help="once this file exists, end after the iteration count it holds")
    return ap.parse_args(argv)


def _say(*parts):
    sys.stdout.write(" ".join(str(p) for p in parts) + "\n")
    sys.stdout.flush()


def run(a):
    names = [n for n in a.tensors.split(",") if n]
    ranks = a.local_size * a.num_nodes
    me = a.node_rank * a.local_size + a.local_rank
    # sum over ranks r of (r + 1 + it) = ranks * (ranks + 1) / 2 + ranks * it
    base = ranks * (ranks + 1) // 2
    c = _lib.Client(a.job, local_rank=a.local_rank, local_size=a.local_size,
                    node_rank=a.node_rank, num_nodes=a.num_nodes, socket_path=a.socket,
                    connect_timeout_ms=a.start_timeout_ms)
    ids = [c.declare(n, a.elements, _lib.FLOAT32) for n in names]
    c.start(a.start_timeout_ms)
    bufs = []
    for t in ids:
        addr, nbytes = c.buffer(t)
        bufs.append((ctypes.c_float * (nbytes // 4)).from_address(addr))
    _say("READY", os.getpid())
    iterations = a.iterations
    stop_read = not a.stop_file
    it = 0
    while it < iterations:
        if not stop_read and os.path.exists(a.stop_file):
            stop_read = True
            with open(a.stop_file) as f:
                iterations = min(iterations, int(f.read().strip()))
            if it > iterations:
                _say("WRONG", "stop file %s asks to end at %d, this rank is at %d" % (
                    a.stop_file, iterations, it))
                return 4
        step = it % a.value_period if a.value_period else it
        value = float(me + 1 + step)
        handles = []
        for t, b in zip(ids, bufs):
            b[:] = [value] * len(b)
            handles.append(c.push_pull(t, it))
        for t, name, h in zip(ids, names, handles):
            deadline = time.monotonic() + a.timeout_ms / 1000.0
            while not c.wait_once(h, 200):
                if time.monotonic() > deadline:
                    _say("TIMEOUT", "no answer for tensor '%s' iteration %d within %d ms" %
                         (name, it, a.timeout_ms))
                    return 5
        want = float(base + ranks * step)
        for name, b in zip(names, bufs):
            got = b[0]
            if got != want or b[len(b) - 1] != want:
                _say("WRONG", "tensor '%s' iteration %d: got %r, expected %r" %
                     (name, it, got, want))
                return 4
        if it % a.report_every == 0:
            _say("ITER", it)
        it += 1
    err = c.close()
    if err is not None:
        _say("RAISED", type(err).__name__, err.status, err.message)
        return 3
    _say("DONE", iterations)
    return 0


def main(argv=None):
    a = _parse(argv)
    try:
        return run(a)
    except _lib.BytecompError as e:
        _say("RAISED", type(e).__name__, e.status, e.message.replace("\n", " "))
        return 3


if __name__ == "__main__":
    sys.exit(main())
