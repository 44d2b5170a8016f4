"""netproxy run's signal handling (netproxy/cli/signals.py): a stop signal that arrives while the
main thread holds a lock the stop needs must not hang, and SIGUSR1 prints the threads' stacks.

Each case runs in a child interpreter (signal handlers are process-wide) with a timeout: a hang
is the failure being tested for."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    from netproxy.cli.signals import on_stop_signals

    held = threading.Lock()       # not reentrant, like the one inside threading.Event
    stopped = threading.Event()

    def stop(signum):
        with held:                # what Event.set() does: take the lock the main thread holds
            print("stop", signum, threading.current_thread() is threading.main_thread(), flush=True)
        stopped.set()

    on_stop_signals(stop)
    with held:
        # The signal is handled at the next bytecode boundary of this thread, inside the lock.
        os.kill(os.getpid(), signal.{sig})
        time.sleep(0.3)
    print("stopped" if stopped.wait(5) else "not stopped", flush=True)
""")


def _child(sig: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CHILD.format(sig=sig)], capture_output=True, text=True,
                          timeout=20)


def test_a_stop_signal_inside_a_held_lock_stops_from_another_thread() -> None:
    for sig, number in (("SIGTERM", 15), ("SIGINT", 2)):
        try:
            proc = _child(sig)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{sig} while the main thread held the lock hung the process") from None
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == [f"stop {number} False", "stopped"], proc.stdout + proc.stderr


def test_sigusr1_prints_every_threads_stack_and_goes_on() -> None:
    child = textwrap.dedent("""
        import os, signal, threading, time
        from netproxy.cli.signals import on_stop_signals

        def parked():
            time.sleep(5)

        on_stop_signals(lambda signum: None)
        threading.Thread(target=parked, name="parked", daemon=True).start()
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        print("still running", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0 and proc.stdout == "still running\n", proc.stdout + proc.stderr
    assert "in parked" in proc.stderr and "Current thread" in proc.stderr, proc.stderr
