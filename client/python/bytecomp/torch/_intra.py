"""The intra-node step of bytecomp.torch with several GPUs per node (issue
27; docs/daemon.md "Intra-node on GPUs", docs/gpu.md §3): the local ranks
sum each gradient among themselves with NCCL (a reduce-scatter), each rank
sends only its shard through the daemon, in its own job
bytecomp.gpu.shard_job() (local_size 1: one member per node, so the daemons
sum the shards across nodes as for any job, compressed or not), and the
summed shards are allgathered back on the device.

Chosen by BYTECOMP_INTRA_NODE (read when a DistributedOptimizer starts):

  daemon (default) every local rank stages its whole gradient through the
                   daemon, which sums the local ranks in shared memory;
  nccl             the shard flow above, for jobs whose parameters are all
                   float32 CUDA tensors with several local ranks (one device
                   per rank: NCCL refuses two ranks on one device); anything
                   else is refused at start, naming what is wrong;
  host             the same flow on CPU tensors, the node's daemon standing
                   in for NCCL (tests: the optimizer's wiring, with real
                   processes and daemons, where there is no GPU).

The communicator is the job's: local rank 0 makes the NCCL id, a node-local
job (`<job>.intra`, num_nodes 1) broadcasts its 128 bytes, every local rank
creates its communicator at start, and a failure anywhere aborts it
(ncclCommAbort: the other ranks' pending collectives end with an error)."""

import os

import torch

from bytecomp import _lib
from bytecomp import gpu as _gpu
from bytecomp.torch import _nccl
from bytecomp.torch import _staging
from bytecomp.torch._control import _shm_tensor, _wait

MODES = ("daemon", "nccl", "host")
_ID_ELEMENTS = _nccl.NcclComm.ID_BYTES // 4  # float32 elements holding the id


def mode(env=None):
    """BYTECOMP_INTRA_NODE, checked."""
    env = os.environ if env is None else env
    m = env.get("BYTECOMP_INTRA_NODE") or "daemon"
    if m not in MODES:
        raise ValueError("BYTECOMP_INTRA_NODE=%r: expected one of %s" % (m, ", ".join(MODES)))
    return m


def check_params(m, named, local_size):
    """Why the shard flow cannot run for these (name, parameter) pairs, or
    None. Every local rank decides the same way (same model, same env)."""
    if local_size < 2:
        return None
    want = "cuda" if m == "nccl" else "cpu"
    for name, p in named:
        if p.device.type != want:
            return ("BYTECOMP_INTRA_NODE=%s: parameter %r is on %s; the shard flow needs every "
                    "parameter on %s" % (m, name, p.device, want))
        if p.dtype != torch.float32:
            return ("BYTECOMP_INTRA_NODE=%s: parameter %r has dtype %s; the shard flow sums "
                    "float32 only" % (m, name, p.dtype))
    return None


class DaemonComm:
    """ShardFlow's comm over the node's daemon (BYTECOMP_INTRA_NODE=host):
    sum = push_pull of the padded buffer in the node-local job (the exact
    sum over the local ranks; every rank then holds every shard of it, a
    superset of the reduce-scatter's result); allgather = push_pull of a
    buffer that is zero outside the rank's own shard (x + 0 is exact)."""

    def __init__(self, client, local_rank, local_size, timeout_ms):
        self.client = client
        self.local_rank = local_rank
        self.local_size = local_size
        self.timeout_ms = timeout_ms
        self._by_ptr = {}  # padded buffer's data_ptr -> [tid, shm tensor, iteration]
        self.aborted = False

    def adopt(self, buf, tid, shm):
        self._by_ptr[buf.data_ptr()] = [tid, shm, 0]

    def _round(self, buf, fill):
        if self.aborted:
            raise _lib.JobAbortedError("BYTECOMP_ERR_ABORTED",
                                       "intra-node sum: the communicator was aborted")
        e = self._by_ptr[buf.data_ptr()]
        tid, shm, it = e
        fill(shm)
        h = self.client.push_pull(tid, it)
        e[2] = it + 1
        _wait(self.client, h, self.timeout_ms, "intra-node sum (local ranks, daemon)")
        buf.copy_(shm)

    def sum(self, buf, count, shard, stream):
        self._round(buf, lambda shm: shm.copy_(buf))

    def allgather(self, buf, count, stream):
        per = count // self.local_size
        lo, hi = self.local_rank * per, (self.local_rank + 1) * per

        def fill(shm):
            shm.zero_()
            shm[lo:hi].copy_(buf[lo:hi])
        self._round(buf, fill)

    def wait(self, stream):
        pass  # every call above returned done

    def abort(self):
        self.aborted = True

    def close(self):
        pass


class IntraNode:
    """The job's intra-node step for one optimizer: the node-local job,
    the communicator and the ShardFlow. `flow` is None when the local ranks
    do not reduce among themselves (BYTECOMP_INTRA_NODE=daemon, or one
    local rank)."""

    def __init__(self, m, settings, job, named, device):
        self.mode = m
        self.flow = None
        self.comm = None
        self.client = None
        self.local_rank = settings.local_rank
        self.local_size = settings.local_size
        if m == "daemon" or settings.local_size < 2:
            return
        why = check_params(m, named, settings.local_size)
        if why is not None:
            raise _lib.UnsupportedError("BYTECOMP_ERR_UNSUPPORTED", why)
        s = settings
        if m == "nccl":
            _nccl.NcclComm._lib()  # refuses a libbytecomp_gpu without NCCL, by name
        client = _lib.Client(job + ".intra", s.local_rank, s.local_size, 0, 1, s.socket_path,
                             connect_timeout_ms=min(s.timeout_ms, 60000))
        try:
            id_tid = client.declare("bytecomp.intra.nccl_id", _ID_ELEMENTS, _lib.FLOAT32)
            host_tids = []
            if m == "host":
                for name, p in named:
                    padded, _ = _gpu.shard_layout(p.numel(), s.local_size)
                    host_tids.append(client.declare("bytecomp.intra." + name, padded,
                                                    _lib.FLOAT32))
            client.start(s.start_timeout_ms)
            if m == "nccl":
                self.ops = _staging.TorchCudaOps(device)
                self.comm = _nccl.NcclComm(self._exchange_id(client, id_tid, s), s.local_size,
                                           s.local_rank, device.index or 0, s.timeout_ms)
            else:
                self.ops = _staging.HostOps()
                self.comm = DaemonComm(client, s.local_rank, s.local_size, s.timeout_ms)
            self.flow = _nccl.ShardFlow(self.comm, self.ops, s.local_rank, s.local_size)
            self._host_tids = host_tids
        except BaseException:
            if self.comm is not None:
                self.comm.abort()
            client.close()
            raise
        self.client = client

    def _exchange_id(self, client, tid, s):
        """Local rank 0's NCCL id, through the node-local job's broadcast."""
        addr, nbytes = client.buffer(tid)
        raw = _shm_tensor(addr, nbytes, torch.float32, (_ID_ELEMENTS,)).view(torch.uint8)
        if s.local_rank == 0:
            raw.copy_(torch.frombuffer(bytearray(_nccl.NcclComm.make_id()), dtype=torch.uint8))
        h = client.broadcast(tid, 0, 0, _nccl.NcclComm.ID_BYTES, 0x6e63636c)
        _wait(client, h, s.timeout_ms, "NCCL id broadcast (local rank 0 to the others)")
        return bytes(raw.numpy().tobytes())

    def shard_count(self, count):
        """The elements a tensor of `count` sends through the daemon."""
        if self.flow is None:
            return count
        return _gpu.shard_layout(count, self.local_size)[1]

    def prepare(self, key, param, index):
        """Makes the tensor's padded buffer now (declaration order), so the
        host stand-in's comm knows which node-local tensor carries it."""
        if self.flow is None:
            return
        buf = self.flow.layout(key, param.detach())[0]
        if isinstance(self.comm, DaemonComm):
            tid = self._host_tids[index]
            addr, nbytes = self.client.buffer(tid)
            self.comm.adopt(buf, tid, _shm_tensor(addr, nbytes, torch.float32, (buf.numel(),)))

    def bounded_wait(self, stream):
        """Before the host waits on the side stream: NCCL's bounded wait
        (aborts the communicator and raises on a timeout or a dead rank)."""
        try:
            self.comm.wait(stream)
        except BaseException:
            self.comm.abort()
            raise

    def abort(self):
        if self.comm is not None:
            self.comm.abort()

    def close(self):
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.close()
        if self.flow is not None:
            self.flow.close()
        client, self.client = self.client, None
        if client is not None:
            client.close()
