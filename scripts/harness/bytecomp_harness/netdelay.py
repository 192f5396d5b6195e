"""Delays and reorders a namespace's packets without sch_netem (scripts/chaos).

    ip netns exec NS python3 -m bytecomp_harness.netdelay --queue Q
        [--delay-ms D] [--jitter-ms J] [--hold-fraction F] [--seed S]

This kernel has no sch_netem (nor sch_fq or sch_etf, which could release
packets at a time set by a BPF program), but it has iptables' NFQUEUE
target and nfnetlink_queue: a rule `-j NFQUEUE --queue-num Q` hands each
matching packet to the process bound to queue Q, and the packet goes on
only when that process answers with a verdict. This is that process, on a
plain netlink socket (no libnetfilter_queue or python netfilterqueue): it
holds each packet for D + uniform(-J, J) ms (a fraction F of the packets
only; the others get their verdict at once) and gives the verdicts in
order of their due time, not of arrival. A packet due earlier than one
that came before it overtakes it: reordering of real IP packets, TCP
segments of one connection included, which the receiving kernel must put
back in order (out-of-order queue, duplicate ACKs, fast retransmit).

Prints `READY <queue>` once bound, then on SIGTERM/SIGINT gives every held
packet its verdict at once and prints one line
`STATS packets=N held=H overtaken=O max_delay_ms=M` (overtaken: packets
whose verdict came before that of a packet that arrived earlier) and
exits 0. Rules that send packets here should carry `--queue-bypass`, so
that packets pass unqueued once this process is gone.
"""

import argparse
import heapq
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2
NLMSG_DONE = 3
SO_RCVBUFFORCE = 33


class NfqError(Exception):
    """The kernel refused a queue configuration (the message says which)."""


def _attr(kind, payload):
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * ((4 - length % 4) % 4)


def _attrs(data):
    out = {}
    off = 0
    while off + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4:
            break
        out[kind & 0x3FFF] = data[off + 4:off + length]
        off += (length + 3) & ~3
    return out


class Queue:
    def __init__(self, num):
        self.num = num
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((0, 0))

    def _send(self, msg_type, attrs, flags=NLM_F_REQUEST):
        self.seq += 1
        body = struct.pack("!BBH", socket.AF_UNSPEC, 0, self.num) + b"".join(attrs)
        hdr = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags,
                          self.seq, 0)
        self.sock.send(hdr + body)

    def _config(self, what, attrs):
        """Sends a config message with an ACK request; raises on an error reply."""
        self._send(NFQNL_MSG_CONFIG, attrs, NLM_F_REQUEST | NLM_F_ACK)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.sock], [], [], 0.5)
            if not r:
                continue
            data = self.sock.recv(65536)
            off = 0
            while off + 16 <= len(data):
                length, kind, _flags, seq, _pid = struct.unpack_from("=IHHII", data, off)
                if kind == NLMSG_ERROR and seq == self.seq:
                    err = -struct.unpack_from("=i", data, off + 16)[0]
                    if err:
                        raise NfqError("nfnetlink_queue %s of queue %d: %s" % (
                            what, self.num, os.strerror(err)))
                    return
                off += (length + 3) & ~3
        raise NfqError("nfnetlink_queue %s of queue %d: no answer within 5 s" % (what, self.num))

    def bind(self, maxlen=4096):
        self._config("bind", [_attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0))])
        # Metadata only (the id is all a verdict needs); GSO packets whole.
        self._config("copy mode", [_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))])
        self._config("queue length", [_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen))])
        self._config("flags", [_attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)),
                               _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_GSO))])

    def packets(self):
        """Packet ids of the queued packets in one recv (arrival order)."""
        try:
            data = self.sock.recv(1 << 20)
        except OSError:   # ENOBUFS: the kernel dropped notifications (and their packets)
            return []
        ids = []
        off = 0
        while off + 16 <= len(data):
            length, kind, _flags, _seq, _pid = struct.unpack_from("=IHHII", data, off)
            if length < 16:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                hdr = _attrs(data[off + 20:off + length]).get(NFQA_PACKET_HDR)
                if hdr and len(hdr) >= 4:
                    ids.append(struct.unpack_from("!I", hdr)[0])
            off += (length + 3) & ~3
        return ids

    def accept(self, packet_id):
        self._send(NFQNL_MSG_VERDICT, [_attr(NFQA_VERDICT_HDR,
                                             struct.pack("!II", NF_ACCEPT, packet_id))])


def run(a):
    rng = random.Random(a.seed)
    q = Queue(a.queue)
    q.bind()
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    sys.stdout.write("READY %d\n" % a.queue)
    sys.stdout.flush()
    held = []              # heap of (due, packet id, arrival time)
    packets = n_held = overtaken = 0
    max_delay = 0.0
    pending = set()        # ids held (to count overtakes)

    def release(pid, arrived):
        nonlocal overtaken, max_delay
        if pending and min(pending) < pid:
            overtaken += 1
        q.accept(pid)
        max_delay = max(max_delay, time.monotonic() - arrived)

    while not stop:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _due, pid, arrived = heapq.heappop(held)
            pending.discard(pid)
            release(pid, arrived)
        wait = max(0.0, held[0][0] - now) if held else 0.5
        try:
            r, _, _ = select.select([q.sock], [], [], wait)
        except InterruptedError:
            continue
        if not r:
            continue
        now = time.monotonic()
        for pid in q.packets():
            packets += 1
            if rng.random() < a.hold_fraction:
                d = max(0.0, (a.delay_ms + rng.uniform(-a.jitter_ms, a.jitter_ms)) / 1000.0)
                heapq.heappush(held, (now + d, pid, now))
                pending.add(pid)
                n_held += 1
            else:
                release(pid, now)
    while held:
        _due, pid, arrived = heapq.heappop(held)
        pending.discard(pid)
        release(pid, arrived)
    sys.stdout.write("STATS packets=%d held=%d overtaken=%d max_delay_ms=%.1f\n" % (
        packets, n_held, overtaken, max_delay * 1000.0))
    sys.stdout.flush()
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="netdelay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--jitter-ms", type=float, default=0.0)
    ap.add_argument("--hold-fraction", type=float, default=1.0,
                    help="share of the packets held (the others pass at once)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        return run(a)
    except (OSError, NfqError) as e:
        sys.stdout.write("ERROR %s\n" % e)
        sys.stdout.flush()
        return 2


if __name__ == "__main__":
    sys.exit(main())
