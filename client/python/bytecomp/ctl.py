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
    rows = [(t["name"], t["dtype"], t["count"], _bytes(t["bytes"]), t["option"])
            for t in s["tensors"]]
    return head + table(("TENSOR", "DTYPE", "ELEMENTS", "SIZE", "OPTION"), rows)


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
