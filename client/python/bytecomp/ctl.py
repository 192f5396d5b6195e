"""bytecompctl: asks a running bytecompd what it is doing, and steers it.

Talks to the daemon's control socket (the one libbytecomp uses) with
CTL_REQUEST messages (client/ipc/protocol.h); the daemon answers in JSON
(Prometheus text for `metrics`). Tables for people by default, `--json` for
scripts. Exit status: 0 ok, 1 the daemon refused or failed the request,
2 usage, 3 no daemon (or not reachable), 4 permission denied.

This module needs only the standard library (it runs where torch is absent).
"""
import argparse
import json
import os
import socket
import struct
import sys
import time

MAGIC = 0x504D4342  # "BCMP"
PROTOCOL_VERSION = 1
CTL_VERSION = 1
HEADER = struct.Struct("<IHHII")
T_ERROR, T_CTL_REQUEST, T_CTL_REPLY = 6, 10, 11
MAX_MESSAGE = 64 * 1024
MAX_ARG = 32 * 1024  # client/ipc/protocol.h kMaxCtlArgBytes
DEFAULT_SOCKET = "/run/bytecomp/bytecompd.sock"
ERROR_NAMES = ["ok", "invalid argument", "configuration error", "malformed input", "timeout",
               "peer lost", "aborted", "unavailable", "resource exhausted", "internal error"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_DAEMON, EXIT_DENIED = 0, 1, 2, 3, 4


class CtlError(Exception):
    def __init__(self, message, exit_code=EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code


def _str(b):
    return struct.pack("<H", len(b)) + b


def encode_request(command, arg=""):
    payload = struct.pack("<H", CTL_VERSION) + _str(command.encode()) + _str(arg.encode())
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, T_CTL_REQUEST, len(payload), 0) + payload


def decode(datagram):
    """(type, code, last, text) of one daemon message; CtlError if malformed."""
    if len(datagram) < HEADER.size:
        raise CtlError(f"malformed answer: {len(datagram)} bytes, shorter than the header")
    magic, version, mtype, n, zero = HEADER.unpack_from(datagram)
    if magic != MAGIC or zero != 0 or n != len(datagram) - HEADER.size:
        raise CtlError("malformed answer from the daemon (bad header)")
    if version != PROTOCOL_VERSION:
        raise CtlError(f"the daemon speaks protocol version {version}, this bytecompctl "
                       f"{PROTOCOL_VERSION}: use the bytecompctl of the daemon's release")
    p = datagram[HEADER.size:]
    if mtype == T_CTL_REPLY:
        if len(p) < 9:
            raise CtlError("malformed CTL_REPLY (truncated)")
        code, last, length = struct.unpack_from("<IBI", p)
        if length != len(p) - 9:
            raise CtlError("malformed CTL_REPLY (length)")
        return mtype, code, bool(last), p[9:].decode("utf-8", "replace")
    if mtype == T_ERROR:
        if len(p) < 6:
            raise CtlError("malformed ERROR (truncated)")
        code, length = struct.unpack_from("<IH", p)
        return mtype, code, True, p[6:6 + length].decode("utf-8", "replace")
    raise CtlError(f"unexpected message type {mtype} from the daemon")


def request(socket_path, command, arg="", timeout=10.0):
    """The daemon's answer text; CtlError naming what went wrong."""
    n = len(arg.encode())
    if n > MAX_ARG:
        raise CtlError(f"{command}: an arg of {n} bytes, more than the {MAX_ARG} a request "
                       "carries")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    try:
        try:
            s.connect(socket_path)
        except FileNotFoundError:
            raise CtlError(f"no bytecompd at {socket_path}: the socket does not exist (is the "
                           "daemon running? `systemctl status bytecompd`; another socket: "
                           "--socket or BYTECOMP_SOCKET)", EXIT_NO_DAEMON)
        except ConnectionRefusedError:
            raise CtlError(f"no bytecompd at {socket_path}: connection refused (a stale "
                           "socket: the daemon is not running)", EXIT_NO_DAEMON)
        except PermissionError:
            raise CtlError(f"permission denied connecting to {socket_path} (run as root or "
                           "as the daemon's user, or check control.socket_mode)", EXIT_DENIED)
        except socket.timeout:
            raise CtlError(f"bytecompd at {socket_path} did not accept within {timeout:g} s",
                           EXIT_NO_DAEMON)
        s.sendall(encode_request(command, arg))
        parts = []
        deadline = time.monotonic() + timeout
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                d = s.recv(MAX_MESSAGE + 1)
            except socket.timeout:
                raise CtlError(f"bytecompd at {socket_path} did not answer '{command}' within "
                               f"{timeout:g} s")
            if not d:
                raise CtlError("bytecompd closed the connection without an answer (an older "
                               "daemon without operator requests?)")
            mtype, code, last, text = decode(d)
            if mtype == T_ERROR:
                denied = "may not use this bytecompd" in text
                if "unknown message type" in text:
                    text += " (this bytecompd predates bytecompctl: upgrade it)"
                raise CtlError(f"bytecompd refused: {text}", EXIT_DENIED if denied else
                               EXIT_FAILED)
            parts.append(text)
            if code != 0:
                name = ERROR_NAMES[code] if code < len(ERROR_NAMES) else str(code)
                text = "".join(parts).strip()
                raise CtlError(f"{command}: {text}" if text.startswith("permission denied")
                               else f"{command} failed ({name}): {text}",
                               EXIT_DENIED if text.startswith("permission denied")
                               else EXIT_FAILED)
            if last:
                return "".join(parts)
    finally:
        s.close()


# ------------------------------------------------------------------ output

def _bytes(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0


def _duration(s):
    if s is None:
        return "-"
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d" if d else "") + (f"{h}h" if h or d else "") + f"{m}m{s:02d}s"


def table(headers, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else \
        [len(h) for h in headers]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines) + "\n"


def show_status(st):
    src = ", ".join(st["config_sources"]) or "built-in defaults"
    rows = [
        ("version", st["version"]),
        ("pid", st["pid"]),
        ("uptime", _duration(st["uptime_seconds"])),
        ("config", src),
        ("socket", st["socket"]),
        ("instance", st["instance"]),
        ("node id", st["node_id"] if st["multi_node"] else "- (single node)"),
        ("state", "draining (no new jobs)" if st["draining"] else "serving"),
        ("watchdog", f"every {st['watchdog_seconds']:g} s" if st["watchdog_seconds"] else "off"),
        ("metrics", st["metrics_file"] or "no textfile (metrics.textfile_dir)"),
        ("jobs", f"{st['jobs']['running']} running, {st['jobs']['forming']} forming"
         + (f": {', '.join(st['job_ids'])}" if st["job_ids"] else "")),
    ]
    w = max(len(k) for k, _ in rows)
    return "".join(f"{k.ljust(w)}  {v}\n" for k, v in rows)


def show_jobs(js):
    if not js["jobs"]:
        return "no jobs\n"
    rows = []
    for j in js["jobs"]:
        ranks = f"{j['connected']}/{j['local_size']}"
        nodes = f"{j['node_rank']}/{j['num_nodes']}"
        if j["nodes"]:
            nodes += " [" + ",".join(str(n) for n in j["nodes"]) + "]"
        strategy = j["strategy"]["mode"] + (f" ({j['strategy']['source']})"
                                            if j["strategy"]["source"] else "")
        c = j["compress"]
        rows.append((j["id"], j["uid"], j["state"], ranks, nodes, j["tensors"],
                     j["iteration"] if j["iteration"] >= 0 else "-", j["pushpulls"],
                     strategy,
                     f"{j['last_iteration_seconds'] * 1000:.1f} ms"
                     if j["last_iteration_seconds"] is not None else "-",
                     _bytes(c["input_bytes"]) if c else "-",
                     _bytes(c["output_bytes"]) if c else "-",
                     _duration(j["age_seconds"])))
    return table(("JOB", "UID", "STATE", "RANKS", "NODE", "TENSORS", "ITER", "PUSHPULLS",
                  "STRATEGY", "LAST ITER", "BYTES IN", "BYTES OUT", "AGE"), rows)


def show_strategy(s):
    head = (f"job {s['job']}: strategy {s['mode']}"
            + (f" from {s['source']}" if s["source"] else "")
            + (f", in force since iteration {s['switch_iteration']}"
               if s["switch_iteration"] >= 0 else "") + "\n")
    a = s.get("auto")
    if a:
        pred = ("%.1f ms" % (a["predicted_seconds"] * 1000)
                if a["predicted_seconds"] is not None else "-")
        meas = ("%.1f ms" % (a["measured_seconds"] * 1000)
                if a["measured_seconds"] is not None else "-")
        head += (f"auto: {a['state']} (epoch {a['epoch']}, {a['decisions']} decision(s), "
                 f"{a['replans']} re-plan(s)); predicted {pred} per iteration, latest "
                 f"measured {meas}; link {a['link_gbps']:.3g} Gbit/s, "
                 f"{a['link_latency_us']:.0f} us" + (f"; {a['message']}" if a["message"] else "")
                 + "\n")
        if a["run_dir"]:
            head += f"auto: decision in {a['run_dir']} (bytecomp-plan explain {a['run_dir']})\n"
    rows = [(t["name"], t["dtype"], t["count"], _bytes(t["bytes"]), t["option"])
            for t in s["tensors"]]
    return head + table(("TENSOR", "DTYPE", "ELEMENTS", "SIZE", "OPTION"), rows)


# ------------------------------------------------------------------- trace

# The planner's track names (planner/trace.cc) where a span uses the same
# resource, so a measured and a predicted trace line up; the rest are the
# runtime's own waits.
SPAN_TRACKS = {
    "wait_ranks": "wait for local ranks",
    "queue": "scheduler queue",
    "reduce": "intra-node link",
    "compress": "CPU compression pool",
    "send": "inter-node link",
    "wire": "inter-node link",
    "decompress": "CPU compression pool",
    "copy_out": "intra-node link",
}
TRACK_ORDER = ["iterations", "wait for local ranks", "scheduler queue", "intra-node link",
               "CPU compression pool", "inter-node link"]


class TraceCollector:
    """Merges the daemon's `trace` answers (each holds the records of the
    last few iterations) by (tensor, partition, iteration)."""

    def __init__(self):
        self.records = {}
        self.tensors = []
        self.spans = []
        self.job = None
        self.polls = 0

    def add(self, answer):
        self.polls += 1
        self.job = answer["job"]
        self.tensors = answer["tensors"]
        self.spans = answer["spans"]
        for t, p, it, ns in answer["records"]:
            self.records[(t, p, it)] = ns

    def slots(self):
        return {(t, p) for t, x in enumerate(self.tensors) for p in range(x["partitions"])}

    def complete_iterations(self):
        """Iterations with a record of every partition of every tensor the
        records name (a job may leave some tensors out of its iterations)."""
        named = {(t, p) for t, p, _ in self.records}
        tensors = {t for t, _ in named}
        want = {s for s in self.slots() if s[0] in tensors}
        by_it = {}
        for t, p, it in self.records:
            by_it.setdefault(it, set()).add((t, p))
        return sorted(it for it, got in by_it.items() if got == want)

    def missed(self):
        """Records lost between polls: gaps in a partition's iterations."""
        per = {}
        for t, p, it in self.records:
            per.setdefault((t, p), []).append(it)
        gaps = 0
        for its in per.values():
            its.sort()
            gaps += sum(b - a - 1 for a, b in zip(its, its[1:]))
        return gaps

    def keep_iterations(self, keep):
        self.records = {k: v for k, v in self.records.items() if k[2] in keep}


def _lanes(events):
    """Spreads events of one track over lanes so that none overlaps another
    in its lane (Chrome trace slices of one thread must nest); returns the
    lane of each event, in the given order."""
    order = sorted(range(len(events)), key=lambda i: (events[i][0], events[i][1]))
    ends = []
    lane = [0] * len(events)
    for i in order:
        start, end = events[i][0], events[i][1]
        for k, e in enumerate(ends):
            if e <= start:
                ends[k] = end
                lane[i] = k
                break
        else:
            ends.append(end)
            lane[i] = len(ends) - 1
    return lane


def chrome_trace(col, tracks="phase", node=None):
    """Chrome trace / Perfetto JSON (a dict) of the collected records: one
    track per resource (`phase`, the planner's names) or per tensor
    (`tensor`), overlapping slices spread over numbered lanes of the track,
    plus an `iterations` track (first submission to last copy-out)."""
    names = [t["name"] for t in col.tensors]
    spans = col.spans
    origin = min((ns[0] for ns in col.records.values() if ns[0]), default=0)
    raw = []  # (track, start_ns, end_ns, name, args)
    per_iteration = {}
    for (t, p, it), ns in sorted(col.records.items(), key=lambda kv: (kv[0][2], kv[1][0])):
        if ns[0] and ns[-1]:
            lo, hi = per_iteration.get(it, (ns[0], ns[-1]))
            per_iteration[it] = (min(lo, ns[0]), max(hi, ns[-1]))
        for i, span in enumerate(spans):
            a, b = ns[i], ns[i + 1]
            if not a or not b or b <= a:
                continue  # unstamped, or a phase this path does not have
            args = {"tensor": names[t], "partition": p, "iteration": it, "phase": span}
            if tracks == "tensor":
                raw.append((names[t], a, b, span, args))
            else:
                raw.append((SPAN_TRACKS.get(span, span), a, b, names[t], args))
    for it, (lo, hi) in per_iteration.items():
        raw.append(("iterations", lo, hi, f"iteration {it}", {"iteration": it}))
    by_track = {}
    for e in raw:
        by_track.setdefault(e[0], []).append(e)
    if tracks == "tensor":
        order = ["iterations"] + [n for n in names if n in by_track]
    else:
        order = [t for t in TRACK_ORDER if t in by_track] + \
            sorted(t for t in by_track if t not in TRACK_ORDER)
    meta, events = [], []
    pid = 1
    label = f"bytecompd job {col.job}" + (f" node {node}" if node is not None else "")
    meta.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                 "args": {"name": label}})
    tid = 0
    for track in order:
        evs = by_track.get(track, [])
        lanes = _lanes([(e[1], e[2]) for e in evs]) if evs else []
        base = tid
        for k in range(max(lanes, default=-1) + 1):
            meta.append({"ph": "M", "pid": pid, "tid": base + k, "name": "thread_name",
                         "args": {"name": track if k == 0 else f"{track} #{k + 1}"}})
            meta.append({"ph": "M", "pid": pid, "tid": base + k, "name": "thread_sort_index",
                         "args": {"sort_index": base + k}})
        for e, k in zip(evs, lanes):
            events.append({"ph": "X", "pid": pid, "tid": base + k, "name": e[3],
                           "cat": e[4].get("phase", "iteration"),
                           "ts": (e[1] - origin) / 1000.0, "dur": (e[2] - e[1]) / 1000.0,
                           "args": e[4]})
        tid = base + max(lanes, default=-1) + 1
    events.sort(key=lambda e: (e["ts"], e["tid"]))
    iterations = sorted({it for _, _, it in col.records})
    return {"displayTimeUnit": "ms", "traceEvents": meta + events,
            "otherData": {"job": col.job, "tracks": tracks, "clock": "monotonic",
                          "origin_ns": origin, "iterations": iterations,
                          "complete_iterations": col.complete_iterations(),
                          "missed_records": col.missed(), "polls": col.polls}}


def trace(sock, job, args, out=sys.stdout):
    """Polls the daemon for the job's phase records, then writes the trace."""
    col = TraceCollector()
    interval = args.interval

    def poll():
        col.add(json.loads(request(sock, "trace", job, args.timeout)))

    poll()
    if args.seconds is not None:
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            try:
                poll()
            except CtlError as e:
                if "no job" not in str(e):
                    raise
                sys.stderr.write(f"bytecompctl: job '{job}' ended during the trace\n")
                break
    elif args.iterations is not None:
        deadline = time.monotonic() + args.within
        while len(col.complete_iterations()) < args.iterations:
            if time.monotonic() > deadline:
                raise CtlError(f"trace: job '{job}' completed {len(col.complete_iterations())} "
                               f"of {args.iterations} iterations within {args.within:g} s "
                               "(is it stalled? `bytecompctl jobs`); nothing written")
            time.sleep(interval)
            try:
                poll()
            except CtlError as e:
                if "no job" in str(e):
                    raise CtlError(f"trace: job '{job}' ended after "
                                   f"{len(col.complete_iterations())} of {args.iterations} "
                                   "iterations; nothing written")
                raise
        col.keep_iterations(set(col.complete_iterations()[-args.iterations:]))
    if not col.records:
        raise CtlError(f"trace: job '{job}' has no finished partition round yet; nothing written")
    doc = chrome_trace(col, args.tracks)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.write("\n")
    os.replace(tmp, args.out)
    od = doc["otherData"]
    summary = {"file": args.out, "job": job, "iterations": od["iterations"],
               "events": sum(1 for e in doc["traceEvents"] if e["ph"] == "X"),
               "missed_records": od["missed_records"]}
    if args.json:
        out.write(json.dumps(summary) + "\n")
    else:
        its = od["iterations"]
        out.write(f"wrote {args.out}: job {job}, {summary['events']} slices, iterations "
                  f"{its[0]}..{its[-1]} (open in https://ui.perfetto.dev or chrome://tracing)\n")
    if od["missed_records"]:
        sys.stderr.write(f"bytecompctl: {od['missed_records']} partition round(s) finished and "
                         "were overwritten between two polls (lower --interval)\n")
    return EXIT_OK


def _samples(text):
    """{sample name with its labels, as written: value} of a Prometheus
    text."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def show_servers(answer):
    rows = []
    for s in answer["servers"]:
        role = "coordinator" if s["coordinator"] else "server"
        if s["metrics"] is None:
            rows.append((s["id"], s["address"], role, "unreachable", "-", "-", "-", "-", "-"))
            continue
        m = _samples(s["metrics"])
        rounds = m.get("bytecomp_server_rounds_total", 0)
        total = m.get("bytecomp_server_round_seconds_sum", 0)
        refused = sum(v for k, v in m.items() if k.startswith("bytecomp_server_refused_total"))
        rows.append((s["id"], s["address"], role, "up", int(m.get("bytecomp_server_jobs", 0)),
                     int(rounds), f"{total / rounds * 1000:.2f} ms" if rounds else "-",
                     int(m.get("bytecomp_server_pushes_total", 0)), int(refused)))
    out = table(("ID", "ADDRESS", "ROLE", "STATE", "JOBS", "ROUNDS", "MEAN ROUND", "PUSHES",
                 "REFUSED"), rows)
    for s in answer["servers"]:
        if s["error"]:
            out += f"server {s['id']}: {s['error']}\n"
    return out


def pick_job(sock, timeout):
    ids = json.loads(request(sock, "status", "", timeout))["job_ids"]
    if len(ids) == 1:
        return ids[0]
    raise CtlError("trace: " + ("no job on this bytecompd" if not ids else
                                f"{len(ids)} jobs ({', '.join(ids)}): choose one with --job"))


# --------------------------------------------------------------------- cli

def parser():
    p = argparse.ArgumentParser(
        prog="bytecompctl",
        description="Query and steer a running bytecompd (docs/operations.md).",
        epilog="exit status: 0 ok, 1 request failed, 2 usage, 3 no daemon, 4 permission denied")
    p.add_argument("--socket", default=None,
                   help="the daemon's control socket (default: $BYTECOMP_SOCKET, else "
                        f"{DEFAULT_SOCKET})")
    p.add_argument("--json", action="store_true", help="print the daemon's JSON answer")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (default 10)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("status", help="version, uptime, configuration files, jobs")
    sub.add_parser("jobs", help="per job: ranks, nodes, iteration, strategy, bytes")
    s = sub.add_parser("strategy", help="the strategy in force for each tensor of a job")
    s.add_argument("job")
    t = sub.add_parser("trace", help="a Chrome trace / Perfetto timeline of a running job")
    t.add_argument("--job", default=None, help="the job (default: the only one)")
    g = t.add_mutually_exclusive_group()
    g.add_argument("--seconds", type=float, default=None, metavar="S",
                   help="collect every partition round finished during S seconds")
    g.add_argument("--iterations", type=int, default=None, metavar="N",
                   help="the latest N whole iterations (waits up to --within for them)")
    t.add_argument("--within", type=float, default=60.0, metavar="S",
                   help="with --iterations: give up after S seconds (default 60)")
    t.add_argument("--interval", type=float, default=0.02, metavar="S",
                   help="seconds between two requests (default 0.02); the daemon holds the "
                        "last 8 iterations")
    t.add_argument("--tracks", choices=("phase", "tensor"), default="phase",
                   help="one track per resource (the planner's names) or per tensor")
    t.add_argument("-o", "--out", required=True, metavar="FILE", help="the JSON file to write")
    sv = sub.add_parser("servers", help="the parameter servers, asked through the daemon")
    sv.add_argument("--metrics", action="store_true",
                    help="print each server's Prometheus text")
    sub.add_parser("metrics", help="Prometheus metrics (also rewrites the textfile)")
    sub.add_parser("reload", help="re-read the configuration (like SIGHUP)")
    d = sub.add_parser("drain", help="refuse new jobs (running ones go on)")
    d.add_argument("--off", action="store_true", help="accept new jobs again")
    d.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="then wait up to SECONDS until no job is left (exit 1 if some are)")
    return p


def run(argv=None, out=sys.stdout):
    args = parser().parse_args(argv)
    sock = args.socket or os.environ.get("BYTECOMP_SOCKET") or DEFAULT_SOCKET
    cmd = args.command
    if cmd == "trace":
        if args.iterations is not None and args.iterations < 1:
            raise CtlError("trace: --iterations must be at least 1", EXIT_USAGE)
        if args.seconds is not None and args.seconds < 0:
            raise CtlError("trace: --seconds must not be negative", EXIT_USAGE)
        return trace(sock, args.job or pick_job(sock, args.timeout), args, out)
    if cmd == "strategy":
        text = request(sock, "strategy", args.job, args.timeout)
    elif cmd == "drain":
        text = request(sock, "drain", "off" if args.off else "on", args.timeout)
    else:
        text = request(sock, cmd, "", args.timeout)
    if cmd == "metrics" or cmd == "reload":
        out.write(json.dumps({"result": text.strip()}) + "\n" if args.json and cmd == "reload"
                  else text)
        return EXIT_OK
    answer = json.loads(text)
    if cmd == "drain" and args.wait is not None and not args.off:
        deadline = time.monotonic() + args.wait
        while answer["jobs"]["running"] + answer["jobs"]["forming"] > 0:
            if time.monotonic() > deadline:
                out.write(json.dumps(answer) + "\n" if args.json else show_status(answer))
                sys.stderr.write(f"bytecompctl: {len(answer['job_ids'])} job(s) still on the "
                                 f"daemon after {args.wait:g} s: {', '.join(answer['job_ids'])}\n")
                return EXIT_FAILED
            time.sleep(0.2)
            answer = json.loads(request(sock, "status", "", args.timeout))
    if cmd == "servers":
        if args.json:
            out.write(json.dumps(answer, indent=1) + "\n")
        elif args.metrics:
            for s in answer["servers"]:
                out.write(f"# server {s['id']} {s['address']}\n" +
                          (s["metrics"] if s["metrics"] is not None
                           else f"# unreachable: {s['error']}\n"))
        else:
            out.write(show_servers(answer))
        down = [s for s in answer["servers"] if s["metrics"] is None]
        return EXIT_FAILED if down else EXIT_OK
    if args.json:
        out.write(json.dumps(answer, indent=1) + "\n")
    elif cmd in ("status", "drain"):
        out.write(show_status(answer))
    elif cmd == "jobs":
        out.write(show_jobs(answer))
    elif cmd == "strategy":
        out.write(show_strategy(answer))
    return EXIT_OK


def main(argv=None):
    try:
        return run(argv)
    except CtlError as e:
        sys.stderr.write(f"bytecompctl: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
