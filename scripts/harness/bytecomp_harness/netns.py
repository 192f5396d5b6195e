"""An emulated cluster of network namespaces on one machine.

Each node is a network namespace with one veth (`eth0`) whose peer sits in
a private "switch" namespace holding a bridge. Nothing is created in the
caller's namespace: the addresses (10.213.0.0/24 by default) exist only
inside this run's namespaces, so they cannot collide with the machine's
networks, and two runs (different pids) never share a name.

Shaping: `tc tbf` on both ends of every veth, i.e. on the node's egress
and on the switch's egress towards the node (the node's ingress). The
burst is sized for the rate (a burst smaller than rate / HZ caps the rate
below what was asked): max(64 KiB, 10 ms worth of bytes).

Names: `bcc<pid>s` (switch), `bcc<pid>n<i>` (nodes). `remove_stale()`
deletes the namespaces of earlier runs whose pid is gone (the processes
left inside them are killed first).

Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (creating namespaces); `check_permission()`
says why not in one sentence.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time

PREFIX = "bcc"
_NAME_RE = re.compile(r"^%s(\d+)(s|n\d+)$" % PREFIX)
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_UNIT = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


class NetnsError(Exception):
    """A namespace operation failed; the message names the command and why."""


def parse_rate(rate):
    """'100mbit' -> 1e8 bits/s; 'unshaped' -> None. Raises ValueError naming the value."""
    if rate == "unshaped":
        return None
    m = _RATE_RE.match(rate or "")
    if not m or float(m.group(1)) <= 0:
        raise ValueError("bandwidth %r: expected a rate like 100mbit, 1gbit, 10gbit, 500kbit "
                         "or 'unshaped'" % (rate,))
    return float(m.group(1)) * _UNIT[m.group(2)]


def tbf_burst_bytes(bits_per_s):
    return int(max(64 * 1024, bits_per_s / 8 * 0.010))


def _ip():
    return shutil.which("ip") or "/usr/sbin/ip"


def _tc():
    return shutil.which("tc") or "/usr/sbin/tc"


def _run(argv, check=True, timeout=20):
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    except FileNotFoundError:
        raise NetnsError("%s: not found (install iproute2)" % argv[0]) from None
    except subprocess.TimeoutExpired:
        raise NetnsError("'%s' did not finish within %d s" % (" ".join(argv), timeout)) from None
    if check and p.returncode != 0:
        raise NetnsError("'%s' failed (exit %d): %s" % (" ".join(argv), p.returncode,
                                                         (p.stderr or p.stdout).strip()))
    return p


def list_namespaces():
    p = _run([_ip(), "netns", "list"], check=False)
    return [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()]


def check_permission():
    """None when namespaces can be created here, else the reason (one sentence)."""
    if not shutil.which("ip") and not os.path.exists("/usr/sbin/ip"):
        return "the 'ip' command (iproute2) is missing: run scripts/install-deps"
    if not shutil.which("tc") and not os.path.exists("/usr/sbin/tc"):
        return "the 'tc' command (iproute2) is missing: run scripts/install-deps"
    probe = "%s%dprobe" % (PREFIX, os.getpid())
    p = _run([_ip(), "netns", "add", probe], check=False)
    if p.returncode != 0:
        return ("creating a network namespace failed (%s): the emulated cluster needs root "
                "or CAP_NET_ADMIN + CAP_SYS_ADMIN" % (p.stderr.strip() or "exit %d" % p.returncode))
    try:
        q = _run([_ip(), "-n", probe, "link", "add", "t0", "type", "veth", "peer", "name", "t1"],
                 check=False)
        if q.returncode != 0:
            return "creating a veth pair failed (%s): the kernel lacks veth support" % (
                q.stderr.strip())
        q = _run([_tc(), "-n", probe, "qdisc", "add", "dev", "t0", "root", "tbf", "rate",
                  "100mbit", "burst", "64kb", "latency", "50ms"], check=False)
        if q.returncode != 0:
            return "adding a tbf qdisc failed (%s): the kernel lacks sch_tbf" % q.stderr.strip()
    finally:
        _run([_ip(), "netns", "del", probe], check=False)
    return None


def pids_in(ns):
    p = _run([_ip(), "netns", "pids", ns], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _kill_all_in(ns, grace=3.0):
    pids = pids_in(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = [x for x in pids if os.path.exists("/proc/%d" % x)]
            time.sleep(0.05)
        if not pids:
            return


def delete(ns):
    """Kills what runs in `ns` and deletes it (its veth ends go with it)."""
    _kill_all_in(ns)
    _run([_ip(), "netns", "del", ns], check=False)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_stale(log=None):
    """Deletes namespaces of earlier runs (name prefix, pid no longer alive)."""
    removed = []
    for ns in list_namespaces():
        m = _NAME_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and not _pid_alive(pid):
            delete(ns)
            removed.append(ns)
    if removed and log:
        log("removed %d stale namespace(s) of earlier runs: %s" % (len(removed),
                                                                   " ".join(removed)))
    return removed


class Cluster:
    """`nodes` namespaces on one bridge. Use as a context manager, or call
    create() and remove() (remove() is idempotent and never raises)."""

    def __init__(self, nodes, subnet="10.213.0", tag=None):
        if nodes < 1 or nodes > 200:
            raise ValueError("nodes=%d: expected 1..200" % nodes)
        self.nodes = nodes
        self.subnet = subnet
        self.tag = "%s%d" % (PREFIX, tag if tag is not None else os.getpid())
        self.switch = self.tag + "s"
        self.names = ["%sn%d" % (self.tag, i) for i in range(nodes)]
        self.created = []
        self.rate = None

    def address(self, i):
        return "%s.%d" % (self.subnet, i + 1)

    def exec_prefix(self, i):
        """argv prefix that runs a command in node i's namespace."""
        return [_ip(), "netns", "exec", self.names[i]]

    def create(self):
        ip = _ip()
        try:
            for ns in [self.switch] + self.names:
                _run([ip, "netns", "add", ns])
                self.created.append(ns)
                _run([ip, "-n", ns, "link", "set", "lo", "up"])
            _run([ip, "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run([ip, "-n", self.switch, "link", "set", "br0", "up"])
            for i, ns in enumerate(self.names):
                port = "p%d" % i
                _run([ip, "-n", self.switch, "link", "add", port, "type", "veth", "peer",
                      "name", "eth0", "netns", ns])
                _run([ip, "-n", self.switch, "link", "set", port, "master", "br0"])
                _run([ip, "-n", self.switch, "link", "set", port, "up"])
                _run([ip, "-n", ns, "addr", "add", self.address(i) + "/24", "dev", "eth0"])
                _run([ip, "-n", ns, "link", "set", "eth0", "up"])
        except BaseException:
            self.remove()
            raise
        return self

    def shape(self, rate):
        """Sets every link to `rate` ('100mbit', ..., or 'unshaped') both ways."""
        bits = parse_rate(rate)
        tc = _tc()
        for i, ns in enumerate(self.names):
            for where, dev in ((ns, "eth0"), (self.switch, "p%d" % i)):
                _run([tc, "-n", where, "qdisc", "del", "dev", dev, "root"], check=False)
                if bits is not None:
                    # latency bounds the queue: enough for a few bursts in flight.
                    _run([tc, "-n", where, "qdisc", "add", "dev", dev, "root", "tbf",
                          "rate", "%dbit" % int(bits), "burst", str(tbf_burst_bytes(bits)),
                          "latency", "100ms"])
        self.rate = rate

    def tx_bytes(self, i):
        """Bytes node i has sent on its link (from the switch side: what p<i> received)."""
        p = _run([_ip(), "-n", self.switch, "-s", "-j", "link", "show", "p%d" % i])
        info = json.loads(p.stdout)[0]
        return int(info["stats64"]["rx"]["bytes"])

    def remove(self):
        for ns in reversed(self.created):
            try:
                delete(ns)
            except Exception:  # noqa: BLE001 - removal must go on for the others
                pass
        self.created = []

    def __enter__(self):
        return self.create()

    def __exit__(self, *exc):
        self.remove()
        return False
