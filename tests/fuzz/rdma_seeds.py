#!/usr/bin/env python3
"""Seeds for tests/fuzz/rdma_fuzz.cc from recorded wire headers.

    tests/fuzz/rdma_seeds.py RECORD_DIR OUT_DIR

No RDMA device records traffic on the development machines, but the RDMA
backend sends the same wire header as the ZeroMQ one (transport/wire.h)
behind its 40-byte control header (transport/rdma/control.h). From each
header a ZeroMQ run recorded (RECORD_DIR/wire, BYTECOMP_RECORD_INPUTS) this
writes what an RDMA peer would send for it: an eager SEND (control header,
wire header, payload bytes) when the payloads are small, and an RTS
(control header with the length, wire header); plus a credit message, a
valid hello of each direction and an endpoint. Output goes to OUT_DIR/rdma,
ready for scripts/fuzz-record OUT_DIR.
"""
import hashlib
import os
import struct
import sys

MAGIC, VERSION = 0x44524342, 1
EAGER, RTS, CREDIT = 1, 2, 4


def ctl(op, credits=0, rdv_id=0, length=0):
    return struct.pack("<IBBHQQIIQ", MAGIC, VERSION, op, credits, rdv_id, 0, 0, 0, length)


def main(record_dir, out_dir):
    out = os.path.join(out_dir, "rdma")
    os.makedirs(out, exist_ok=True)
    seeds = [b"\x00" + ctl(CREDIT, credits=4),
             b"\x01" + struct.pack("<IB3xII", MAGIC, VERSION, 3, 64),
             b"\x02" + struct.pack("<IB3xII", MAGIC, VERSION, 3, 64),
             b"\x03" + b"rdma://10.213.0.1:9300"]
    wire_dir = os.path.join(record_dir, "wire")
    for name in sorted(os.listdir(wire_dir)) if os.path.isdir(wire_dir) else []:
        with open(os.path.join(wire_dir, name), "rb") as f:
            header = f.read()
        if len(header) < 64:
            continue
        (count,) = struct.unpack_from("<H", header, 6)
        if len(header) != 64 + 8 * count:
            continue
        sizes = [struct.unpack_from("<Q", header, 64 + 8 * i)[0] for i in range(count)]
        total = sum(sizes)
        if total <= 4096:
            seeds.append(b"\x00" + ctl(EAGER, credits=1) + header + bytes(range(256)) *
                         (total // 256) + bytes(range(total % 256)))
        if total:
            seeds.append(b"\x00" + ctl(RTS, rdv_id=7, length=total) + header)
    for s in seeds:
        with open(os.path.join(out, hashlib.sha1(s).hexdigest()[:16]), "wb") as f:
            f.write(s)
    print("rdma_seeds: %d seeds in %s" % (len(seeds), out))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
