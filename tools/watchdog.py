"""Run a Python script; if it is still running after TIMEOUT seconds, print jaxvmm's engine and slot
stats and every thread's stack, then exit with status 3 (for GPU runs that might hang).

    python3 tools/watchdog.py TIMEOUT script.py [args...]
"""
import faulthandler
import os
import runpy
import sys
import threading
import time


def main() -> None:
    timeout, script = float(sys.argv[1]), sys.argv[2]
    sys.argv = sys.argv[2:]

    def dog():
        time.sleep(timeout)
        print(f"\nwatchdog: still running after {timeout:.0f} s", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)

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
