"""The job's settings, read from the environment.

Launchers set these: `bytecomp-run` sets all of them; torchrun sets the
first group (and GROUP_RANK) and leaves BYTECOMP_* to the user or to the
systemd setup (docs/torch.md).

  RANK, WORLD_SIZE              global rank of this process, number of processes
  LOCAL_RANK, LOCAL_WORLD_SIZE  rank among the processes on this node, their number
  BYTECOMP_NODE_RANK            this node's rank (else GROUP_RANK, else NODE_RANK,
                                else RANK // LOCAL_WORLD_SIZE)
  BYTECOMP_JOB_ID               the job's name, the same in every process
                                (else TORCHELASTIC_RUN_ID when torchrun got --rdzv_id)
  BYTECOMP_SOCKET               the node daemon's control socket (default
                                /run/bytecomp/bytecompd.sock)
  BYTECOMP_TIMEOUT_MS           bound on every wait for the other processes (30000)
  BYTECOMP_START_TIMEOUT_MS     bound on waiting for every local process to join (60000)
  BYTECOMP_STRATEGY             the strategy file the node daemons run (bytecomp-run
                                --strategy sets it; unset: unknown / uncompressed)
  BYTECOMP_INTRA_NODE           daemon | nccl | host: how the local ranks sum
                                (read by DistributedOptimizer, torch/_intra.py)

A missing or inconsistent value raises `EnvironmentConfigError`, whose
message names the variable, the value found and the value expected.
"""

import os
import re

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_LAUNCH_HINT = ("start the script with bytecomp-run (local cluster) or torchrun "
                "(real cluster), which set it")


class EnvironmentConfigError(ValueError):
    """A missing or inconsistent environment variable.

    `variable` is its name, `found` the value seen (None when unset) and
    `expected` a description of what was expected."""

    def __init__(self, variable, found, expected, hint=""):
        self.variable = variable
        self.found = found
        self.expected = expected
        what = "is not set" if found is None else "is %r" % (found,)
        msg = "environment variable %s %s: expected %s" % (variable, what, expected)
        if hint:
            msg += " (%s)" % hint
        super().__init__(msg)


def _int(env, name, expected, lo, hi=None, default=None, hint=_LAUNCH_HINT):
    raw = env.get(name)
    if raw is None or raw == "":
        if default is not None:
            return default
        raise EnvironmentConfigError(name, None, expected, hint)
    try:
        v = int(raw.strip(), 10)
    except ValueError:
        raise EnvironmentConfigError(name, raw, expected, hint) from None
    if v < lo or (hi is not None and v > hi):
        raise EnvironmentConfigError(name, raw, expected, hint)
    return v


class Settings:
    """A validated snapshot of the job's environment (a plain value)."""

    def __init__(self, rank, size, local_rank, local_size, node_rank, num_nodes, job_id,
                 socket_path, timeout_ms, start_timeout_ms, strategy):
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.job_id = job_id
        self.socket_path = socket_path
        self.timeout_ms = timeout_ms
        self.start_timeout_ms = start_timeout_ms
        self.strategy = strategy

    def __repr__(self):
        return ("Settings(rank=%d/%d, local=%d/%d, node=%d/%d, job=%r, socket=%r)" %
                (self.rank, self.size, self.local_rank, self.local_size, self.node_rank,
                 self.num_nodes, self.job_id, self.socket_path))

    @staticmethod
    def from_environ(env=None):
        env = os.environ if env is None else env
        size = _int(env, "WORLD_SIZE", "the number of training processes, an integer >= 1", 1)
        rank = _int(env, "RANK", "this process's global rank, an integer in 0..%d" % (size - 1),
                    0, size - 1)
        local_size = _int(env, "LOCAL_WORLD_SIZE",
                          "the number of training processes on this node, an integer in "
                          "1..%d dividing WORLD_SIZE=%d" % (size, size), 1, size)
        if size % local_size != 0:
            raise EnvironmentConfigError(
                "LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE"),
                "a divisor of WORLD_SIZE=%d (every node runs the same number of processes)" % size)
        local_rank = _int(env, "LOCAL_RANK",
                          "this process's rank on its node, an integer in 0..%d" % (local_size - 1),
                          0, local_size - 1)
        num_nodes = size // local_size
        node_var = next((v for v in ("BYTECOMP_NODE_RANK", "GROUP_RANK", "NODE_RANK")
                         if env.get(v, "") != ""), None)
        if node_var is not None:
            node_rank = _int(env, node_var, "this node's rank, an integer in 0..%d "
                             "(WORLD_SIZE / LOCAL_WORLD_SIZE = %d nodes)" % (num_nodes - 1, num_nodes),
                             0, num_nodes - 1)
        else:
            node_rank = rank // local_size
        expected_rank = node_rank * local_size + local_rank
        if rank != expected_rank:
            raise EnvironmentConfigError(
                "RANK", env.get("RANK"),
                "%d = node rank %d (%s) * LOCAL_WORLD_SIZE %d + LOCAL_RANK %d: ranks must be "
                "numbered node by node" % (expected_rank, node_rank, node_var or "RANK // "
                                           "LOCAL_WORLD_SIZE", local_size, local_rank))

        job_id = env.get("BYTECOMP_JOB_ID", "")
        job_var = "BYTECOMP_JOB_ID"
        if job_id == "":
            run_id = env.get("TORCHELASTIC_RUN_ID", "")
            if run_id not in ("", "none"):
                job_id, job_var = run_id, "TORCHELASTIC_RUN_ID"
        job_expected = ("a job name shared by every process of the job, 1..120 characters of "
                        "[A-Za-z0-9._-]")
        if job_id == "":
            raise EnvironmentConfigError(
                "BYTECOMP_JOB_ID", None, job_expected,
                "bytecomp-run sets it; with torchrun export it or pass --rdzv_id")
        # The package appends short suffixes (".ctl", ".opt0"): keep room.
        if not _JOB_ID_RE.match(job_id) or len(job_id) > 120:
            raise EnvironmentConfigError(job_var, job_id, job_expected)

        socket_path = env.get("BYTECOMP_SOCKET") or None
        if socket_path is not None and len(socket_path.encode()) > 107:
            raise EnvironmentConfigError("BYTECOMP_SOCKET", socket_path,
                                         "a Unix socket path of at most 107 bytes")
        timeout_ms = _int(env, "BYTECOMP_TIMEOUT_MS",
                          "a bound in milliseconds on each wait, an integer in 1..86400000",
                          1, 86400000, default=30000, hint="")
        start_timeout_ms = _int(env, "BYTECOMP_START_TIMEOUT_MS",
                                "a bound in milliseconds on job start, an integer in 1..86400000",
                                1, 86400000, default=60000, hint="")
        strategy = env.get("BYTECOMP_STRATEGY") or None
        if strategy is not None and not os.path.isfile(strategy):
            raise EnvironmentConfigError("BYTECOMP_STRATEGY", strategy,
                                         "the path of a readable strategy file "
                                         "(docs/strategy-format.md)")
        return Settings(rank, size, local_rank, local_size, node_rank, num_nodes, job_id,
                        socket_path, timeout_ms, start_timeout_ms, strategy)
