"""Slot lifecycle, address stability, accounting, provenance and input validation.

Tests taking ``platform_device`` run on the POSIX backend ("cpu") and on the real CUDA driver
("cuda:0", gpu-marked, skipped without a GPU).
"""

from __future__ import annotations

import gc
import mmap
import os
import signal
import textwrap
import threading

import numpy as np
import pytest

import jaxvmm
import jaxvmm.testing
from jaxvmm._devices import target_of
from jaxvmm._native import lib

from conftest import LIVE_KEYS, live_counters, run_in_subprocess


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def granularity(device) -> int:
    t = target_of(device)
    return int(lib.granularity(t.backend, t.ordinal, "device", t.ordinal))


def device_key(device) -> str:
    """The key of ``device`` in ``jaxvmm.stats()['devices']``."""
    return target_of(device).name


def round_up(n: int, g: int) -> int:
    return -(-n // g) * g


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------------------------------------------
# lifecycle and address stability
# ---------------------------------------------------------------------------------------------------
def test_address_and_generation_stable_across_remaps(platform_device, no_leaks):
    nbytes = 10_000
    s = jaxvmm.Slot(nbytes, device=platform_device)
    try:
        addr, sid, size = s.address, s.id, s.size
        assert addr != 0 and addr % granularity(platform_device) == 0
        assert s.generation == 1 and s.state == "mapped" and s.mapped
        assert s.backend == target_of(platform_device).backend
        for i in range(50):
            s.release()
            assert s.address == addr and s.info()["address"] == addr
            assert s.state == "released" and not s.mapped
            assert s.generation == i + 1  # release does not bump the generation
            s.remap()
            assert s.state == "mapped" and s.mapped
            assert s.generation == i + 2, "generation must grow by exactly 1 per remap"
            assert s.address == addr and s.info()["address"] == addr
            assert s.id == sid and s.size == size
            assert lib.find_range(addr, size) == sid
            data = pattern(nbytes, i)
            s.write(data)
            assert s.read().tobytes() == data
    finally:
        s.close()


def test_data_written_survives_reads(platform_device, no_leaks):
    nbytes = 3 * 4096 + 17
    with jaxvmm.Slot(nbytes, device=platform_device) as s:
        data = pattern(nbytes, 1)
        s.write(data)
        for _ in range(3):  # reads do not disturb the contents
            assert s.read().tobytes() == data
        assert s.read(10, offset=5).tobytes() == data[5:15]
        assert s.read(offset=nbytes - 3).tobytes() == data[-3:]
        assert s.read(0).size == 0
        # partial overwrite leaves the rest intact
        s.write(b"\xff" * 8, offset=100)
        expect = data[:100] + b"\xff" * 8 + data[108:]
        assert s.read().tobytes() == expect
        # arrays are written as raw bytes
        arr = np.arange(16, dtype=np.float32)
        s.write(arr, offset=4)
        assert np.array_equal(s.read(arr.nbytes, offset=4).view(np.float32), arr)
        assert s.read(4).tobytes() == expect[:4]


def test_released_slot_read_write_raise(platform_device, no_leaks):
    with jaxvmm.Slot(4096, device=platform_device) as s:
        s.write(b"hello")
        s.release()
        for op, stage in ((lambda: s.read(), "read"), (lambda: s.write(b"x"), "write")):
            with pytest.raises(jaxvmm.SlotStateError) as ei:
                op()
            msg = str(ei.value)
            assert msg.startswith("jaxvmm:") and f"slot {s.id}" in msg and "released" in msg, msg
            assert ei.value.slot == s.id and ei.value.stage == stage
        with pytest.raises(jaxvmm.SlotStateError, match="cannot release a released slot"):
            s.release()
        s.remap()
        with pytest.raises(jaxvmm.SlotStateError, match="cannot remap a mapped slot"):
            s.remap()
        s.write(b"world")
        assert s.read(5).tobytes() == b"world"
        assert s.generation == 2


def test_closed_slot_raises(platform_device, no_leaks):
    s = jaxvmm.Slot(4096, device=platform_device)
    sid = s.id
    s.close()
    assert s.closed and s.state == "closed" and not s.mapped
    ops = {
        "read": lambda: s.read(),
        "write": lambda: s.write(b"x"),
        "release": s.release,
        "remap": s.remap,
        "info": s.info,
        "address": lambda: s.address,
        "id": lambda: s.id,
        "generation": lambda: s.generation,
    }
    for name, op in ops.items():
        with pytest.raises(jaxvmm.SlotStateError, match="jaxvmm:"):
            op()
    # the native record is gone too
    for op in ("info", "release", "remap", "close"):
        with pytest.raises(jaxvmm.NotFoundError, match=f"jaxvmm: slot {sid}:"):
            getattr(lib.slot(sid), op)()


def test_double_close_raises(platform_device, no_leaks):
    s = jaxvmm.Slot(4096, device=platform_device)
    s.close()
    closed = jaxvmm.stats()["closed"]
    with pytest.raises(jaxvmm.SlotStateError, match="already closed"):
        s.close()
    assert jaxvmm.stats()["closed"] == closed


def test_context_manager_closes(platform_device, no_leaks):
    base = jaxvmm.stats()["slots"]
    with jaxvmm.Slot(4096, device=platform_device) as s:
        addr, size, sid = s.address, s.size, s.id
        assert jaxvmm.stats()["slots"] == base + 1
    assert s.closed
    assert jaxvmm.stats()["slots"] == base
    with pytest.raises(jaxvmm.NotFoundError):
        lib.find_range(addr, size)
    with pytest.raises(jaxvmm.NotFoundError):
        lib.slot(sid).info()
    # an exception inside the block still closes the slot and propagates
    with pytest.raises(KeyError, match="boom"):
        with jaxvmm.Slot(4096, device=platform_device) as s2:
            raise KeyError("boom")
    assert s2.closed
    assert jaxvmm.stats()["slots"] == base


def test_del_closes(platform_device, no_leaks):
    base = jaxvmm.stats()
    s = jaxvmm.Slot(4096, device=platform_device)
    sid, size = s.id, s.size
    assert jaxvmm.stats()["slots"] == base["slots"] + 1
    del s
    gc.collect()
    with pytest.raises(jaxvmm.NotFoundError):
        lib.slot(sid).info()
    after = jaxvmm.stats()
    assert after["slots"] == base["slots"]
    assert after["closed"] == base["closed"] + 1
    assert after["reserved_bytes"] == base["reserved_bytes"]
    assert after["mapped_bytes"] == base["mapped_bytes"]
    assert size > 0


def test_size_rounded_up_to_granularity(platform_device, no_leaks):
    g = granularity(platform_device)
    assert g > 0 and g & (g - 1) == 0
    if platform_device == "cpu":
        assert g == mmap.PAGESIZE
    for n in (1, g - 1, g, g + 1, 2 * g + 3):
        with jaxvmm.Slot(n, device=platform_device) as s:
            assert s.nbytes == n
            assert s.size == round_up(n, g), (n, s.size)
            assert s.info()["size"] == s.size and s.info()["nbytes"] == n
            assert s.info()["mapped_bytes"] == s.size


def test_stats_move_exactly(platform_device, no_leaks):
    key = device_key(platform_device)
    g = granularity(platform_device)

    def snap():
        st = jaxvmm.stats()
        empty = {"slots": 0, "reserved_bytes": 0, "mapped_bytes": 0, "peak_mapped_bytes": 0}
        dev = st["devices"].get(key, empty)
        return st, dev

    s0, d0 = snap()
    a = jaxvmm.Slot(g + 1, device=platform_device)
    size_a = a.size
    assert size_a == 2 * g
    s1, d1 = snap()
    assert s1["slots"] == s0["slots"] + 1 and d1["slots"] == d0["slots"] + 1
    assert s1["reserved_bytes"] == s0["reserved_bytes"] + size_a
    assert d1["reserved_bytes"] == d0["reserved_bytes"] + size_a
    assert s1["mapped_bytes"] == s0["mapped_bytes"] + size_a
    assert d1["mapped_bytes"] == d0["mapped_bytes"] + size_a
    assert s1["created"] == s0["created"] + 1
    assert s1["peak_mapped_bytes"] >= s1["mapped_bytes"] and d1["peak_mapped_bytes"] >= d1["mapped_bytes"]

    b = jaxvmm.Slot(1, device=platform_device)
    size_b = b.size
    s2, d2 = snap()
    assert s2["slots"] == s0["slots"] + 2 and d2["slots"] == d0["slots"] + 2
    assert s2["reserved_bytes"] == s0["reserved_bytes"] + size_a + size_b
    assert d2["mapped_bytes"] == d0["mapped_bytes"] + size_a + size_b

    a.release()
    s3, d3 = snap()
    assert s3["slots"] == s2["slots"] and s3["releases"] == s2["releases"] + 1
    assert s3["reserved_bytes"] == s2["reserved_bytes"], "release must keep the reservation"
    assert s3["mapped_bytes"] == s2["mapped_bytes"] - size_a
    assert d3["mapped_bytes"] == d2["mapped_bytes"] - size_a
    assert a.info()["mapped_bytes"] == 0

    a.remap()
    s4, d4 = snap()
    assert s4["remaps"] == s3["remaps"] + 1
    assert s4["mapped_bytes"] == s2["mapped_bytes"] and d4["mapped_bytes"] == d2["mapped_bytes"]
    assert s4["reserved_bytes"] == s2["reserved_bytes"]

    a.release()  # closing a released slot returns only the reservation
    a.close()
    s5, d5 = snap()
    assert s5["slots"] == s0["slots"] + 1 and d5["slots"] == d0["slots"] + 1
    assert s5["closed"] == s0["closed"] + 1
    assert s5["reserved_bytes"] == s0["reserved_bytes"] + size_b
    assert s5["mapped_bytes"] == s0["mapped_bytes"] + size_b
    assert d5["mapped_bytes"] == d0["mapped_bytes"] + size_b

    b.close()
    s6, d6 = snap()
    for k in ("slots", "reserved_bytes", "mapped_bytes"):
        assert s6[k] == s0[k], k
        assert d6[k] == d0[k], k
    assert s6["closed"] == s0["closed"] + 2 and s6["created"] == s0["created"] + 2
    assert s6["quarantined"] == 0 and s6["quarantine"] == []
    assert s6["peak_mapped_bytes"] >= s0["mapped_bytes"] + size_a + size_b


def test_stats_driver_counters_track_live_objects(platform_device, no_leaks):
    base = live_counters(platform_device)
    with jaxvmm.Slot(4096, device=platform_device) as s:
        assert live_counters(platform_device) == {k: base[k] + 1 for k in LIVE_KEYS}
        s.release()
        assert live_counters(platform_device) == {
            "live_handles": base["live_handles"],
            "live_reservations": base["live_reservations"] + 1,
            "live_mappings": base["live_mappings"],
        }
        s.remap()
        assert live_counters(platform_device) == {k: base[k] + 1 for k in LIVE_KEYS}
        platform = "cuda" if s.backend == "cuda" else "cpu"
        assert jaxvmm.stats()["driver"][platform] == live_counters(platform_device)
    assert live_counters(platform_device) == base


def test_driver_memory_info(platform_device):
    free, total = jaxvmm.driver_memory_info(platform_device)
    assert isinstance(free, int) and isinstance(total, int)
    assert 0 < free <= total
    if platform_device == "cpu":
        with open("/proc/meminfo") as f:
            meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        assert total == meminfo["MemTotal"]


# ---------------------------------------------------------------------------------------------------
# exact range provenance
# ---------------------------------------------------------------------------------------------------
def test_find_range_exact_provenance(platform_device, no_leaks):
    g = granularity(platform_device)
    with jaxvmm.Slot(g + 100, device=platform_device) as a, jaxvmm.Slot(100, device=platform_device) as b:
        for s in (a, b):
            assert lib.find_range(s.address, s.size) == s.id
            assert lib.find_range(s.address, 0) == s.id
        assert a.id != b.id and a.address != b.address
        s = a
        assert s.nbytes != s.size
        s.release()  # provenance holds while released: the range is still the slot's
        assert lib.find_range(s.address, s.size) == s.id
        s.remap()
        bad = [
            (s.address + g, s.size - g),  # inside the slot, not its start
            (s.address + g, 0),
            (s.address + g, s.size),
            (s.address, s.size + g),  # wrong lengths
            (s.address, s.size - g),
            (s.address, s.nbytes),
            (s.address, 1),
            (s.address + 1, s.size),
            (0x1000, 0),  # unknown addresses
            (0x1000, s.size),
            (2**63, 0),
        ]
        for address, length in bad:
            with pytest.raises(jaxvmm.NotFoundError, match="jaxvmm:") as ei:
                lib.find_range(address, length)
            assert isinstance(ei.value, LookupError), (address, length)


def test_find_range_forgets_closed_slots(platform_device, no_leaks):
    s = jaxvmm.Slot(4096, device=platform_device)
    address, size = s.address, s.size
    assert lib.find_range(address, size) == s.id
    s.close()
    for length in (size, 0):
        with pytest.raises(jaxvmm.NotFoundError, match="no slot starts at"):
            lib.find_range(address, length)


# ---------------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "nbytes, exc",
    [
        (0, ValueError),
        (-1, ValueError),
        (-4096, ValueError),
        (2**60, ValueError),
        (2**48 + 1, ValueError),
        (True, TypeError),
        (False, TypeError),
        (1.0, TypeError),
        (4096.5, TypeError),
        ("4096", TypeError),
        (None, TypeError),
    ],
    ids=repr,
)
def test_bad_nbytes(nbytes, exc, no_leaks):
    calls = jaxvmm.testing.driver_counters("cpu")["calls"]
    with pytest.raises(exc, match="jaxvmm:"):
        jaxvmm.Slot(nbytes, device="cpu")
    # rejected before any driver call
    reserves = jaxvmm.testing.driver_counters("cpu")["calls"]["cuMemAddressReserve"]
    assert reserves == calls["cuMemAddressReserve"]


def test_native_rejects_zero_nbytes(no_leaks):
    """The core checks again what Python validated."""
    with pytest.raises(jaxvmm.InvalidArgumentError, match="nbytes must be > 0"):
        lib.create_slot("posix", 0, "device", 0, [0], 0)
    with pytest.raises(jaxvmm.InvalidArgumentError, match="2\\*\\*48"):
        lib.create_slot("posix", 0, "device", 0, [0], 2**60)


@pytest.mark.parametrize(
    "device, exc",
    [(99, ValueError), (-1, ValueError), ("cpu:99", ValueError), ("tpu", ValueError), ("cpu:x", ValueError),
     (object(), TypeError), (1.5, TypeError)],
    ids=repr,
)
def test_bad_device(device, exc, no_leaks):
    with pytest.raises(exc):
        jaxvmm.Slot(4096, device=device)


@pytest.mark.parametrize(
    "location, exc",
    [("vram", ValueError), ("host_numa:x", ValueError), ("device:1", ValueError), ("", ValueError),
     ("host_numa:-1", ValueError), ("HOST_NUMA", ValueError), (5, TypeError), (None, TypeError)],
    ids=repr,
)
def test_bad_location(location, exc, no_leaks):
    with pytest.raises(exc, match="jaxvmm:"):
        jaxvmm.Slot(4096, device="cpu", location=location)


@pytest.mark.parametrize("location", ["host_numa", "host_numa:0"])
def test_host_numa_location_on_cpu(location, no_leaks):
    with jaxvmm.Slot(5000, device="cpu", location=location) as s:
        assert s.location == "host_numa:0"
        info = s.info()
        assert info["location"] == "host_numa" and info["location_id"] == 0
        data = pattern(5000, 7)
        s.write(data)
        assert s.read().tobytes() == data
        addr = s.address
        s.release()
        s.remap()
        assert s.address == addr and s.generation == 2


def test_huge_request_is_out_of_memory(platform_device, no_leaks):
    before = jaxvmm.stats()
    with pytest.raises(jaxvmm.OutOfMemoryError) as ei:
        jaxvmm.Slot(2**46, device=platform_device)
    err = ei.value
    msg = str(err)
    assert isinstance(err, MemoryError) and isinstance(err, jaxvmm.DriverError)
    assert msg.startswith("jaxvmm:") and "CUDA_ERROR_OUT_OF_MEMORY" in msg, msg
    assert err.driver_error == "CUDA_ERROR_OUT_OF_MEMORY"
    assert err.stage == "create" and isinstance(err.slot, int) and f"slot {err.slot}: create:" in msg
    with pytest.raises(jaxvmm.NotFoundError):
        lib.slot(err.slot).info()
    after = jaxvmm.stats()
    for k in ("slots", "reserved_bytes", "mapped_bytes", "created", "quarantined"):
        assert after[k] == before[k], k
    # and the device still works
    with jaxvmm.Slot(4096, device=platform_device) as s:
        s.write(b"ok")
        assert s.read(2).tobytes() == b"ok"


def test_write_and_read_past_the_end(platform_device, no_leaks):
    with jaxvmm.Slot(100, device=platform_device) as s:
        assert s.size > 100  # the limit is nbytes, not the rounded size
        data = pattern(100, 3)
        s.write(data)
        for args, kwargs in [((b"x" * 101,), {}), ((b"x",), {"offset": 100}), ((b"ab",), {"offset": 99}),
                             ((b"x",), {"offset": -1}), ((b"x",), {"offset": 2**64})]:
            with pytest.raises(ValueError, match="jaxvmm:"):
                s.write(*args, **kwargs)
        for kwargs in [{"nbytes": 101}, {"nbytes": 1, "offset": 100}, {"nbytes": -1}, {"offset": 101},
                       {"offset": -1}]:
            with pytest.raises(ValueError, match="jaxvmm:"):
                s.read(**kwargs)
        s.write(b"z", offset=99)  # the last byte is fine
        assert s.read(1, offset=99).tobytes() == b"z"
        # the core rejects out-of-range copies on its own, including offsets that would overflow
        with pytest.raises(jaxvmm.InvalidArgumentError, match="exceeds the slot's 100 bytes"):
            lib.slot(s.id).write(90, np.zeros(20, dtype=np.uint8))
        with pytest.raises(jaxvmm.InvalidArgumentError, match="exceeds"):
            lib.slot(s.id).write(2**64 - 1, np.zeros(2, dtype=np.uint8))
        with pytest.raises(jaxvmm.InvalidArgumentError, match="exceeds"):
            lib.slot(s.id).read_into(100, np.empty(1, dtype=np.uint8))
        # nothing was written by the rejected calls
        assert s.read().tobytes() == data[:99] + b"z"


# ---------------------------------------------------------------------------------------------------
# endurance
# ---------------------------------------------------------------------------------------------------
def test_ten_thousand_release_remap_cycles_do_not_grow(no_leaks):
    base_counters = live_counters("cpu")
    s = jaxvmm.Slot(2 * 4096, device="cpu")
    try:
        st0 = jaxvmm.stats()
        fds0 = open_fds()
        held = live_counters("cpu")
        assert held == {k: base_counters[k] + 1 for k in LIVE_KEYS}
        addr = s.address
        for i in range(1, 10_001):
            s.release()
            s.remap()
            if i % 2500 == 0:
                st = jaxvmm.stats()
                assert st["reserved_bytes"] == st0["reserved_bytes"], i
                assert st["mapped_bytes"] == st0["mapped_bytes"], i
                assert open_fds() == fds0, f"file descriptors grew after {i} cycles"
                assert live_counters("cpu") == held, i
        assert s.address == addr
        assert s.generation == 10_001
        st = jaxvmm.stats()
        assert st["releases"] - st0["releases"] == 10_000 and st["remaps"] - st0["remaps"] == 10_000
        s.write(b"still works")
        assert s.read(11).tobytes() == b"still works"
    finally:
        s.close()
    assert live_counters("cpu") == base_counters
    assert open_fds() <= fds0


# ---------------------------------------------------------------------------------------------------
# raw access to a released slot faults (subprocess: it kills the process)
# ---------------------------------------------------------------------------------------------------
_RAW_ACCESS = textwrap.dedent(
    """
    import ctypes, sys
    import jaxvmm
    s = jaxvmm.Slot(4096, device="cpu")
    s.write(b"STALE-SECRET-0123")
    {action}
    print("READING", flush=True)
    sys.stdout.write(repr(ctypes.string_at(s.address, 16)) + "\\n")
    sys.stdout.flush()
    """
)
_SUBPROCESS_ENV = {"JAX_PLATFORMS": "cpu"}


def test_raw_access_to_released_slot_segfaults():
    r = run_in_subprocess(_RAW_ACCESS.format(action="s.release()"), env=_SUBPROCESS_ENV)
    assert "READING" in r.stdout, r.stderr  # got as far as the raw read
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "STALE" not in r.stdout


def test_raw_access_control_while_mapped_succeeds():
    r = run_in_subprocess(_RAW_ACCESS.format(action="pass"), env=_SUBPROCESS_ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "b'STALE-SECRET-012'" in r.stdout
    # after release + remap the same raw address is readable again (fresh pages, new contents)
    r = run_in_subprocess(
        _RAW_ACCESS.format(action="a = s.address; s.release(); s.remap(); assert s.address == a; "
                                  "s.write(b'FRESH-PAGES-ABCDEF')"),
        env=_SUBPROCESS_ENV,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "b'FRESH-PAGES-ABCD'" in r.stdout


# ---------------------------------------------------------------------------------------------------
# threads
# ---------------------------------------------------------------------------------------------------
def test_threads_on_their_own_slots(no_leaks):
    n_threads, rounds = 8, 40
    before = jaxvmm.stats()
    base_counters = live_counters("cpu")
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            barrier.wait()
            for r in range(rounds):
                nbytes = 4096 * (1 + (t + r) % 3) + t
                with jaxvmm.Slot(nbytes, device="cpu") as s:
                    addr = s.address
                    data = pattern(nbytes, t * 1000 + r)
                    s.write(data)
                    assert s.read().tobytes() == data
                    for k in range(3):
                        s.release()
                        s.remap()
                        assert s.address == addr and s.generation == k + 2
                    s.write(data)
                    assert s.read().tobytes() == data
                    assert lib.find_range(addr, s.size) == s.id
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a worker hung"
    assert not errors, errors[:3]
    after = jaxvmm.stats()
    for k in ("slots", "reserved_bytes", "mapped_bytes", "quarantined"):
        assert after[k] == before[k], k
    total = n_threads * rounds
    assert after["created"] - before["created"] == total
    assert after["closed"] - before["closed"] == total
    assert after["releases"] - before["releases"] == 3 * total
    assert after["remaps"] - before["remaps"] == 3 * total
    assert live_counters("cpu") == base_counters


def test_concurrent_release_remap_of_one_slot_keeps_accounting():
    # Hammer one slot from 8 threads in rounds until the accounting disagrees with the slot (or ~4 s pass).
    code = textwrap.dedent(
        """
        import threading, time, jaxvmm
        from jaxvmm._native import lib
        slot = lib.create_slot("posix", 0, "device", 0, [0], 4096)
        def hammer(op):
            for _ in range(1000):
                try:
                    op()
                except jaxvmm.SlotStateError:
                    pass
        deadline = time.monotonic() + 4
        while True:
            ops = (slot.release, slot.remap) * 4
            ts = [threading.Thread(target=hammer, args=(op,)) for op in ops]
            for t in ts: t.start()
            for t in ts: t.join()
            slot_mapped = slot.info()["mapped_bytes"]
            st = jaxvmm.stats()
            drifted = st["mapped_bytes"] != slot_mapped or st["peak_mapped_bytes"] > 4096
            if drifted or time.monotonic() > deadline:
                break
        print("RESULT", slot_mapped, st["mapped_bytes"], st["peak_mapped_bytes"])
        """
    )
    r = run_in_subprocess(code, env=_SUBPROCESS_ENV)
    assert r.returncode == 0, r.stderr[-2000:]
    slot_mapped, stats_mapped, peak = map(int, r.stdout.split("RESULT")[1].split())
    assert stats_mapped == slot_mapped, "stats()['mapped_bytes'] drifted from the slot's own mapped bytes"
    assert peak <= 4096, "peak_mapped_bytes exceeds the only slot's size"


# ---- acceptance checks on the real driver (issue: foundation, GPU part) ----
@pytest.mark.gpu
def test_gpu_release_of_1gib_returns_memory_to_the_driver(no_leaks):
    nbytes = 1 << 30
    with jaxvmm.Slot(nbytes, device="cuda:0") as s:
        free_mapped, _ = jaxvmm.driver_memory_info("cuda:0")
        s.release()
        free_released, _ = jaxvmm.driver_memory_info("cuda:0")
        assert free_released - free_mapped >= 0.95 * nbytes, (free_mapped, free_released)
        s.remap()
        free_remapped, _ = jaxvmm.driver_memory_info("cuda:0")
        assert free_released - free_remapped >= 0.95 * nbytes, (free_released, free_remapped)


@pytest.mark.gpu
def test_gpu_address_identical_across_100_cycles(no_leaks):
    with jaxvmm.Slot(3 << 20, device="cuda:0") as s:
        addr = s.address
        for i in range(100):
            s.release()
            s.remap()
            assert s.address == addr and s.generation == i + 2
        s.write(b"jaxvmm")
        assert s.read(6).tobytes() == b"jaxvmm"


@pytest.mark.gpu
def test_gpu_host_numa_slot(no_leaks):
    try:
        s = jaxvmm.Slot(4 << 20, device="cuda:0", location="host_numa")
    except jaxvmm.NotSupportedError as e:  # capability is checked up front, with a clear message
        assert "HOST_NUMA" in str(e)
        pytest.skip(f"this GPU cannot map HOST_NUMA memory: {e}")
    with s:
        assert s.location == "host_numa:0"
        s.write(b"host numa")
        addr = s.address
        s.release()
        s.remap()
        assert s.address == addr
        s.write(b"again")
        assert s.read(5).tobytes() == b"again"


def test_write_is_visible_to_every_stream_when_it_returns(no_leaks):
    """cuMemcpyHtoD from pageable memory (a Python buffer) returns once the bytes are staged; their DMA
    may still run on the legacy stream, which other streams do not wait for. On the H200 a graph launched
    right after Slot.write read the slot's old tail (tests/test_graph.py, 8 MiB rounds). The cpu backend
    models the staged copy: the slot's memory, read directly (as another stream would), must already
    hold the new bytes when write returns."""
    import ctypes

    n = 3 << 20
    with jaxvmm.Slot(n, device="cpu") as s:
        for seed in range(3):
            data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
            s.write(data)
            raw = np.frombuffer(ctypes.string_at(s.address, n), np.uint8)
            assert np.array_equal(raw, data), seed


def _max_map_count() -> int:
    try:
        return int(open("/proc/sys/vm/max_map_count").read())
    except (OSError, ValueError):
        return 0


@pytest.mark.skipif(not 0 < _max_map_count() <= 200_000,
                    reason="needs Linux with vm.max_map_count at most 200,000 (filling it takes too long past that)")
def test_slots_are_refused_before_the_process_runs_out_of_memory_mappings():
    """Slots until refused: about 32,500 of them once ran the process out of memory mappings, raising
    'cuMemMap: CUDA_ERROR_OUT_OF_MEMORY' (the cause unnamed), and the next jax.jit compile aborted the
    process (XLA could not start a thread). Now a slot is refused while the process still has headroom,
    with a message that names the limit, and the process goes on."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, jaxvmm
        slots = []
        try:
            for _ in range(200_000):
                slots.append(jaxvmm.Slot(4096, device="cpu"))
        except jaxvmm.OutOfMemoryError as e:
            assert "vm.max_map_count" in str(e) and "close slots" in str(e), str(e)
            print("refused after", len(slots))
        else:
            raise SystemExit("never refused")
        assert float(jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).sum()) == 9.0   # XLA still compiles and runs
        for s in slots[:100]:
            s.close()
        slots.append(jaxvmm.Slot(4096, device="cpu"))                        # room again
        print("OK")
    """)
    r = run_in_subprocess(code, env=_SUBPROCESS_ENV, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])
