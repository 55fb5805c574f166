"""Processes that try to outlive their sandbox or worker, and how a test finds them (the sandbox's and
the worker benchmark's tests share them)."""
import os
import time


def _alive_with(marker: str) -> list[int]:
    """Host pids whose command line carries `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


DETACH = """import os, subprocess, sys
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', '{marker}-setsid'], start_new_session=True)
if os.fork() == 0:  # a double fork: the grandchild's parent is gone before close
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)', '{marker}-daemon'])
    os._exit(0)
print('spawned')"""


def alive_when(marker: str, done, seconds: float) -> list[int]:
    """The pids `_alive_with(marker)` once `done(their count)` holds, or after `seconds` (processes start and
    end asynchronously)."""
    deadline = time.monotonic() + seconds
    while not done(len(found := _alive_with(marker))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
