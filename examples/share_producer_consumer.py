"""Producer/consumer: one process writes a slot, another reads the same pages as a jax.Array (no copy).

    python share_producer_consumer.py            # runs both: the producer starts the consumer
    python share_producer_consumer.py --device cuda:0 --consumer-device cuda:1   # on a 2-GPU node

The producer creates an exportable slot, writes into it and sends a handle over a Unix socket
(SCM_RIGHTS carries the file descriptors). The consumer imports the handle (the same physical pages at
a fixed address of its own), views them as a jax.Array, and answers with what it computed.
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile

import numpy as np


def producer(device: str, consumer_device: str) -> None:
    import jaxvmm

    n = 1 << 20  # float32 elements
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "jaxvmm.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        consumer = subprocess.Popen([sys.executable, __file__, "--consumer", path, "--device", consumer_device])
        with jaxvmm.Slot(n * 4, device=device, shareable="posix_fd") as slot:
            slot.write(np.arange(n, dtype=np.float32))
            conn, _ = server.accept()
            with conn, slot.export() as handle:  # the handle's descriptors close after sending
                jaxvmm.send_handle(conn, handle)
                answer = conn.recv(64).decode()
            expected = float(np.arange(n, dtype=np.float64).sum())
            print(f"producer: consumer summed {answer} (expected {expected:.0f})")
            assert abs(float(answer) - expected) / expected < 1e-5  # a float32 sum
        assert consumer.wait(timeout=120) == 0
        server.close()
    print("producer: done, share stats", jaxvmm.stats()["share"])


def consumer(path: str, device: str) -> None:
    import jax.numpy as jnp

    import jaxvmm

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    with conn:
        with jaxvmm.recv_handle(conn) as handle, jaxvmm.Slot.import_(handle, device=device) as slot:
            x = slot.as_array((slot.nbytes // 4,), jnp.float32)  # aliases the producer's pages
            total = float(jnp.sum(x))
            print(f"consumer: {x.shape} {x.dtype} on {x.devices()}, sum {total:.0f}")
            del x  # the slot cannot close while a view lives
            conn.sendall(f"{total:.1f}".encode())


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--consumer", metavar="SOCKET")
    p.add_argument("--device", default="cpu")
    p.add_argument("--consumer-device", default=None)
    a = p.parse_args()
    if a.consumer:
        consumer(a.consumer, a.device)
    else:
        producer(a.device, a.consumer_device or a.device)
