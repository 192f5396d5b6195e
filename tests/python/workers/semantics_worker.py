"""One training process of test_semantics: pushes known gradients through the
real system (this process -> bytecompd -> servers or peers) and records what
came back.

    semantics_worker.py CASES.json OUT_DIR

CASES.json: {"steps": T, "tensors": [{"name": ..., "count": n, "kind": ...}]}.
Each step it fills every tensor's buffer with semantics_ref.gradient(...) for
its global rank, starts every push_pull, waits for all of them, and keeps
the buffers' contents (the sum the job applies). At the end it writes
OUT_DIR/rank<global rank>.npz: one array [T, n] per tensor."""
import ctypes
import json
import os
import sys

import numpy as np

from bytecomp import _lib
from bytecomp.env import Settings

import semantics_ref


def main(cases_path, out_dir):
    with open(cases_path) as f:
        cases = json.load(f)
    s = Settings.from_environ()
    c = _lib.Client(s.job_id, s.local_rank, s.local_size, s.node_rank, s.num_nodes,
                    s.socket_path, connect_timeout_ms=min(s.timeout_ms, 60000))
    try:
        tensors = cases["tensors"]
        ids = [c.declare(t["name"], t["count"], _lib.FLOAT32) for t in tensors]
        c.start(s.start_timeout_ms)
        bufs = []
        for tid, t in zip(ids, tensors):
            addr, nbytes = c.buffer(tid)
            assert nbytes == 4 * t["count"], (t["name"], nbytes)
            bufs.append(np.ctypeslib.as_array((ctypes.c_float * t["count"]).from_address(addr)))
        steps = cases["steps"]
        got = {t["name"]: np.zeros((steps, t["count"]), np.float32) for t in tensors}
        for it in range(steps):
            for b, t in zip(bufs, tensors):
                b[:] = semantics_ref.gradient(t["kind"], t["count"], it, s.rank)
            handles = [c.push_pull(tid, it) for tid in ids]
            for h in handles:
                if not c.wait_once(h, s.timeout_ms):
                    raise RuntimeError("push_pull of iteration %d did not finish in %d ms"
                                       % (it, s.timeout_ms))
            for b, t in zip(bufs, tensors):
                got[t["name"]][it] = b
        np.savez(os.path.join(out_dir, "rank%d.npz" % s.rank), **got)
    finally:
        err = c.close()
    if err is not None:
        raise err
    print("OK semantics rank %d" % s.rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
