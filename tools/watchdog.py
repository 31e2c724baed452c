"""Run a Python script; if it is still running after TIMEOUT seconds, print jaxvmm's engine and slot
stats, every Python thread's stack and every native thread's stack, then exit with status 3 (for GPU runs that might hang).

    python3 tools/watchdog.py TIMEOUT script.py [args...]
"""
import faulthandler
import os
import runpy
import sys
import threading
import time


def native_stacks() -> None:
    """Every thread's native stack (jaxvmm's signal-handler dumper), with jaxvmm's frames named by
    addr2line where it is installed (the extension's symbols are hidden from backtrace_symbols)."""
    import re
    import shutil
    import subprocess
    import tempfile

    try:
        from jaxvmm import _jaxvmm as lib
    except Exception as e:  # noqa: BLE001  (diagnostics only)
        print("watchdog: no native stacks:", e, file=sys.stderr, flush=True)
        return
    with tempfile.TemporaryFile(mode="w+") as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            lib.debug_thread_stacks()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    frame = re.compile(r"^(\S+)\(\+(0x[0-9a-f]+)\)")
    a2l = shutil.which("addr2line")
    out = []
    for line in text.splitlines():
        m = frame.match(line)
        if m and a2l and "_jaxvmm" in m.group(1):
            pc = hex(int(m.group(2), 16) - 1)  # a return address: the call is the instruction before it
            r = subprocess.run([a2l, "-C", "-f", "-e", m.group(1), pc], capture_output=True, text=True)
            line += "  " + (r.stdout.splitlines() or ["?"])[0]
        out.append(line)
    print("\n".join(out), file=sys.stderr, flush=True)


def main() -> None:
    timeout, script = float(sys.argv[1]), sys.argv[2]
    sys.argv = sys.argv[2:]

    def dog():
        time.sleep(timeout)
        print(f"\nwatchdog: still running after {timeout:.0f} s", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        native_stacks()

        def stats():  # may block if an engine lock is held by a stuck thread: bounded below
            try:
                import jaxvmm

                print("engine_stats:", jaxvmm.engine_stats(), file=sys.stderr)
                print("stats:", {k: v for k, v in jaxvmm.stats().items() if k != "quarantine"}, file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001  (diagnostics only)
                print("watchdog: stats failed:", e, file=sys.stderr)

        t = threading.Thread(target=stats, daemon=True)
        t.start()
        t.join(10)
        os._exit(3)

    threading.Thread(target=dog, daemon=True).start()
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
