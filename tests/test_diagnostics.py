"""Hang diagnostics (no GPU needed): jaxvmm's native stack dumper and tools/watchdog.py, which a GPU run
uses when a program does not finish. Each runs in a subprocess: the dumper signals every thread."""

from __future__ import annotations

import pathlib
import sys
import textwrap

from conftest import run_in_subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_native_stacks_list_every_thread_with_a_stack():
    """Every thread of the process is listed and answers with its return addresses, including one blocked
    in a lock (the case a hang leaves behind)."""
    r = run_in_subprocess(textwrap.dedent("""
        import os, threading, time
        from jaxvmm import _jaxvmm as lib
        held = threading.Lock(); held.acquire()
        ts = [threading.Thread(target=held.acquire, daemon=True, name=f"blocked{i}") for i in range(3)]
        for t in ts: t.start()
        time.sleep(0.2)
        n = lib.debug_thread_stacks()
        print("answered", n, "tasks", len(os.listdir("/proc/self/task")), flush=True)
    """), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    answered, tasks = (int(w) for w in r.stdout.split()[1::2])
    heads = [ln for ln in r.stderr.splitlines() if ln.startswith("thread ")]
    assert len(heads) == tasks and answered == tasks, (answered, tasks, r.stderr[-3000:])
    assert sum("[the dumping thread]" in h for h in heads) == 1, heads
    # Every answer carries frames (backtrace_symbols_fd lines end with the address in brackets).
    blocks = r.stderr.split("\nthread ")[1:]
    assert all(sum(ln.rstrip().endswith("]") for ln in b.splitlines()[1:]) >= 2 for b in blocks), r.stderr[-3000:]


def test_watchdog_prints_python_and_native_stacks_of_a_stuck_script(tmp_path):
    """tools/watchdog.py: a script still running after the timeout is stopped with status 3, after its
    Python stacks and every native thread's stack are printed."""
    script = tmp_path / "stuck.py"
    script.write_text("import threading\nimport jaxvmm\nthreading.Event().wait(120)\n")
    code = f"import runpy, sys; sys.argv = ['watchdog.py', '3', {str(script)!r}]; " \
           f"runpy.run_path({str(ROOT / 'tools' / 'watchdog.py')!r}, run_name='__main__')"
    r = run_in_subprocess(code, timeout=180)
    assert r.returncode == 3, (r.returncode, r.stderr[-3000:])
    assert "watchdog: still running after 3 s" in r.stderr
    assert "stuck.py" in r.stderr  # the Python stack of the main thread
    assert r.stderr.count("\nthread ") >= 2, r.stderr[-3000:]  # native stacks, one block per thread


def test_a_late_answer_is_not_taken_for_the_next_threads_stack():
    """DumpThreadStacks waits per_thread_ms (300) for each thread, then moves on with g_done cleared.
    A thread that answers late (its signal was blocked for a while, or it was in the kernel) sets g_done
    during the next thread's wait and writes its frames under that thread's header: the next thread,
    which never answered, is counted and shown as answered."""
    code = textwrap.dedent('''
        import signal, threading, time, os
        from jaxvmm import _jaxvmm as lib
        sig = signal.SIGRTMIN + 7
        go = threading.Event(); hold = threading.Event()
        def late():   # blocks the signal; unblocks 0.45 s into the dump (the next thread's turn)
            signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
            hold.set(); go.wait(); time.sleep(0.45)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
            time.sleep(5)
        def mute():   # never answers
            signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
            time.sleep(5)
        a = threading.Thread(target=late, daemon=True, name="late"); a.start(); hold.wait()
        b = threading.Thread(target=mute, daemon=True, name="mute"); b.start()
        time.sleep(0.1)
        tasks = len(os.listdir("/proc/self/task"))
        go.set()
        n = lib.debug_thread_stacks()
        print("answered", n, "tasks", tasks, "late", a.native_id, "mute", b.native_id, flush=True)
    ''')
    r = run_in_subprocess(code, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    answered, tasks, late, mute_tid = (int(w) for w in r.stdout.split()[1::2])
    heads = r.stderr.split("\nthread ")[1:]
    order = [int(h.split()[0]) for h in heads]
    assert order.index(mute_tid) == order.index(late) + 1, (order, late, mute_tid)  # /proc lists by tid
    mute = heads[order.index(mute_tid)]
    assert "no answer" in mute, mute
    assert answered == tasks - 2, (answered, tasks, r.stderr[-2000:])
