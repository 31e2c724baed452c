"""Ticket lifetimes that do not depend on Python seeing the token (jaxvmm.collect()), and failures that never change the state of unrelated tickets. cpu backend, each in
its own process so engine counts start at zero."""

from __future__ import annotations

import textwrap

from conftest import run_in_subprocess

PRELUDE = textwrap.dedent("""
    import gc, jax, jax.numpy as jnp, numpy as np, jaxvmm
    from jax import lax
    def live():
        return jaxvmm.engine_stats()[DEV]["tickets_live"]
    def pinned():
        return jaxvmm.engine_stats()[DEV]["pinned_in_use_bytes"]
""")


def ok(code, device="cpu"):
    """Runs ``code`` after PRELUDE in a fresh process whose default device is ``device`` ("cpu" or
    "cuda:0", named ``DEV`` there as its key in engine_stats()); it must print OK. ``SORTS``: how many
    sorts of 2M floats there take 0.1-1 s (a window between an offload and its reload)."""
    dev = {"cpu": "cpu:0"}.get(device, device)
    env = {"JAX_PLATFORMS": "cpu" if dev == "cpu:0" else "cuda"}
    head = f"DEV = {dev!r}\nSORTS = {6 if dev == 'cpu:0' else 400}\n"
    r = run_in_subprocess(head + PRELUDE + textwrap.dedent(code), env=env, timeout=240)
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "OK" in r.stdout, r.stdout


def test_ticket_reloaded_in_one_cond_branch_is_freed_when_unreachable():
    ok("""
        x = jnp.arange(1 << 18, dtype=jnp.float32)  # 1 MiB
        f = jax.jit(lambda x, p: (lambda t: lax.cond(p, lambda: jaxvmm.reload(t), lambda: x * 0))(jaxvmm.offload(x)))
        assert np.array_equal(np.asarray(f(x, True)), np.asarray(x))
        jaxvmm.synchronize()
        assert live() == 0
        peak = []
        for step in range(100):
            y = f(x, False)               # the ticket never leaves the computation and is never reloaded
            if step % 10 == 9:
                jaxvmm.collect()          # frees those issued before it: at most the last 10 steps' remain
                peak.append((live(), pinned()))
        assert float(y.sum()) == 0.0
        assert all(n <= 10 and b <= 10 * x.nbytes for n, b in peak), peak  # constant host memory across the run
        assert np.array_equal(np.asarray(f(x, True)), np.asarray(x))
        jaxvmm.synchronize()
        jaxvmm.collect()
        assert live() == 0 and pinned() == 0
        jaxvmm.check()
        print("OK")
    """)


def test_collect_waits_for_a_dropped_computation_that_still_reloads_its_ticket(platform_device):
    """A computation whose outputs were all dropped may still be between an offload and its reload when
    collect() runs: the ticket's token lives only inside it, and collect() must wait for it rather
    than free the ticket under the reload."""
    ok("""
        import time
        from jaxvmm.ops import Ticket
        def body(x):
            t = jaxvmm.offload(x)
            y = x + (t.token[0] * 0).astype(x.dtype)   # after the offload
            y = lax.fori_loop(0, SORTS, lambda i, y: jnp.sort(y * 1.0001), y)  # 0.1-1 s to the reload
            dep = (y[0] * 0).astype(jnp.uint32)         # the reload comes after the sorts
            return jaxvmm.reload(Ticket(t.token + dep, t.shape, t.dtype)) + 0 * y
        f = jax.jit(body)
        x = jnp.asarray(np.random.default_rng(0).standard_normal(1 << 21).astype(np.float32))
        want = np.asarray(x)
        assert np.array_equal(np.asarray(f(x)), want)
        jaxvmm.synchronize()
        for _ in range(3):
            before = jaxvmm.engine_stats()[DEV]
            f(x)                                        # dropped at once
            deadline = time.monotonic() + 60
            while jaxvmm.engine_stats()[DEV]["offloads"] == before["offloads"]:
                assert time.monotonic() < deadline
                time.sleep(0.001)
            jaxvmm.collect()                            # the offload ran; its reload has not
            after = jaxvmm.engine_stats()[DEV]
            assert after["reloads"] == before["reloads"] + 1, (before, after)
            assert live() == 0, live()
            jaxvmm.check()
        print("OK")
    """, platform_device)


def test_ticket_dropped_by_python_outlives_a_dropped_computation_that_reloads_it(platform_device):
    """A Ticket passed to a computation whose outputs were all dropped, then dropped by Python: the
    computation still reloads it, so it must stay alive until that computation has finished."""
    ok("""
        import time
        from jaxvmm.ops import Ticket
        def body(tok, x):
            y = lax.fori_loop(0, SORTS, lambda i, y: jnp.sort(y * 1.0001), x)  # 0.1-1 s before the reload
            dep = (y[0] * 0).astype(jnp.uint32)
            return jaxvmm.reload(Ticket(tok + dep, x.shape, x.dtype)) + 0 * y
        f = jax.jit(body)
        x = jnp.asarray(np.random.default_rng(1).standard_normal(1 << 21).astype(np.float32))
        t = jaxvmm.offload(x)
        assert np.array_equal(np.asarray(f(t.token, x)), np.asarray(x))
        for _ in range(3):
            t = jaxvmm.offload(x)
            jaxvmm.synchronize()
            before = jaxvmm.engine_stats()[DEV]
            f(t.token, x)                               # dropped at once; it reloads t
            del t
            jaxvmm.check()                              # a jaxvmm call: tickets whose tokens died are handled
            jaxvmm.synchronize()
            after = jaxvmm.engine_stats()[DEV]
            assert after["reloads"] == before["reloads"] + 1 and after["drops"] == before["drops"], (before, after)
            assert live() == 0, live()
            jaxvmm.check()
        print("OK")
    """, platform_device)


def test_ticket_passed_through_jits_that_run_ahead_stays_alive():
    """A ticket carried in a state that jitted steps pass through, with dispatch running ahead (nothing
    blocks): each step's output token is a new array holding the value, not ready when the one before
    it dies, and the token it was copied from is dead by the time the oldest one's barrier is ready."""
    ok("""
        x = jnp.arange(1 << 16, dtype=jnp.float32)
        big = jnp.asarray(np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32))
        @jax.jit
        def step(state, b):
            return state, lax.fori_loop(0, 4, lambda i, b: jnp.sort(b * 1.0001), b)
        state = {"t": jaxvmm.offload(x)}
        for i in range(20):
            state, big = step(state, big)
        assert np.array_equal(np.asarray(jaxvmm.reload(state["t"])), np.asarray(x))
        jaxvmm.check()
        jaxvmm.synchronize()
        assert live() == 0, live()
        print("OK")
    """)


def test_ticket_passed_through_a_jit_that_donates_it_stays_alive():
    """The state holding the ticket is donated to each step, which returns it: the donated token can
    no longer be read, and its copy is not ready yet."""
    ok("""
        x = jnp.arange(1 << 16, dtype=jnp.float32)
        big = jnp.asarray(np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32))
        init = jax.jit(lambda t: {"t": t})
        step = jax.jit(lambda state, b: (state, lax.fori_loop(0, 4, lambda i, b: jnp.sort(b * 1.0001), b).sum()),
                       donate_argnums=0)
        def make_state():
            t = jaxvmm.offload(x)
            return init(t)
        state = make_state()
        for i in range(3):
            state, loss = step(state, big)
            float(loss)
        assert np.array_equal(np.asarray(jaxvmm.reload(state["t"])), np.asarray(x))
        jaxvmm.check()
        print("OK")
    """)


def test_collect_in_another_thread_leaves_tickets_of_computations_dispatched_meanwhile():
    """collect() decides which tickets are unreachable from the tickets issued before it waited for the
    computations in flight: one offloaded by a computation dispatched while it waited is not its to
    judge (its reload may still be ahead)."""
    ok("""
        import threading, time
        x = jnp.asarray(np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32))
        @jax.jit
        def step(x):
            t = jaxvmm.offload(x)
            y = lax.fori_loop(0, 4, lambda i, y: jnp.sort(y * 1.0001), jaxvmm.after(t, x))
            return jaxvmm.reload(t, after=y) + 0 * y[0]
        assert np.array_equal(np.asarray(step(x)), np.asarray(x))
        stop = threading.Event()
        def collector():
            while not stop.is_set():
                jaxvmm.collect()
                time.sleep(0.005)
        th = threading.Thread(target=collector)
        th.start()
        try:
            for i in range(25):
                assert np.array_equal(np.asarray(step(x)), np.asarray(x)), i
            jaxvmm.check()
        finally:
            stop.set()
            th.join()
        print("OK")
    """)


def test_lifetimes_survive_arrays_donated_by_another_thread():
    """Another thread donates arrays while offload, reload, synchronize() and collect() look at every live
    array: an array deleted between two of their checks is finished, not an error."""
    ok("""
        import threading, time
        state = [jnp.full((64,), float(i)) for i in range(300)]
        step = jax.jit(lambda s: [a * 1.0001 for a in s], donate_argnums=0)
        state = step(state)
        stop = threading.Event()
        errs = []
        def trainer():
            global state
            while not stop.is_set():
                state = step(state)
        x = jnp.ones(256)
        def lifetimes():
            try:
                while not stop.is_set():
                    t = jaxvmm.offload(x)
                    jaxvmm.reload(t)
                    del t
                    jaxvmm.synchronize()
                    jaxvmm.collect()
            except Exception as e:
                errs.append(repr(e))
                stop.set()
        threads = [threading.Thread(target=trainer), threading.Thread(target=lifetimes)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4 and not stop.is_set():
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join()
        assert not errs, errs
        print("OK")
    """)


def test_lifetimes_under_disable_jit():
    """jax.disable_jit(): offload and reload run, and a dropped ticket is still freed."""
    ok("""
        x = jnp.arange(1024, dtype=jnp.float32)
        t = jaxvmm.offload(x)
        del t
        with jax.disable_jit():
            y = jaxvmm.reload(jaxvmm.offload(x))
            jaxvmm.synchronize()
        assert np.array_equal(np.asarray(y), np.asarray(x))
        jaxvmm.synchronize()
        assert live() == 0, live()
        print("OK")
    """)


def test_a_failed_computation_does_not_make_synchronize_raise():
    """A live array whose computation failed is finished: synchronize() and collect() wait for it and
    go on (its error is raised where the array is used); the engine's own error is raised once, by check()."""
    ok("""
        x = jnp.asarray(np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32))
        t = jaxvmm.offload(x)
        jaxvmm.reload(t)
        y = jax.jit(jaxvmm.reload)(t)  # a reload of a used ticket: 0xFF, and the engine records the error
        # Its handler raises that error when it runs, after the sorts: z's computation fails.
        z = jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(lax.fori_loop(0, 3, lambda i, y: jnp.sort(y), x))))(x)
        try:
            z.block_until_ready()
        except Exception:
            pass
        jaxvmm.synchronize()
        jaxvmm.collect()
        jaxvmm.synchronize()
        jaxvmm.check()
        print("OK")
    """)


def test_synchronize_frees_a_ticket_python_dropped_before_it(platform_device):
    """After del and synchronize() the engine itself (read without a jaxvmm call that would collect
    again) holds no ticket: synchronize()'s own waiting must not keep the dead token referenced."""
    ok("""
        from jaxvmm._native import lib
        from jaxvmm._devices import target_of
        tgt = target_of(DEV)
        x = jnp.ones((3, 1001), jnp.float32)
        f = jax.jit(jaxvmm.offload)
        for _ in range(3):
            t = f(x)
            jax.block_until_ready(t.token)
            jaxvmm.synchronize()
            assert lib.engine(tgt.backend, tgt.ordinal).stats()["tickets_live"] == 1
            del t
            jaxvmm.synchronize()
            assert lib.engine(tgt.backend, tgt.ordinal).stats()["tickets_live"] == 0
        print("OK")
    """, platform_device)


def test_tickets_dropped_in_a_loop_that_blocks_each_step_are_freed_as_it_runs(platform_device):
    """Each step returns a new ticket and drops the last one; every jaxvmm call sees the newest token
    not ready yet. The drops must not wait for it (it cannot hold an older step's value): the engine
    holds a bounded number of tickets while the loop runs, not one per step."""
    ok("""
        from jaxvmm._native import lib
        from jaxvmm._devices import target_of
        tgt = target_of(DEV)
        x = jnp.ones((1 << 16,), jnp.float32)
        step = jax.jit(lambda x: (jaxvmm.offload(x), x.sum()))
        most = 0
        for i in range(30):
            t, loss = step(x)       # the previous step's ticket dies here, never reloaded
            float(loss)
            most = max(most, lib.engine(tgt.backend, tgt.ordinal).stats()["tickets_live"])
        assert most <= 8, most  # a few steps behind at most (29 if every drop waited for the newest token)
        del t
        jaxvmm.synchronize()
        assert lib.engine(tgt.backend, tgt.ordinal).stats()["tickets_live"] == 0
        print("OK")
    """, platform_device)


def test_dropped_vjp_fn_frees_its_tickets_and_a_kept_one_keeps_them():
    ok("""
        layer = jaxvmm.checkpoint(lambda x: jnp.sin(jnp.sin(x) * 2),
                                  policy=jaxvmm.policies.offload_everything_saveable(min_bytes=0))
        x = jnp.linspace(-3, 3, 1 << 16, dtype=jnp.float32)
        g = jax.jit(lambda x: jax.vjp(layer, x))
        for _ in range(150):
            out, vjp_fn = g(x)
            del vjp_fn                     # dropped uncalled: its residual tokens die inside jax
        jaxvmm.collect()
        assert live() == 0 and pinned() == 0, (live(), pinned())
        out, vjp_fn = g(x)                 # kept: its tickets stay reloadable across collect()
        jaxvmm.collect()
        n = live()
        assert n > 0
        (gx,) = jax.jit(lambda f, c: f(c))(vjp_fn, jnp.ones_like(out))
        (want,) = jax.vjp(jax.checkpoint(lambda x: jnp.sin(jnp.sin(x) * 2)), x)[1](jnp.ones_like(out))
        assert np.array_equal(np.asarray(gx), np.asarray(want))
        del vjp_fn
        jaxvmm.synchronize()
        assert live() == 0
        jaxvmm.check()
        print("OK")
    """)


def test_tickets_held_by_live_arrays_survive_collect():
    ok("""
        xs = [jnp.full((5000,), float(i), jnp.float32) for i in range(6)]
        ts = jax.jit(lambda xs: [jaxvmm.offload(x) for x in xs])(xs)
        raw = ts[2].token                    # only a raw token array holds this one
        keep = [ts[0], ts[1]]
        del ts
        gc.collect()
        jaxvmm.collect()                     # tickets 3, 4, 5: nothing holds their tokens
        assert live() == 3, live()
        assert np.array_equal(np.asarray(jaxvmm.reload(keep[1])), np.asarray(xs[1]))
        assert np.array_equal(np.asarray(jaxvmm.reload(jaxvmm.Ticket(raw, (5000,), np.float32))), np.asarray(xs[2]))
        assert np.array_equal(np.asarray(jaxvmm.reload(keep[0])), np.asarray(xs[0]))
        jaxvmm.check()
        print("OK")
    """)


def test_failed_offload_in_jit_is_reported_once_and_leaves_other_tickets_alone():
    ok("""
        a = jnp.full((1 << 16,), 7.0, jnp.float32)
        t_valid = jaxvmm.offload(a)                       # a valid ticket, taken before the failure
        jaxvmm.synchronize()
        old = jaxvmm.configure()["host_pool_limit"]
        jaxvmm.configure(host_pool_limit="1M")
        big = jnp.zeros((1 << 20,), jnp.float32)          # 4 MiB: over the cap
        g = jax.jit(lambda x, y: (jaxvmm.offload(x), jaxvmm.offload(y)))
        try:
            jax.block_until_ready(g(a, big))
        except Exception as e:
            err = e
        else:
            raise SystemExit("the offload past the pool cap did not fail")
        assert "jaxvmm" in str(err)
        jaxvmm.configure(host_pool_limit=old)
        # Reported once, by the call that failed: nothing later re-raises it.
        jaxvmm.check()
        jaxvmm.stats()
        jaxvmm.synchronize()
        t2 = jaxvmm.offload(big)
        assert np.array_equal(np.asarray(jaxvmm.reload(t2)), np.asarray(big))
        assert np.array_equal(np.asarray(jaxvmm.reload(t_valid)), np.asarray(a))  # not "already reloaded"
        # The aborted execution's own ticket (its first offload) reached nobody: collect() frees it.
        jaxvmm.collect()
        assert live() == 0 and pinned() == 0, (live(), pinned())
        jaxvmm.check()
        print("OK")
    """)


def test_a_ready_dying_token_behind_one_still_waiting_is_taken_out():
    """The dying tokens hold one still waiting for a computation in flight, then a ready one: the ready
    one is taken out (its ticket freed) and the waiting one stays. (The dying list once took entries out
    with list.remove, which compared two uint32[2] token arrays with ==: ValueError, seen in CI.)"""
    ok("""
        import weakref
        from jaxvmm import _lifetimes as lt
        class Pending:                                   # a computation that has not finished
            def is_deleted(self): return False
            def is_ready(self): return False
        waiting, ready = jaxvmm.offload(jnp.ones(64)), jaxvmm.offload(jnp.zeros(64))
        jaxvmm.synchronize()
        pending = Pending()
        with lt._lock:
            for t in (waiting, ready):
                lt._tracked.pop(id(t.token))
                lt._dying[id(t.token)] = lt._Dying(t.token)  # dead: read, then donated
            lt._dying[id(waiting.token)].barrier = [weakref.ref(pending)]  # dead, and waiting for ever
        for _ in range(100):
            lt._collect()
            with lt._lock:
                if len(lt._dying) == 1:
                    break
        with lt._lock:
            assert list(lt._dying) == [id(waiting.token)], lt._dying
            lt._dying.clear()
        jaxvmm.synchronize()
        assert live() == 1, live()
        print("OK")
    """)


def test_several_dropped_token_arrays_are_freed_by_one_collect():
    """Tokens that die together are taken out of the dying list together. It used list.remove, which
    compares entries with ==: two entries holding different uint32[2] token arrays compared as arrays
    (ValueError: the truth value of an array with more than one element is ambiguous)."""
    ok("""
        g = jax.jit(lambda x: jaxvmm.offload(x).token)   # tokens that reach Python: tracked, freed when they die
        xs = [jnp.full(4096, float(i)) for i in range(4)]
        toks = [g(x) for x in xs]
        jax.block_until_ready(toks)
        jaxvmm.synchronize()
        assert live() == 4, live()
        del toks
        gc.collect()
        jaxvmm.collect()
        jaxvmm.synchronize()
        assert live() == 0, live()
        print("OK")
    """)


def test_a_ticket_dropped_in_one_thread_outlives_its_reload_while_another_thread_calls_jaxvmm():
    """Thread B offloads, dispatches a computation that reloads the ticket after some work, drops its
    result and the ticket; thread A calls jaxvmm meanwhile. On the cpu platform a fence waits only for
    its own thread's computations: a death processed by A once freed the ticket before B's reload ran
    ("ticket N is gone", raised by B's next offload)."""
    ok("""
        import threading, time
        x = jnp.arange(4096, dtype=jnp.float32)
        big = jnp.ones((1200, 1200), jnp.float32)
        @jax.jit
        def consume(t, m):
            return jaxvmm.reload(t, after=(m @ m @ m)).sum()
        consume(jaxvmm.offload(x), big).block_until_ready()
        jaxvmm.synchronize()
        done, failures = threading.Event(), []
        def b():
            try:
                for i in range(10):
                    try:
                        t = jaxvmm.offload(x)
                        t.token.block_until_ready()
                        consume(t, big)
                        del t
                        time.sleep(0.3)
                    except Exception as e:
                        failures.append(str(e)[:200])
            finally:
                done.set()
        def a():
            while not done.is_set():
                jaxvmm.engine_stats()
                time.sleep(0.001)
        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert failures == [], failures
        jaxvmm.synchronize()
        assert live() == 0, live()
        jaxvmm.check()
        print("OK")
    """)


def test_one_collect_frees_the_tickets_of_steps_still_in_flight_when_it_is_called():
    """Steps dispatched and still running when collect() is called abandon their tickets (offloaded,
    reloaded only in the branch not taken): one call frees them all (it once judged only the tickets
    issued before it was called, so a second call was needed)."""
    ok("""
        x = jnp.arange(1 << 16, dtype=jnp.float32)
        m = jnp.ones((600, 600), jnp.float32)
        f = jax.jit(lambda x, p, m: (lambda t: lax.cond(p, lambda: jaxvmm.reload(t),
                                                        lambda: x * 0 + (m @ m @ m).sum()))(jaxvmm.offload(x)))
        f(x, True, m).block_until_ready()
        jaxvmm.synchronize()
        for _ in range(10):
            y = f(x, False, m)
        assert jaxvmm.collect() == 10
        assert live() == 0 and pinned() == 0, (live(), pinned())
        print("OK")
    """)
