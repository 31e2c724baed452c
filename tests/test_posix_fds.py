"""The POSIX backend holds no file descriptor per physical allocation.

It used to keep one memfd open per handle for the handle's whole life: under ``ulimit -n 1024`` slot
~1019 failed (reported as OutOfMemoryError), and unrelated ``jax.jit`` calls then failed with "Too many
open files". Physical memory is now a shared anonymous home mapping, and mapping it at a slot's address
duplicates that mapping (mremap with old_size 0): no descriptor at all.
"""

from __future__ import annotations

import textwrap

from conftest import run_in_subprocess

ENV = {"JAX_PLATFORMS": "cpu"}


def test_a_thousand_slots_under_a_256_fd_limit_subprocess():
    code = textwrap.dedent("""
        import os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        import jax, jax.numpy as jnp, numpy as np, jaxvmm
        fds = lambda: len(os.listdir("/proc/self/fd"))
        before = fds()
        page = os.sysconf("SC_PAGESIZE")
        slots = [jaxvmm.Slot(page, device="cpu") for _ in range(1000)]
        assert fds() <= before + 4, (before, fds())    # none per slot
        for i, s in enumerate(slots[:50]):             # the pages are real and distinct
            s.write(np.full(page, i % 251, np.uint8))
        for i, s in enumerate(slots[:50]):
            assert s.read(8)[0] == i % 251
        slots[0].release(); slots[0].remap()           # release / remap keep working
        slots[0].write(b"again"); assert bytes(slots[0].read(5)) == b"again"
        y = jax.jit(lambda x: jnp.tanh(x) * 2)(jnp.arange(16.0))   # jax can still open what it needs
        assert abs(float(y[1]) - np.tanh(1.0) * 2) < 1e-5
        for s in slots:
            s.close()
        d = jaxvmm.stats()["driver"]["cpu"]
        assert d == {"live_handles": 0, "live_reservations": 0, "live_mappings": 0}, d
        print("OK")
    """)
    r = run_in_subprocess(code, env=ENV, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


def test_released_pages_are_returned_and_remap_gives_fresh_pages_subprocess():
    # The semantics DESIGN.md promises for the POSIX table: a released range faults, a remapped one is
    # fresh (zero) memory at the same address, and memory goes back to the kernel on release.
    code = textwrap.dedent("""
        import jaxvmm, numpy as np
        def shmem():  # this process's resident shared-memory pages (the slot's pages are shared memory)
            for line in open("/proc/self/status"):
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024
        n = 64 << 20
        base = shmem()
        s = jaxvmm.Slot(n, device="cpu")
        assert shmem() - base >= n, (base, shmem())   # committed at create, like cuMemCreate
        s.write(np.full(n, 7, np.uint8))
        s.release()
        assert shmem() - base < n // 8, (base, shmem())   # the pages went back
        addr = s.address
        s.remap()
        assert s.address == addr and s.read(16).tolist() == [0] * 16
        s.close()
        print("OK")
    """)
    r = run_in_subprocess(code, env=ENV)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


def test_touching_a_released_slot_faults_subprocess():
    code = textwrap.dedent("""
        import ctypes, jaxvmm
        s = jaxvmm.Slot(4096, device="cpu")
        s.release()
        print("touching", flush=True)
        ctypes.c_char.from_address(s.address).value   # SIGSEGV, like an illegal address on the GPU
        print("not reached")
    """)
    r = run_in_subprocess(code, env=ENV)
    assert r.returncode == -11 and "touching" in r.stdout and "not reached" not in r.stdout, (r.returncode, r.stdout)
