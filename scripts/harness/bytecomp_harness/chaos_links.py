"""Link faults for scripts/chaos on a namespace's `eth0` (docs/reliability.md).

Every fault touches only namespaces of the run's own FaultNet, and each has
an undo that is safe to repeat:

  down/up          `ip link set eth0 down|up` (a node's or a server's link;
                   repeated every few seconds: a flapping link)
  drop             iptables-legacy DROP on eth0 both ways, all packets (a
                   partition with the link up) or a `statistic` share (loss)
  tbf              a token bucket on both ends of the veth (a slow link)
  netem            delay/reorder where the kernel has sch_netem (this VM's
                   has not, nor sch_fq/etf)
  delay            where there is no netem: iptables NFQUEUE on eth0 both
                   ways and bytecomp_harness.netdelay bound to the queue in
                   the namespace, which holds packets and gives verdicts in
                   due-time order (delay, jitter, reordering of real packets)
"""

import os
import shutil

from bytecomp_harness import netns
from bytecomp_harness.faultnet import FaultNetError, Proc

QUEUE_BASE = 40            # NFQUEUE number = QUEUE_BASE + namespace index


def tc(args):
    return netns._run([netns._tc()] + args, check=False)


def ip(args):
    return netns._run([netns._ip()] + args, check=False)


def has_netem():
    """Whether this kernel has sch_netem (some VM kernels do not)."""
    probe = "%s%dnetem" % (netns.PREFIX, os.getpid())
    if ip(["netns", "add", probe]).returncode != 0:
        return False
    try:
        return tc(["-n", probe, "qdisc", "add", "dev", "lo", "root", "netem",
                   "delay", "1ms"]).returncode == 0
    finally:
        ip(["netns", "del", probe])


def find_iptables():
    """iptables-legacy (this kernel has x_tables; scripts/install-deps) or None."""
    return shutil.which("iptables-legacy") or (
        "/usr/sbin/iptables-legacy" if os.path.exists("/usr/sbin/iptables-legacy") else None)


class Links:
    def __init__(self, net, echo=None):
        self.net = net                  # a FaultNet
        self.iptables = find_iptables()
        self.netem_ok = has_netem()
        self.echo = echo
        self.delayers = {}              # namespace index -> Proc (netdelay)

    def _veth_ends(self, ns):
        return [(self.net.ns_name(ns), "eth0"), (self.net.net.switch, "p%d" % ns)]

    def link(self, ns, up):
        p = ip(["-n", self.net.ns_name(ns), "link", "set", "eth0", "up" if up else "down"])
        if p.returncode != 0:
            raise FaultNetError("ip link set %s in %s: %s" % (
                "up" if up else "down", self.net.ns_name(ns), p.stderr.strip()))

    def netem(self, ns, spec):
        for name, dev in self._veth_ends(ns):
            tc(["-n", name, "qdisc", "del", "dev", dev, "root"])
            if spec:
                p = tc(["-n", name, "qdisc", "add", "dev", dev, "root", "netem"] + spec)
                if p.returncode != 0:
                    raise FaultNetError("tc netem %s on %s/%s failed: %s" % (
                        " ".join(spec), name, dev, p.stderr.strip()))

    def tbf(self, ns, rate):
        for name, dev in self._veth_ends(ns):
            tc(["-n", name, "qdisc", "del", "dev", dev, "root"])
            if rate:
                p = tc(["-n", name, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                        "burst", "16kb", "latency", "200ms"])
                if p.returncode != 0:
                    raise FaultNetError("tc tbf on %s/%s failed: %s" % (name, dev,
                                                                        p.stderr.strip()))

    def _rule(self, ns, target):
        """Inserts `-i/-o eth0 <target>` first in INPUT and OUTPUT of `ns`."""
        pre = self.net.net.exec_prefix(ns)
        for chain, dev in (("INPUT", "-i"), ("OUTPUT", "-o")):
            p = netns._run(pre + [self.iptables, "-I", chain, "1", dev, "eth0"] + target,
                           check=False)
            if p.returncode != 0:
                raise FaultNetError("%s -I %s in %s failed: %s" % (
                    self.iptables, chain, self.net.ns_name(ns), p.stderr.strip()))

    def flush(self, ns):
        """Removes every rule of the run's in `ns` (the chains hold nothing else)."""
        if not self.iptables:
            return
        pre = self.net.net.exec_prefix(ns)
        for chain in ("INPUT", "OUTPUT"):
            netns._run(pre + [self.iptables, "-F", chain], check=False)

    def drop(self, ns, probability=None):
        """Drops every packet on eth0 (None) or a random share of them."""
        match = [] if probability is None else [
            "-m", "statistic", "--mode", "random", "--probability", "%.3f" % probability]
        self._rule(ns, match + ["-j", "DROP"])

    def delay(self, ns, delay_ms, jitter_ms, hold_fraction, seed):
        """Starts netdelay in `ns`, then queues eth0's packets to it both ways."""
        queue = QUEUE_BASE + ns
        argv = ["/usr/bin/python3", "-m", "bytecomp_harness.netdelay", "--queue", str(queue),
                "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms),
                "--hold-fraction", str(hold_fraction), "--seed", str(seed)]
        p = Proc("netdelay %s" % self.net.ns_name(ns), self.net.net.exec_prefix(ns) + argv,
                 self.net.env(), self.echo)
        self.delayers[ns] = p
        self.net._wait_up(p, lambda: p.first(("READY",)) is not None,
                          "bind NFQUEUE %d" % queue, 10.0)
        # --queue-bypass: should the reader be gone, packets pass unqueued.
        self._rule(ns, ["-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass"])

    def undelay(self, ns):
        """Removes the rules, then ends the reader (which gives every held
        packet its verdict first); returns its STATS line or ''."""
        self.flush(ns)
        p = self.delayers.pop(ns, None)
        if p is None:
            return ""
        p.end(5.0)
        got = p.last("STATS ")
        return got[1][len("STATS "):] if got else ""

    def heal(self, ns):
        """Every fault of this module undone in `ns`."""
        ip(["-n", self.net.ns_name(ns), "link", "set", "eth0", "up"])
        self.undelay(ns)
        self.tbf(ns, None)
        if self.netem_ok:
            self.netem(ns, None)

    def stop(self):
        for ns in list(self.delayers):
            self.undelay(ns)
