"""Process plumbing the harness shares: the environment of the processes its
clusters start, their configuration files, waiting for a service to come up,
the cluster file both emulated clusters write, and the guarded main of
scripts/chaos and scripts/soak.

What the launcher bytecomp-run already has (bytecomp.run: child processes,
output forwarding, bounded waits and stops) is used from there, not copied.
"""

import json
import os
import signal
import time

from bytecomp.run import _PYTHON_ROOT, describe_status, find_program, with_pythonpath

from bytecomp_harness import HARNESS_ROOT


def python_env(env):
    """env with the client package and this harness first on PYTHONPATH, so
    that `python3 -m bytecomp_harness.<worker>` runs in any namespace."""
    return with_pythonpath(env, _PYTHON_ROOT, HARNESS_ROOT)


def program(name, build_root, subdir, error):
    """The executable `name` of the build (build_root/subdir) or on PATH;
    raises `error` when there is none."""
    exe = find_program(name, build_root, subdir)
    if not exe or not os.access(exe, os.X_OK):
        raise error("%s not found: build the project (meson compile -C build) or "
                    "set BYTECOMP_BUILD_ROOT" % name)
    return exe


def write_file(tmp, rel, text):
    """Writes `text` to tmp/rel (creating its folder); returns the path."""
    path = os.path.join(tmp, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def wait_up(p, ready, what, timeout, error, output="its output is above", poll=0.05):
    """Waits until ready() while process `p` (label, returncode) lives;
    raises `error` when it exits first ("<label> exited during startup
    (<status>); <output>", `output` a string or a function of p) or after
    `timeout` seconds ("<label> did not <what> within <timeout> s")."""
    deadline = time.monotonic() + timeout
    while not ready():
        if p.returncode is not None:
            raise error("%s exited during startup (%s)%s" % (
                p.label, describe_status(p.returncode),
                ": " + output(p) if callable(output) else "; " + output))
        if time.monotonic() > deadline:
            raise error("%s did not %s within %.0f s" % (p.label, what, timeout))
        time.sleep(poll)


def cluster_yaml(partition_bytes, server_addresses, daemon_ids, admission_ms, request_ms,
                 setup_ms, heartbeat_ms, peer_timeout_ms, local_ipc=False):
    """The cluster file (server 0 coordinates) of an emulated cluster.
    local_ipc: a daemon reaches its own node's server over a Unix socket
    (transport.local_ipc; for hosts whose local users are trusted)."""
    servers = "".join('    - {id: %d, address: "%s"}\n' % (k, a)
                      for k, a in enumerate(server_addresses))
    daemons = "".join("    - {id: %d}\n" % d for d in daemon_ids)
    return ("version: 1\ncluster:\n  coordinator: 0\n  partition_bytes: %s\n"
            "  servers:\n%s  daemons:\n%s"
            "  timeouts: {admission_ms: %d, request_ms: %d, setup_ms: %d}\n"
            "transport: {heartbeat_interval_ms: %d, peer_timeout_ms: %d, local_ipc: %s}\n"
            % (partition_bytes, servers, daemons, admission_ms, request_ms, setup_ms,
               heartbeat_ms, peer_timeout_ms, "true" if local_ipc else "false"))


class Interrupted(Exception):
    """SIGINT, SIGTERM or SIGHUP arrived (run_guarded)."""

    def __init__(self, sig):
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


def run_guarded(run, stop, log, errors, on_error=None):
    """Runs run() with SIGINT, SIGTERM and SIGHUP raised as Interrupted;
    returns (run's result or None, exit status): 0; 128 + N after signal N
    (130 after Ctrl-C); 1 after one of `errors` (logged, and given to
    on_error). stop() runs in every case, with those signals ignored: a
    signal during the cleanup would leave namespaces behind."""
    def on_signal(sig, _frame):
        raise Interrupted(sig)
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM,
                                                    signal.SIGHUP)}
    result, code = None, 0
    try:
        result = run()
    except Interrupted as e:
        log("%s: stopping; every process, segment and namespace is removed" % e)
        code = 130 if e.sig == signal.SIGINT else 128 + e.sig
    except errors as e:
        log("error: %s" % e)
        if on_error:
            on_error(e)
        code = 1
    finally:
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        stop()
        for s, h in old.items():
            signal.signal(s, h)
    return result, code


def print_json(summary, path=None):
    """Prints the summary as the last line (sorted keys); also writes it to `path`."""
    line = json.dumps(summary, sort_keys=True)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")
    print(line)
