"""Bandwidth through a slot shared between two processes, beside a plain peer copy, in the same run.

    python bench/share_bw.py                          # GPU 0 exports, GPU 1 imports (2 GPUs); cpu otherwise
    python bench/share_bw.py --sizes 64M,1G --iters 20 --markdown --out share_bw.md

An exporter process creates one ``shareable="posix_fd"`` slot on ``--exporter-device`` (pages in that
device's memory) and sends its handle over a Unix socket. This process imports it on ``--importer-device``
and times, on a stream of the importing device, for every size:

  imported read    cuMemcpyDtoDAsync  imported slot (exporter's pages) -> local slot
  imported write   cuMemcpyDtoDAsync  local slot -> imported slot
  peer read/write  the same copies with a slot this process created on the exporter's device and granted
                   to the importing device (a plain peer mapping in one process): the baseline
  jax device_put   jax.device_put of an exporter-device array to the importing device (jax's own peer copy)
  view (jit a+1)   a jitted ``a + 1`` on the importing device of ``imported.as_array(...)``: a kernel that
                   reads the exporter's pages in place (bytes read / time)

Each time is the median of ``--iters`` copies, each synchronized. The ratio column divides by the peer
copy of the same direction; the goal is >= 0.8 for the imported rows.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emit, human, parse_sizes, render  # noqa: E402


def exporter(path: str, device: str, nbytes: int) -> None:
    import numpy as np

    import jaxvmm

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    with conn, jaxvmm.Slot(nbytes, device=device, shareable="posix_fd") as s:
        s.write(np.full(min(nbytes, 1 << 20), 1, np.uint8))
        with s.export() as h:
            jaxvmm.send_handle(conn, h)
        conn.recv(4)  # "done": keep the slot until the importer has finished


def median_seconds(times: list[float]) -> float:
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=parse_sizes, default=None, help="default: 64M,256M,1G on GPU; 16M,64M on cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--exporter-device", default=None)
    p.add_argument("--importer-device", default=None)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--role", default="importer", help=argparse.SUPPRESS)
    p.add_argument("--socket", default=None, help=argparse.SUPPRESS)
    p.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "exporter":
        exporter(a.socket, a.exporter_device, a.nbytes)
        return

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxvmm
    from jaxvmm.testing import hooks

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if a.exporter_device is None:
        a.exporter_device = "cuda:0" if len(gpus) >= 2 else "cpu"
    if a.importer_device is None:
        a.importer_device = "cuda:1" if len(gpus) >= 2 else "cpu"
    on_gpu = a.importer_device.startswith(("cuda", "gpu"))
    sizes = a.sizes or ([64 << 20, 256 << 20, 1 << 30] if on_gpu else [16 << 20, 64 << 20])
    from jaxvmm._devices import target_of

    ti, te = target_of(a.importer_device), target_of(a.exporter_device)
    if ti.backend != te.backend:
        raise SystemExit("exporter and importer devices must be on one platform")
    biggest = max(sizes)

    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "share_bw.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(300)
    env = dict(os.environ)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "exporter", "--socket", path,
                              "--exporter-device", a.exporter_device, "--nbytes", str(biggest)], env=env)
    conn, _ = server.accept()
    rows = []
    try:
        with conn:
            handle = jaxvmm.recv_handle(conn)
            imported = jaxvmm.Slot.import_(handle, device=a.importer_device)
            local = jaxvmm.Slot(biggest, device=a.importer_device)
            peer = jaxvmm.Slot(biggest, device=a.exporter_device, access=a.importer_device)
            try:
                for n in sizes:
                    def copy(dst, src):
                        hooks.bench_slot_copy(ti.backend, ti.ordinal, dst.id, src.id, n, 2)  # warm
                        return median_seconds(hooks.bench_slot_copy(ti.backend, ti.ordinal, dst.id, src.id, n,
                                                                    a.iters))

                    t = {
                        ("imported", "read"): copy(local, imported),
                        ("imported", "write"): copy(imported, local),
                        ("peer", "read"): copy(local, peer),
                        ("peer", "write"): copy(peer, local),
                    }
                    if te.device != ti.device:
                        x0 = jax.device_put(jnp.ones((n // 4,), jnp.float32), te.device)
                        jax.device_put(x0, ti.device).block_until_ready()
                        ts = []
                        for _ in range(a.iters):
                            t0 = time.perf_counter()
                            jax.device_put(x0, ti.device).block_until_ready()
                            ts.append(time.perf_counter() - t0)
                        t[("jax device_put", "read")] = median_seconds(ts)
                        del x0
                    view = imported.as_array((n // 4,), jnp.float32)
                    f = jax.jit(lambda v: v + 1)
                    f(view).block_until_ready()
                    ts = []
                    for _ in range(a.iters):
                        t0 = time.perf_counter()
                        f(view).block_until_ready()
                        ts.append(time.perf_counter() - t0)
                    t[("view (jit a+1)", "read")] = median_seconds(ts)
                    del view
                    for (path_name, direction), sec in t.items():
                        base = t[("peer", direction)]
                        rows.append([human(n), path_name, direction, f"{n / sec / 1e9:.1f}",
                                     f"{base / sec:.2f}"])
            finally:
                for s in (imported, local, peer):
                    s.close()
                handle.close()
                conn.sendall(b"done")
    finally:
        child.wait(timeout=120)
        server.close()
    header = [f"share_bw: exporter {a.exporter_device} -> importer {a.importer_device}, "
              f"{a.iters} iters, median; jax {jax.__version__}",
              f"devices: {te.device.device_kind} / {ti.device.device_kind}"]
    print("\n".join(header))
    body = render(["size", "path", "dir", "GB/s", "x peer"], {3, 4}, rows, a.markdown)
    notes = ["imported: the exporter process's pages, mapped here with Slot.import_ (POSIX FD over SCM_RIGHTS)",
             "peer: a slot this process created on the exporter's device, granted to the importer's (baseline)",
             "x peer: time of the peer copy in the same direction / time of this row (goal >= 0.8 for imported)",
             "view (jit a+1): a kernel on the importer reading the exporter's pages in place and writing a local "
             "result; bytes read / time (informational: it also writes)"]
    emit(header, body, notes, a.markdown, a.out)


if __name__ == "__main__":
    main()
