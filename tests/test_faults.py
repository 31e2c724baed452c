"""The fault matrix on the cpu (POSIX) backend.

Every driver entry point each lifecycle operation calls (``jaxvmm.testing.LIFECYCLE_ENTRIES``) is made
to fail; the test checks the exception, the rollback (exactly which driver calls ran, and which driver
objects are still live), that the operation succeeds once the fault clears, and that everything ends
back at the baseline. Teardown failures end in the quarantine and are retried without repeating the
stages that already finished.
"""

from __future__ import annotations

import threading
import time

import pytest

import jaxvmm
import jaxvmm.testing as jt
from jaxvmm._native import lib

from conftest import LIVE_KEYS

DEV = "cpu"
NBYTES = 5000  # rounds up to two pages on the POSIX backend
DATA = bytes(range(256)) * (NBYTES // 256) + bytes(NBYTES % 256)

ERRORS = {
    "CUDA_ERROR_OUT_OF_MEMORY": jaxvmm.OutOfMemoryError,
    "CUDA_ERROR_INVALID_VALUE": jaxvmm.DriverError,
    "CUDA_ERROR_NOT_PERMITTED": jaxvmm.NotSupportedError,
}

MATRIX = [(op, entry) for op, entries in jt.LIFECYCLE_ENTRIES.items() for entry in entries]

VMM_ENTRIES = ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
               "cuMemRelease", "cuMemAddressFree")

# Driver calls made by the failing operation, rollback included (entry -> number of calls).
CALLS_DURING_FAILURE = {
    ("create", "cuMemAddressReserve"): {"cuMemAddressReserve": 1},
    ("create", "cuMemCreate"): {"cuMemAddressReserve": 1, "cuMemCreate": 1, "cuMemAddressFree": 1},
    ("create", "cuMemMap"): {"cuMemAddressReserve": 1, "cuMemCreate": 1, "cuMemMap": 1, "cuMemRelease": 1,
                             "cuMemAddressFree": 1},
    ("create", "cuMemSetAccess"): {"cuMemAddressReserve": 1, "cuMemCreate": 1, "cuMemMap": 1,
                                   "cuMemSetAccess": 1, "cuMemUnmap": 1, "cuMemRelease": 1,
                                   "cuMemAddressFree": 1},
    ("release", "cuMemUnmap"): {"cuMemUnmap": 1},
    ("release", "cuMemRelease"): {"cuMemUnmap": 1, "cuMemRelease": 1},
    ("remap", "cuMemCreate"): {"cuMemCreate": 1},
    ("remap", "cuMemMap"): {"cuMemCreate": 1, "cuMemMap": 1, "cuMemRelease": 1},
    ("remap", "cuMemSetAccess"): {"cuMemCreate": 1, "cuMemMap": 1, "cuMemSetAccess": 1, "cuMemUnmap": 1,
                                  "cuMemRelease": 1},
    ("close", "cuMemUnmap"): {"cuMemUnmap": 1},
    ("close", "cuMemRelease"): {"cuMemUnmap": 1, "cuMemRelease": 1},
    ("close", "cuMemAddressFree"): {"cuMemUnmap": 1, "cuMemRelease": 1, "cuMemAddressFree": 1},
}

# Driver objects the slot still owns after the failure (live_handles, live_reservations, live_mappings).
OWNED_AFTER_FAILURE = {
    ("create", "cuMemAddressReserve"): (0, 0, 0),
    ("create", "cuMemCreate"): (0, 0, 0),
    ("create", "cuMemMap"): (0, 0, 0),
    ("create", "cuMemSetAccess"): (0, 0, 0),
    ("release", "cuMemUnmap"): (1, 1, 1),  # nothing happened: still mapped
    ("release", "cuMemRelease"): (1, 1, 0),  # unmapped ('released'), the handle lingers
    ("remap", "cuMemCreate"): (0, 1, 0),
    ("remap", "cuMemMap"): (0, 1, 0),
    ("remap", "cuMemSetAccess"): (0, 1, 0),
    ("close", "cuMemUnmap"): (1, 1, 1),
    ("close", "cuMemRelease"): (1, 1, 0),
    ("close", "cuMemAddressFree"): (0, 1, 0),
}

# Driver calls made by retry_quarantine() once the fault is gone: finished stages are not repeated.
CALLS_DURING_RETRY = {
    "cuMemUnmap": {"cuMemUnmap": 1, "cuMemRelease": 1, "cuMemAddressFree": 1},
    "cuMemRelease": {"cuMemRelease": 1, "cuMemAddressFree": 1},
    "cuMemAddressFree": {"cuMemAddressFree": 1},
}


def test_tables_cover_the_lifecycle_entries():
    assert set(CALLS_DURING_FAILURE) == set(MATRIX) == set(OWNED_AFTER_FAILURE)
    assert set(CALLS_DURING_RETRY) == set(jt.LIFECYCLE_ENTRIES["close"])
    entries = set(jt.driver_entries())
    for op, names in jt.LIFECYCLE_ENTRIES.items():
        assert set(names) <= entries, op


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def counters() -> dict:
    return jt.driver_counters(DEV)


def live() -> tuple[int, int, int]:
    c = counters()
    return tuple(c[k] for k in LIVE_KEYS)


def plus(base: tuple, delta: tuple) -> tuple:
    return tuple(b + d for b, d in zip(base, delta))


def vmm_calls() -> dict:
    c = counters()["calls"]
    return {e: c[e] for e in VMM_ENTRIES}


def calls_since(before: dict) -> dict:
    """Nonzero per-entry call deltas of the VMM entries since ``before``."""
    now = vmm_calls()
    return {e: now[e] - before[e] for e in VMM_ENTRIES if now[e] != before[e]}


def accounting() -> dict:
    s = jaxvmm.stats()
    return {k: s[k] for k in ("slots", "reserved_bytes", "mapped_bytes", "quarantined", "quarantined_bytes")}


def size_of(nbytes: int) -> int:
    g = int(lib.granularity("posix", 0, "device", 0))
    return -(-nbytes // g) * g


def prepare(op: str):
    """The slot the operation acts on (None for create), in the state the operation needs."""
    if op == "create":
        return None
    s = jaxvmm.Slot(NBYTES, device=DEV)
    s.write(DATA)
    if op == "remap":
        s.release()
    return s


def perform(op: str, s):
    if op == "create":
        return jaxvmm.Slot(NBYTES, device=DEV)
    getattr(s, op)()
    return s


def check_error(err: BaseException, *, op: str, entry: str, error: str, slot_id: int | None):
    msg = str(err)
    assert isinstance(err, jaxvmm.VmmError), repr(err)
    assert msg.startswith("jaxvmm:"), msg
    assert err.driver_error == error, (err.driver_error, msg)
    assert err.stage == op, (err.stage, msg)
    assert isinstance(err.slot, int)
    if slot_id is not None:
        assert err.slot == slot_id
    assert f"slot {err.slot}: {op}: {entry}: {error}" in msg, msg


def exception_class(op: str, error: str) -> type:
    return jaxvmm.QuarantinedError if op == "close" else ERRORS[error]


# ---------------------------------------------------------------------------------------------------
# the matrix: every (operation, entry) x every error class
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("error", list(ERRORS))
@pytest.mark.parametrize("op, entry", MATRIX, ids=[f"{o}-{e}" for o, e in MATRIX])
def test_fault_matrix(op, entry, error, no_leaks):
    base_live = live()
    base_acc = accounting()
    size = size_of(NBYTES)

    s = prepare(op)
    sid = None if s is None else s.id
    address = None if s is None else s.address
    injected = counters()["injected"]
    before_calls = vmm_calls()
    with jt.fault(entry, error=error, device=DEV):
        with pytest.raises(jaxvmm.VmmError) as ei:
            perform(op, s)
    err = ei.value

    # -- the exception --
    assert type(err) is exception_class(op, error), (type(err), str(err))
    check_error(err, op=op, entry=entry, error=error, slot_id=sid)
    assert counters()["injected"] == injected + 1
    # -- the rollback: exactly these driver calls ran, and the slot owns exactly this much --
    assert calls_since(before_calls) == CALLS_DURING_FAILURE[(op, entry)]
    assert live() == plus(base_live, OWNED_AFTER_FAILURE[(op, entry)])
    acc = accounting()
    handles, reservations, _mappings = OWNED_AFTER_FAILURE[(op, entry)]
    assert acc["reserved_bytes"] == base_acc["reserved_bytes"] + reservations * size
    assert acc["mapped_bytes"] == base_acc["mapped_bytes"] + handles * size

    # -- recovery: the same operation succeeds once the fault is gone --
    if op == "create":
        assert acc == base_acc
        with pytest.raises(jaxvmm.NotFoundError):
            lib.slot(err.slot).info()  # the failed id was never registered
        with perform(op, None) as s2:
            assert s2.id != err.slot and s2.generation == 1
            s2.write(DATA)
            assert s2.read().tobytes() == DATA
    elif op == "release":
        if entry == "cuMemUnmap":
            assert s.state == "mapped" and s.mapped
            assert s.read().tobytes() == DATA, "a failed unmap must leave the data in place"
        else:
            assert s.state == "released" and not s.mapped
            assert s.info()["mapped_bytes"] == size  # the handle is still attached
            with pytest.raises(jaxvmm.SlotStateError):
                s.read()
        assert f"{entry}: {error}" in s.info()["last_error"]
        if entry == "cuMemUnmap":
            s.release()
        s.remap()
        assert s.generation == 2 and s.state == "mapped"
        s.write(DATA)
        assert s.read().tobytes() == DATA
        s.close()
    elif op == "remap":
        assert s.state == "released" and s.generation == 1
        with pytest.raises(jaxvmm.SlotStateError):
            s.read()
        s.remap()
        assert s.generation == 2 and s.state == "mapped"
        s.write(DATA)
        assert s.read().tobytes() == DATA
        s.close()
    else:  # close: the slot is closed for the caller and its remains are quarantined
        assert s.closed
        st = jaxvmm.stats()
        assert st["quarantined"] == base_acc["quarantined"] + 1
        assert st["slots"] == base_acc["slots"]
        (q,) = [q for q in st["quarantine"] if q["slot"] == sid]
        assert q["size"] == size and q["attempts"] == 1
        assert q["mapped_bytes"] == handles * size
        assert q["address"] == hex(address)
        assert entry in q["error"] and error in q["error"] and f"slot {sid}" in q["error"]
        with pytest.raises(jaxvmm.NotFoundError):
            lib.find_range(int(q["address"], 16), 0)  # never handed out again
        before_retry = vmm_calls()
        assert jaxvmm.retry_quarantine() == 0
        assert calls_since(before_retry) == CALLS_DURING_RETRY[entry]
        assert jaxvmm.stats()["quarantine"] == []

    assert live() == base_live
    assert accounting() == base_acc


@pytest.mark.parametrize("op, entry", MATRIX, ids=[f"{o}-{e}" for o, e in MATRIX])
def test_fault_on_nth_call(op, entry, no_leaks):
    """nth=2: the first operation goes through, the second fails."""
    base_live = live()
    error = "CUDA_ERROR_OUT_OF_MEMORY"
    first, second = prepare(op), prepare(op)
    second_id = None if second is None else second.id
    injected = counters()["injected"]
    jt.arm_fault(entry, nth=2, error=error, device=DEV)
    try:
        a = perform(op, first)
        assert counters()["injected"] == injected, "the first call must go through"
        with pytest.raises(exception_class(op, error)) as ei:
            perform(op, second)
        check_error(ei.value, op=op, entry=entry, error=error, slot_id=second_id)
        assert counters()["injected"] == injected + 1
        if op == "create":
            assert a.state == "mapped"
            a.write(DATA)
            assert a.read().tobytes() == DATA
            a.close()
            jaxvmm.Slot(NBYTES, device=DEV).close()  # the rule is used up
        elif op == "close":
            assert a.closed
            (q,) = jaxvmm.stats()["quarantine"]
            assert q["slot"] == second_id
        else:
            assert a.state == {"release": "released", "remap": "mapped"}[op]
            a.close()
            # the rule is used up: the same operation on the second slot now succeeds
            # (a release that failed at cuMemRelease already left the slot 'released')
            if not (op == "release" and entry == "cuMemRelease"):
                perform(op, second)
            second.close()
        assert counters()["injected"] == injected + 1
    finally:
        jt.clear_faults(DEV)
    assert jaxvmm.retry_quarantine() == 0
    assert live() == base_live


def test_times_fails_consecutive_calls_then_stops(no_leaks):
    with jaxvmm.Slot(NBYTES, device=DEV) as s:
        s.release()
        injected = counters()["injected"]
        jt.arm_fault("cuMemCreate", times=2, device=DEV)
        for _ in range(2):
            with pytest.raises(jaxvmm.OutOfMemoryError):
                s.remap()
            assert s.generation == 1 and s.state == "released"
        s.remap()
        assert s.generation == 2
        assert counters()["injected"] == injected + 2


def test_forever_fault_until_cleared(no_leaks):
    jt.arm_fault("cuMemAddressReserve", times=-1, error="CUDA_ERROR_INVALID_VALUE", device=DEV)
    for _ in range(5):
        with pytest.raises(jaxvmm.DriverError, match="cuMemAddressReserve: CUDA_ERROR_INVALID_VALUE"):
            jaxvmm.Slot(NBYTES, device=DEV)
    jt.clear_faults(DEV)
    jaxvmm.Slot(NBYTES, device=DEV).close()


def test_fault_context_manager_clears_on_exception(no_leaks):
    with pytest.raises(KeyError):
        with jt.fault("cuMemCreate", times=-1, device=DEV):
            raise KeyError("x")
    jaxvmm.Slot(NBYTES, device=DEV).close()  # nothing armed any more


def test_testing_api_validation():
    for kwargs in ({"nth": 0}, {"times": 0}, {"times": -2}):
        with pytest.raises(ValueError):
            jt.arm_fault("cuMemCreate", device=DEV, **kwargs)
    with pytest.raises(ValueError, match="unknown driver entry"):
        jt.arm_fault("cuMemNope", device=DEV)
    with pytest.raises(ValueError, match="unknown CUresult"):
        jt.arm_fault("cuMemCreate", error="CUDA_ERROR_BOGUS", device=DEV)
    jaxvmm.Slot(NBYTES, device=DEV).close()  # nothing was armed by the rejected calls


# ---------------------------------------------------------------------------------------------------
# a release whose cuMemRelease failed: the lingering handle is finished exactly once
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("finish", ["remap", "close"])
def test_failed_release_handle_finished_once(finish, no_leaks):
    base_live = live()
    s = jaxvmm.Slot(NBYTES, device=DEV)
    r0 = counters()["calls"]["cuMemRelease"]
    with jt.fault("cuMemRelease", device=DEV):
        with pytest.raises(jaxvmm.OutOfMemoryError, match="released again on the next remap or close"):
            s.release()
    assert s.state == "released"
    assert live() == plus(base_live, (1, 1, 0))
    assert counters()["calls"]["cuMemRelease"] == r0 + 1
    if finish == "remap":
        s.remap()  # releases the lingering handle, then maps a fresh one
        assert counters()["calls"]["cuMemRelease"] == r0 + 2
        assert live() == plus(base_live, (1, 1, 1))
        assert s.generation == 2
        s.close()
        assert counters()["calls"]["cuMemRelease"] == r0 + 3
    else:
        s.close()
        assert counters()["calls"]["cuMemRelease"] == r0 + 2
    assert live() == base_live
    assert jaxvmm.stats()["quarantined"] == 0


def test_failed_release_then_failed_remap_keeps_trying(no_leaks):
    """The lingering handle's release fails again during remap: still released, nothing double-counted."""
    base_live = live()
    with jaxvmm.Slot(NBYTES, device=DEV) as s:
        r0 = counters()["calls"]["cuMemRelease"]
        jt.arm_fault("cuMemRelease", times=2, device=DEV)
        with pytest.raises(jaxvmm.OutOfMemoryError):
            s.release()
        c0 = counters()["calls"]["cuMemCreate"]
        with pytest.raises(jaxvmm.OutOfMemoryError) as ei:
            s.remap()
        check_error(ei.value, op="remap", entry="cuMemRelease", error="CUDA_ERROR_OUT_OF_MEMORY",
                    slot_id=s.id)
        assert counters()["calls"]["cuMemCreate"] == c0  # did not map over a handle it could not drop
        assert s.state == "released" and s.generation == 1
        assert live() == plus(base_live, (1, 1, 0))
        s.remap()
        assert s.generation == 2
        assert counters()["calls"]["cuMemRelease"] == r0 + 3
    assert live() == base_live


# ---------------------------------------------------------------------------------------------------
# quarantine
# ---------------------------------------------------------------------------------------------------
def test_close_quarantine_does_not_block_and_retry_resumes(no_leaks):
    base_live = live()
    base_acc = accounting()
    size = size_of(NBYTES)
    a = jaxvmm.Slot(NBYTES, device=DEV)
    a_id, a_address = a.id, a.address
    quarantined_addresses = {a_address}
    jt.arm_fault("cuMemAddressFree", times=-1, error="CUDA_ERROR_INVALID_VALUE", device=DEV)
    try:
        with pytest.raises(jaxvmm.QuarantinedError) as ei:
            a.close()
        check_error(ei.value, op="close", entry="cuMemAddressFree", error="CUDA_ERROR_INVALID_VALUE",
                    slot_id=a_id)
        assert a.closed
        st = jaxvmm.stats()
        assert st["quarantined"] == 1 and st["quarantined_bytes"] == size
        (q,) = st["quarantine"]
        assert q["slot"] == a_id and q["address"] == hex(a_address)
        assert q["size"] == size and q["mapped_bytes"] == 0
        assert "cuMemAddressFree: CUDA_ERROR_INVALID_VALUE" in q["error"]

        # unrelated slots are created (and closed) while the fault stays armed; nothing blocks
        done = threading.Event()
        problems: list[BaseException] = []

        def churn():
            try:
                for i in range(2):
                    time.sleep(0.11)  # let the create path's periodic quarantine retry run too
                    s = jaxvmm.Slot(NBYTES, device=DEV)
                    assert s.address not in quarantined_addresses  # quarantined VA is still reserved
                    s.write(DATA)
                    assert s.read().tobytes() == DATA
                    quarantined_addresses.add(s.address)
                    try:
                        s.close()
                    except jaxvmm.QuarantinedError:
                        pass
                    else:
                        raise AssertionError("close should have been quarantined")
                    assert jaxvmm.stats()["quarantined"] == i + 2
            except BaseException as e:  # noqa: BLE001
                problems.append(e)
            finally:
                done.set()

        t = threading.Thread(target=churn, daemon=True)
        t.start()
        assert done.wait(60), "creating/closing slots blocked while a teardown was quarantined"
        assert not problems, problems
        st = jaxvmm.stats()
        assert st["quarantined"] == 3 and st["quarantined_bytes"] == 3 * size
        assert st["slots"] == base_acc["slots"]
        assert st["reserved_bytes"] == base_acc["reserved_bytes"] + 3 * size  # VA is still held
        assert st["mapped_bytes"] == base_acc["mapped_bytes"]  # the pages are back
        assert live() == plus(base_live, (0, 3, 0))
        (first,) = [q for q in st["quarantine"] if q["slot"] == a_id]
        assert first["attempts"] >= 2, "the create path should have retried the quarantine"

        # a retry while the fault persists keeps everything quarantined and counts the attempt
        attempts = {q["slot"]: q["attempts"] for q in st["quarantine"]}
        assert jaxvmm.retry_quarantine() == 3
        assert {q["slot"]: q["attempts"] for q in jaxvmm.stats()["quarantine"]} == {
            k: v + 1 for k, v in attempts.items()}
    finally:
        jt.clear_faults(DEV)

    before = vmm_calls()
    assert jaxvmm.retry_quarantine() == 0
    assert calls_since(before) == {"cuMemAddressFree": 3}, "the retry repeated finished stages"
    st = jaxvmm.stats()
    assert st["quarantine"] == [] and st["quarantined_bytes"] == 0
    assert accounting() == base_acc
    assert live() == base_live


@pytest.mark.parametrize("failing", ["cuMemUnmap", "cuMemRelease"])
def test_close_quarantine_partial_teardown(failing, no_leaks):
    base_live = live()
    base_acc = accounting()
    s = jaxvmm.Slot(NBYTES, device=DEV)
    sid = s.id
    with jt.fault(failing, error="CUDA_ERROR_INVALID_VALUE", device=DEV):
        with pytest.raises(jaxvmm.QuarantinedError, match="quarantined") as ei:
            s.close()
    assert ei.value.slot == sid and ei.value.stage == "close"
    assert isinstance(ei.value, jaxvmm.DriverError)
    assert jaxvmm.stats()["quarantined"] == 1
    before = vmm_calls()
    assert jaxvmm.retry_quarantine() == 0
    assert calls_since(before) == CALLS_DURING_RETRY[failing]
    assert live() == base_live
    assert accounting() == base_acc


def test_quarantine_retried_automatically_on_create(no_leaks):
    base_live = live()
    s = jaxvmm.Slot(NBYTES, device=DEV)
    with jt.fault("cuMemAddressFree", device=DEV):
        with pytest.raises(jaxvmm.QuarantinedError):
            s.close()
    assert jaxvmm.stats()["quarantined"] == 1
    time.sleep(0.15)  # past the 100 ms retry interval
    with jaxvmm.Slot(NBYTES, device=DEV):
        assert jaxvmm.stats()["quarantined"] == 0
    assert live() == base_live


@pytest.mark.parametrize(
    "forever, owned",
    [("cuMemRelease", (1, 1, 0)), ("cuMemAddressFree", (0, 1, 0))],
)
def test_create_rollback_failure_is_quarantined(forever, owned, no_leaks):
    base_live = live()
    base_acc = accounting()
    size = size_of(NBYTES)
    jt.arm_fault("cuMemSetAccess", nth=1, times=1, device=DEV)
    jt.arm_fault(forever, times=-1, device=DEV)
    try:
        with pytest.raises(jaxvmm.OutOfMemoryError) as ei:
            jaxvmm.Slot(NBYTES, device=DEV)
        err = ei.value
        msg = str(err)
        check_error(err, op="create", entry="cuMemSetAccess", error="CUDA_ERROR_OUT_OF_MEMORY", slot_id=None)
        assert "rollback failed and was quarantined" in msg and forever in msg, msg
        with pytest.raises(jaxvmm.NotFoundError):
            lib.slot(err.slot).info()  # never became a slot
        st = jaxvmm.stats()
        assert st["slots"] == base_acc["slots"]
        assert st["quarantined"] == 1
        (q,) = st["quarantine"]
        assert q["slot"] == err.slot and q["size"] == size
        assert q["mapped_bytes"] == owned[0] * size
        assert forever in q["error"]
        assert live() == plus(base_live, owned)
        assert st["reserved_bytes"] == base_acc["reserved_bytes"] + size
        assert st["mapped_bytes"] == base_acc["mapped_bytes"] + owned[0] * size
        assert jaxvmm.retry_quarantine() == 1  # still failing
    finally:
        jt.clear_faults(DEV)
    before = vmm_calls()
    assert jaxvmm.retry_quarantine() == 0
    if forever == "cuMemRelease":
        expected = {"cuMemRelease": 1, "cuMemAddressFree": 1}
    else:
        expected = {"cuMemAddressFree": 1}
    assert calls_since(before) == expected
    assert live() == base_live
    assert accounting() == base_acc


def test_create_rollback_retry_keeps_created_closed_balanced(no_leaks):
    before = jaxvmm.stats()
    jt.arm_fault("cuMemSetAccess", device=DEV)
    jt.arm_fault("cuMemRelease", times=-1, device=DEV)
    try:
        with pytest.raises(jaxvmm.OutOfMemoryError):
            jaxvmm.Slot(NBYTES, device=DEV)
    finally:
        jt.clear_faults(DEV)
    assert jaxvmm.retry_quarantine() == 0
    after = jaxvmm.stats()
    def balance(s):
        return s["created"] - s["closed"] - s["slots"]

    assert balance(after) == balance(before)
