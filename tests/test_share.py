"""Shared slots: export/import between processes, the generation channel, descriptor ownership, zero-copy
views (Slot.as_array), and multi-process JAX.

CPU tests run on the POSIX backend (memfd pages, SCM_RIGHTS between real processes). gpu-marked tests need
CUDA; the ``two_gpus`` ones skip (with the reason) unless two GPUs are visible. On a 2-GPU machine:
``JAXVMM_REQUIRE_2GPU=1 bash tools/device_run.sh build tests tests/test_share.py py bench/share_bw.py``.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvmm
from jaxvmm import _config
import jaxvmm.testing as jt
from conftest import gpu_unavailable_reason, live_counters

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGESIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def share_stats() -> dict:
    return jaxvmm.stats()["share"]


@pytest.fixture
def share_clean():
    """No descriptor, view, imported slot or driver object outlives the test."""
    import gc

    gc.collect()
    before_fds, before = open_fds(), share_stats()
    before_live = live_counters("cpu")
    yield
    gc.collect()
    after = share_stats()
    for k in ("fds", "views", "imported_slots", "channel_fds"):
        assert after[k] == before[k], (k, before, after)
    assert live_counters("cpu") == before_live
    assert open_fds() == before_fds, (before_fds, open_fds())


def two_gpus_reason() -> str | None:
    reason = gpu_unavailable_reason()
    if reason:
        return reason
    n = len(jax.devices("gpu"))
    return None if n >= 2 else f"needs 2 visible GPUs, this machine shows {n}"


# JAXVMM_REQUIRE_GPU=1 alone does not turn these into failures (a 1-GPU runner runs the gpu suite with it);
# JAXVMM_REQUIRE_2GPU=1 does.
two_gpus = pytest.mark.skipif(two_gpus_reason() is not None and not _config.read_at_import("require_2gpu"),
                              reason=f"2-GPU test: {two_gpus_reason()} (set JAXVMM_REQUIRE_2GPU=1 to fail instead)")


# ---------------------------------------------------------------------------------------------------
# Slot(shareable=...), export, import in one process
# ---------------------------------------------------------------------------------------------------
def test_shareable_argument_is_validated():
    with pytest.raises(jaxvmm.InvalidArgumentError, match="shareable"):
        jaxvmm.Slot(PAGE, device="cpu", shareable="ipc")
    with pytest.raises(TypeError, match="shareable"):
        jaxvmm.Slot(PAGE, device="cpu", shareable=1)


def test_fabric_is_refused_up_front_naming_the_driver_answer(share_clean):
    created = jaxvmm.stats()["created"]
    with pytest.raises(jaxvmm.NotSupportedError, match="FABRIC_SUPPORTED = 0"):
        jaxvmm.Slot(PAGE, device="cpu", shareable="fabric")
    assert jaxvmm.stats()["created"] == created  # refused before anything was reserved


def test_export_needs_a_shareable_mapped_owned_slot(share_clean):
    with jaxvmm.Slot(PAGE, device="cpu") as plain:
        with pytest.raises(jaxvmm.SlotStateError, match="not created shareable"):
            plain.export()
    with jaxvmm.Slot(PAGE, device="cpu", shareable="posix_fd") as s:
        s.release()
        with pytest.raises(jaxvmm.SlotStateError, match="released"):
            s.export()
        s.remap()
        with s.export() as h, jaxvmm.Slot.import_(h, device="cpu") as imp:
            with pytest.raises(jaxvmm.SlotStateError, match="imported slot cannot be exported"):
                imp.export()
            with pytest.raises(jaxvmm.SlotStateError, match="cannot be released"):
                imp.release()


def test_export_import_alias_the_same_pages_both_ways(share_clean):
    with jaxvmm.Slot(3 * PAGE, device="cpu", shareable="posix_fd") as s:
        s.write(np.arange(3 * PAGE, dtype=np.uint8))
        with s.export() as h:
            assert (h.kind, h.backend, h.size, h.generation, h.location) == ("posix_fd", "posix", 3 * PAGE, 1, "device")
            assert h.granularity == PAGE and h.stale is False and len(h.fds()) == 2
            with jaxvmm.Slot.import_(h, device="cpu") as imp:
                assert imp.imported and imp.address != s.address and imp.size == s.size
                assert imp.generation == 1 and imp.stale is False and imp.location == "device"
                np.testing.assert_array_equal(imp.read(), np.arange(3 * PAGE, dtype=np.uint8))
                imp.write(b"from the importer", offset=PAGE)
                assert bytes(s.read(17, offset=PAGE)) == b"from the importer"
                assert share_stats()["imported_slots"] >= 1


def test_importer_pages_outlive_the_exporter_and_turn_stale(share_clean):
    s = jaxvmm.Slot(PAGE, device="cpu", shareable="posix_fd")
    s.write(np.full(PAGE, 42, np.uint8))
    h = s.export()
    imp = jaxvmm.Slot.import_(h, device="cpu")
    s.release()
    assert imp.stale and h.stale
    assert imp.read(4).tolist() == [42] * 4  # still this process's pages
    s.remap()
    s.write(np.full(PAGE, 7, np.uint8))
    assert imp.stale and imp.read(4).tolist() == [42] * 4  # a remap gives the exporter new pages
    with pytest.raises(jaxvmm.StaleHandleError, match="remapped"):
        jaxvmm.Slot.import_(h, device="cpu")
    with s.export() as h2:
        assert h2.generation == 2 and not h2.stale
        with jaxvmm.Slot.import_(h2, device="cpu") as fresh:
            assert fresh.read(4).tolist() == [7] * 4 and not fresh.stale
    s.close()
    with pytest.raises(jaxvmm.StaleHandleError, match="closed"):
        h.check_current()
    assert imp.read(4).tolist() == [42] * 4  # the exporter is gone; the importer's pages are not
    imp.close()
    h.close()


def test_handles_close_their_descriptors_exactly_once(share_clean):
    with jaxvmm.Slot(PAGE, device="cpu", shareable="posix_fd") as s:
        base = open_fds()
        handles = [s.export() for _ in range(20)]
        assert open_fds() == base + 40 and share_stats()["fds"] >= 40
        fds = handles[0].fds()
        for h in handles:
            h.close()
            h.close()  # nothing is closed twice
        assert open_fds() == base
        for f in fds:
            with pytest.raises(OSError):
                os.fstat(f)
        with pytest.raises(jaxvmm.SlotStateError, match="closed"):
            jaxvmm.Slot.import_(handles[0], device="cpu")
        h = s.export()
        del h  # garbage collected handles close theirs too
        assert open_fds() == base


def test_bad_handles_give_clear_errors(share_clean):
    with jaxvmm.Slot(2 * PAGE, device="cpu", shareable="posix_fd") as s, s.export() as h:
        with pytest.raises(TypeError, match="ShareHandle"):
            jaxvmm.Slot.import_(object(), device="cpu")
        # A descriptor of something that is not an allocation (a plain memfd of the right size)
        other = os.memfd_create("not-jaxvmm")
        os.ftruncate(other, 2 * PAGE)
        forged = jaxvmm.ShareHandle(kind="posix_fd", backend="posix", size=2 * PAGE, nbytes=2 * PAGE,
                                    granularity=PAGE, location="device", device=0, generation=1, pid=os.getpid(),
                                    slot=-1, fd=other, channel_fd=os.dup(h.channel_fd))
        with forged, pytest.raises(jaxvmm.InvalidArgumentError, match="CUDA_ERROR_INVALID_VALUE"):
            jaxvmm.Slot.import_(forged, device="cpu")
        # A size that is not what the descriptor holds
        lying = jaxvmm.ShareHandle(kind="posix_fd", backend="posix", size=PAGE, nbytes=PAGE, granularity=PAGE,
                                   location="device", device=0, generation=1, pid=os.getpid(), slot=-1,
                                   fd=os.dup(h.fd), channel_fd=os.dup(h.channel_fd))
        with lying, pytest.raises(jaxvmm.InvalidArgumentError, match="holds"):
            jaxvmm.Slot.import_(lying, device="cpu")
        with pytest.raises(jaxvmm.InvalidArgumentError, match="fabric handles travel as bytes"):
            jaxvmm.ShareHandle.from_bytes(h.to_bytes())
        with pytest.raises(jaxvmm.InvalidArgumentError, match="not a share handle"):
            jaxvmm.ShareHandle.from_bytes(b"\xff")


@pytest.mark.parametrize("entry", jt.SHARE_ENTRIES["import"])
def test_an_import_that_fails_part_way_rolls_back_exactly(entry, share_clean):
    with jaxvmm.Slot(PAGE, device="cpu", shareable="posix_fd") as s, s.export() as h:
        s.write(b"kept")
        live, fds, slots = live_counters("cpu"), open_fds(), jaxvmm.stats()["slots"]
        with jt.fault(entry, error="CUDA_ERROR_OUT_OF_MEMORY", device="cpu"):
            with pytest.raises(jaxvmm.OutOfMemoryError, match=entry):
                jaxvmm.Slot.import_(h, device="cpu")
        assert live_counters("cpu") == live and open_fds() == fds and jaxvmm.stats()["slots"] == slots
        assert jaxvmm.stats()["quarantined"] == 0
        with jaxvmm.Slot.import_(h, device="cpu") as imp:  # the handle is intact
            assert bytes(imp.read(4)) == b"kept"


def test_an_export_that_fails_leaves_nothing_open(share_clean):
    with jaxvmm.Slot(PAGE, device="cpu", shareable="posix_fd") as s:
        fds = open_fds()
        with jt.fault("cuMemExportToShareableHandle", error="CUDA_ERROR_OPERATING_SYSTEM", device="cpu"):
            with pytest.raises(jaxvmm.DriverError, match="cuMemExportToShareableHandle"):
                s.export()
        assert open_fds() == fds


# ---------------------------------------------------------------------------------------------------
# Zero-copy views
# ---------------------------------------------------------------------------------------------------
def test_as_array_aliases_the_slot_on_cpu(share_clean):
    with jaxvmm.Slot(1 << 16, device="cpu") as s:
        x = s.as_array((64, 32), jnp.float32, offset=1024)
        assert x.shape == (64, 32) and x.dtype == jnp.float32 and s.views == 1
        assert x.devices() == {s.device}
        s.write(np.arange(64 * 32, dtype=np.float32), offset=1024)  # written after the view was made
        np.testing.assert_array_equal(np.asarray(x), np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
        assert float(jax.jit(lambda a: a.sum())(x)) == float(np.arange(64 * 32).sum())
        b = s.as_array((16,), jnp.bfloat16)
        s.write(np.ones(16, jnp.bfloat16).view(np.uint16))
        assert b.dtype == jnp.bfloat16 and float(b.sum()) == 16.0
        del x, b


def test_views_block_release_and_close_until_deleted(share_clean):
    s = jaxvmm.Slot(PAGE, device="cpu")
    x = s.as_array((PAGE // 4,), jnp.int32)
    with pytest.raises(jaxvmm.SlotStateError, match="zero-copy view"):
        s.release()
    with pytest.raises(jaxvmm.SlotStateError, match="zero-copy view"):
        s.close()
    assert s.mapped and not s.closed  # refused means untouched
    del x
    s.release()
    with pytest.raises(jaxvmm.SlotStateError, match="released"):
        s.as_array((4,), jnp.int32)  # a view needs pages
    s.remap()
    y = s.as_array((4,), jnp.int32)  # a new view sees the new pages
    s.write(np.array([1, 2, 3, 4], np.int32))
    assert np.asarray(y).tolist() == [1, 2, 3, 4]
    del y
    s.close()


def test_a_slot_dropped_with_live_views_closes_when_the_last_view_dies(share_clean):
    slots = jaxvmm.stats()["slots"]
    s = jaxvmm.Slot(PAGE, device="cpu")
    s.write(np.full(PAGE // 4, 5, np.int32))
    x = s.as_array((PAGE // 4,), jnp.int32)
    del s  # the Python object goes; the pages stay while x lives
    assert jaxvmm.stats()["slots"] == slots + 1
    assert int(x[0]) == 5
    del x
    import gc
    import time

    gc.collect()
    deadline = time.monotonic() + 2
    while jaxvmm.stats()["slots"] != slots and time.monotonic() < deadline:
        time.sleep(0.001)
    assert jaxvmm.stats()["slots"] == slots


def test_as_array_validates(share_clean):
    with jaxvmm.Slot(PAGE, device="cpu") as s:
        with pytest.raises(jaxvmm.InvalidArgumentError, match="multiple of 256"):
            s.as_array((4,), jnp.float32, offset=4)
        with pytest.raises(jaxvmm.InvalidArgumentError, match="outside"):
            s.as_array((PAGE,), jnp.float32)
        with pytest.raises(jaxvmm.NotSupportedError, match="jax_enable_x64"):
            if jax.config.jax_enable_x64:
                pytest.skip("x64 enabled")
            s.as_array((4,), np.float64)
        with pytest.raises(TypeError, match="shape"):
            s.as_array(("a",), jnp.float32)
        assert s.views == 0


def test_an_imported_slot_views_the_exporters_bytes(share_clean):
    with jaxvmm.Slot(PAGE, device="cpu", shareable="posix_fd") as s, s.export() as h:
        with jaxvmm.Slot.import_(h, device="cpu") as imp:
            v = imp.as_array((PAGE // 4,), jnp.float32)
            s.write(np.full(PAGE // 4, 2.5, np.float32))
            assert float(v.sum()) == 2.5 * PAGE // 4
            del v


# ---------------------------------------------------------------------------------------------------
# Two processes (POSIX backend): SCM_RIGHTS and pidfd_getfd
# ---------------------------------------------------------------------------------------------------
PEER = textwrap.dedent("""
    import os, socket, sys
    import numpy as np, jax.numpy as jnp, jaxvmm
    role, path, device = sys.argv[1], sys.argv[2], sys.argv[3]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); conn.connect(path)
    if role == "importer":
        with jaxvmm.recv_handle(conn) as h, jaxvmm.Slot.import_(h, device=device) as s:
            assert not s.stale
            x = s.as_array((s.nbytes // 4,), jnp.float32)
            conn.sendall(repr(float(x.sum())).encode()); del x
            assert conn.recv(2) == b"go"          # the exporter wrote again
            s.write(np.full(4, 9, np.float32))    # and now this process writes
            conn.sendall(b"ok")
            assert conn.recv(2) == b"rl"          # the exporter released its slot
            assert s.stale and s.read(16).view(np.float32).tolist() == [9, 9, 9, 9]
        assert jaxvmm.stats()["share"]["fds"] == 0, jaxvmm.stats()["share"]
        conn.sendall(b"bye")
    else:  # exporter: creates, writes, sends, keeps the socket open until told
        s = jaxvmm.Slot(1 << 20, device=device, shareable="posix_fd")
        s.write(np.ones((1 << 18), np.float32))
        with s.export() as h:
            conn.sendall(repr(h.describe()).encode())
            assert conn.recv(4) == b"took"
        s.write(np.full(8, 3, np.float32))
        conn.sendall(b"wrote")
        assert conn.recv(4) == b"done"
        s.close()
        conn.sendall(b"closed")
""")


def _listen():
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "s")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(120)
    return server, path


def _peer(role: str, path: str, device: str = "cpu", env: dict | None = None) -> subprocess.Popen:
    full = dict(os.environ)
    full["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cpu")
    full.update(env or {})  # may override JAX_PLATFORMS (the GPU peers do)
    full.pop("PYTHONFAULTHANDLER", None)
    return subprocess.Popen([sys.executable, "-c", PEER, role, path, device], env=full,
                            cwd=tempfile.gettempdir(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _recv_exact(conn, n):
    out = b""
    while len(out) < n:
        more = conn.recv(n - len(out))
        assert more, "peer closed"
        out += more
    return out


def test_two_processes_scm_rights_write_in_one_read_in_the_other(share_clean):
    server, path = _listen()
    child = _peer("importer", path)
    try:
        conn, _ = server.accept()
        with conn, jaxvmm.Slot(1 << 20, device="cpu", shareable="posix_fd") as s:
            s.write(np.arange(1 << 18, dtype=np.float32))
            with s.export() as h:
                jaxvmm.send_handle(conn, h)
            total = float(conn.recv(64).decode())
            assert total == float(np.arange(1 << 18, dtype=np.float32).sum(dtype=np.float32)) or \
                abs(total - float(np.arange(1 << 18).sum())) / float(np.arange(1 << 18).sum()) < 1e-6
            conn.sendall(b"go")
            assert conn.recv(2) == b"ok"
            assert s.read(16).view(np.float32).tolist() == [9, 9, 9, 9]  # the other process wrote it
            s.release()
            conn.sendall(b"rl")
            assert _recv_exact(conn, 3) == b"bye"
    finally:
        out, err = child.communicate(timeout=120)
        server.close()
    assert child.returncode == 0, out + err[-3000:]


def test_pidfd_getfd_takes_the_descriptors_from_the_exporter(share_clean):
    if not hasattr(os, "pidfd_open"):
        pytest.skip("os.pidfd_open is missing (Python < 3.9 or not Linux)")
    server, path = _listen()
    child = _peer("exporter", path)
    try:
        conn, _ = server.accept()
        with conn:
            import ast

            meta = ast.literal_eval(conn.recv(4096).decode())
            try:
                h = jaxvmm.ShareHandle.from_pid(meta)
            except jaxvmm.NotSupportedError as e:
                conn.sendall(b"took")
                conn.recv(5)
                conn.sendall(b"done")
                pytest.skip(f"pidfd_getfd not permitted here: {e}")
            conn.sendall(b"took")  # the exporter may close its handle now: ours is our own
            with h, jaxvmm.Slot.import_(h, device="cpu") as imp:
                assert _recv_exact(conn, 5) == b"wrote"
                assert imp.read(32).view(np.float32).tolist() == [3] * 8
                conn.sendall(b"done")
                assert _recv_exact(conn, 6) == b"closed"
                assert imp.stale and imp.read(4).view(np.float32).tolist() == [3]  # pages outlive the exporter
    finally:
        out, err = child.communicate(timeout=120)
        server.close()
    assert child.returncode == 0, out + err[-3000:]


def test_the_producer_consumer_example_runs_on_cpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "share_producer_consumer.py")], env=env,
                       capture_output=True, text=True, timeout=300, cwd=str(ROOT / "examples"))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "consumer summed" in r.stdout


# ---------------------------------------------------------------------------------------------------
# GPU: one device
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_export_import_and_view_on_one_gpu():
    with jaxvmm.Slot(4 << 20, device="cuda:0", shareable="posix_fd") as s, s.export() as h:
        assert h.backend == "cuda" and h.size % h.granularity == 0
        with jaxvmm.Slot.import_(h, device="cuda:0") as imp:
            s.write(np.arange(1 << 20, dtype=np.float32))
            np.testing.assert_array_equal(imp.read(16).view(np.float32), np.arange(4, dtype=np.float32))
            v = imp.as_array((1 << 20,), jnp.float32)
            assert v.devices() == {s.device}
            assert float(jnp.sum(v[:1000])) == float(np.arange(1000).sum())
            imp.write(np.full(4, -1, np.float32))  # seen by the exporter and by the view
            assert s.read(16).view(np.float32).tolist() == [-1] * 4
            assert float(v[0]) == -1.0
            del v


@pytest.mark.gpu
def test_gpu_fabric_is_either_usable_or_refused_with_the_drivers_answer():
    try:
        s = jaxvmm.Slot(2 << 20, device="cuda:0", shareable="fabric")
    except jaxvmm.NotSupportedError as e:
        assert "fabric" in str(e) and ("CUDA_ERROR" in str(e) or "FABRIC_SUPPORTED = 0" in str(e)), str(e)
        return
    with s, s.export() as h:
        assert h.kind == "fabric" and len(h.fabric) == 64
        with jaxvmm.Slot.import_(h, device="cuda:0") as imp:
            s.write(b"fabric")
            assert bytes(imp.read(6)) == b"fabric"


@pytest.mark.gpu
def test_gpu_import_rolls_back_at_every_stage():
    with jaxvmm.Slot(2 << 20, device="cuda:0", shareable="posix_fd") as s, s.export() as h:
        jaxvmm.Slot.import_(h, device="cuda:0").close()  # warm: the driver's own first-import state
        for entry in jt.SHARE_ENTRIES["import"]:
            live, fds, slots = live_counters("cuda:0"), share_stats()["fds"], jaxvmm.stats()["slots"]
            with jt.fault(entry, error="CUDA_ERROR_OUT_OF_MEMORY", device="cuda:0"):
                with pytest.raises(jaxvmm.OutOfMemoryError, match=entry):
                    jaxvmm.Slot.import_(h, device="cuda:0")
            assert live_counters("cuda:0") == live, entry
            assert share_stats()["fds"] == fds and jaxvmm.stats()["slots"] == slots, entry
            assert jaxvmm.stats()["quarantined"] == 0, entry
        with jaxvmm.Slot.import_(h, device="cuda:0"):
            pass


@pytest.mark.gpu
def test_gpu_as_array_aliases_and_blocks_release():
    with jaxvmm.Slot(2 << 20, device="cuda:0") as s:
        x = s.as_array((512, 256), jnp.float32)
        s.write(np.ones(512 * 256, np.float32))
        assert float(jax.jit(jnp.sum)(x)) == 512 * 256
        with pytest.raises(jaxvmm.SlotStateError, match="zero-copy view"):
            s.release()
        del x
        s.release()
        s.remap()


# ---------------------------------------------------------------------------------------------------
# GPU: two devices, two processes (NVLink)
# ---------------------------------------------------------------------------------------------------
def _exporter_side(importer_device: str) -> None:
    fds, channels = share_stats()["fds"], share_stats()["channel_fds"]
    server, path = _listen()
    child = _peer("importer", path, device=importer_device, env={"JAX_PLATFORMS": "cuda,cpu",
                                                                 "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    try:
        conn, _ = server.accept()
        with conn, jaxvmm.Slot(1 << 20, device="cuda:0", shareable="posix_fd") as s:
            s.write(np.arange(1 << 18, dtype=np.float32))
            with s.export() as h:
                jaxvmm.send_handle(conn, h)
            total = float(conn.recv(64).decode())
            exact = float(np.arange(1 << 18).sum())
            assert abs(total - exact) / exact < 1e-5, total
            conn.sendall(b"go")
            assert conn.recv(2) == b"ok"
            assert s.read(16).view(np.float32).tolist() == [9, 9, 9, 9]  # written by GPU 1's process
            s.release()
            conn.sendall(b"rl")
            assert _recv_exact(conn, 3) == b"bye"
    finally:
        out, err = child.communicate(timeout=300)
        server.close()
    assert child.returncode == 0, out + err[-3000:]
    assert share_stats()["fds"] == fds and share_stats()["channel_fds"] == channels  # the exporter's side too


@pytest.mark.gpu
def test_gpu_two_processes_on_one_gpu():
    _exporter_side("cuda:0")


@pytest.mark.gpu
@two_gpus
def test_two_gpus_exported_on_gpu0_imported_on_gpu1_read_and_written():
    _exporter_side("cuda:1")


@pytest.mark.gpu
@two_gpus
def test_two_gpus_example_producer_on_gpu0_consumer_on_gpu1():
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "share_producer_consumer.py"), "--device", "cuda:0",
                        "--consumer-device", "cuda:1"], env=env, capture_output=True, text=True, timeout=300,
                       cwd=str(ROOT / "examples"))
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "consumer summed" in r.stdout


# ---------------------------------------------------------------------------------------------------
# Multi-process JAX (jax.distributed): one process per device
# ---------------------------------------------------------------------------------------------------
DISTRIBUTED = textwrap.dedent("""
    import os, sys
    rank, nproc, port, platform = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    import jax
    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:
            pass
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=rank)
    else:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=rank,
                                   local_device_ids=[rank])
    import jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    jax.config.update("jax_default_matmul_precision", "highest")
    import jaxvmm
    dev = jax.local_devices()[0]
    assert jax.process_count() == nproc and len(jax.local_devices()) == 1, jax.local_devices()

    def block(x, w):
        return jnp.tanh(x @ w) * 2.0

    def loss(ws, x, remat):
        for w in ws:
            x = remat(block)(x, w)
        return jnp.mean(x ** 2)

    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (64, 64)) / 8 for i in range(3)]
    x = jax.random.normal(jax.random.fold_in(key, 100 + rank), (32, 64))  # this process's shard of the batch
    ws = jax.device_put(ws, dev); x = jax.device_put(x, dev)
    ref = jax.jit(jax.grad(lambda w, x: loss(w, x, jax.checkpoint)))(ws, x)
    policy = jaxvmm.policies.offload_everything_saveable(min_bytes=0)
    off = jax.jit(jax.grad(lambda w, x: loss(w, x, lambda f: jaxvmm.checkpoint(f, policy=policy))))(ws, x)
    jaxvmm.synchronize()
    offloads = sum(s["offloads"] for s in jaxvmm.engine_stats().values())
    assert offloads > 0, jaxvmm.engine_stats()
    for a, b in zip(ref, off):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # data parallel: average over the processes (a real cross-process collective)
    g_ref = [multihost_utils.process_allgather(g).mean(0) for g in ref]
    g_off = [multihost_utils.process_allgather(g).mean(0) for g in off]
    for a, b in zip(g_ref, g_off):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(g_ref[0], np.asarray(ref[0]))  # the average really mixes both processes' shards
    # eager offload/reload on this process's device
    y = jax.device_put(jnp.arange(1024.0) + rank, dev)
    t = jaxvmm.offload(y)
    np.testing.assert_array_equal(np.asarray(jaxvmm.reload(t)), np.asarray(y))
    # tokens are per process: another process's token is refused here
    t2 = jaxvmm.offload(y)
    mine = np.asarray(t2.token)
    tokens = multihost_utils.process_allgather(mine)
    theirs = tokens[1 - rank]
    forged = jaxvmm.Ticket(jax.device_put(jnp.asarray(theirs), dev), t2.shape, t2.dtype)
    try:
        jaxvmm.reload(forged)
    except jaxvmm.VmmError as e:
        print("refused:", type(e).__name__, str(e)[:120])
    else:
        raise SystemExit("a token from another process was accepted")
    np.testing.assert_array_equal(np.asarray(jaxvmm.reload(t2)), np.asarray(y))
    multihost_utils.sync_global_devices("done")
    print("RANK", rank, "OK")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_distributed(platform: str, env: dict) -> list:
    port = str(_free_port())
    full = dict(os.environ, **env)
    full.pop("PYTHONFAULTHANDLER", None)
    procs = [subprocess.Popen([sys.executable, "-c", DISTRIBUTED, str(r), "2", port, platform], env=full,
                              cwd=tempfile.gettempdir(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs


@pytest.mark.gpu
@two_gpus
def test_two_process_jax_distributed_on_two_gpus():
    outs = _run_distributed("gpu", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    for rank, (rc, out, err) in enumerate(outs):
        assert rc == 0 and f"RANK {rank} OK" in out and "refused:" in out, out + err[-4000:]


def _cpu_distributed_reason() -> str | None:
    try:
        jax.config.jax_cpu_collectives_implementation  # noqa: B018
    except AttributeError:
        return "this jax has no cpu collectives option"
    return None


@pytest.mark.skipif(_cpu_distributed_reason() is not None, reason=str(_cpu_distributed_reason()))
def test_two_process_jax_distributed_on_cpu():
    outs = _run_distributed("cpu", {"JAX_PLATFORMS": "cpu"})
    for rank, (rc, out, err) in enumerate(outs):
        assert rc == 0 and f"RANK {rank} OK" in out and "refused:" in out, out + err[-4000:]
