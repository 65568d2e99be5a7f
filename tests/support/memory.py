"""The peak resident memory of this process, for jobs that measure what a step costs.

``resource.getrusage(...).ru_maxrss`` is no use in a job started by the test process: Linux carries the
parent's peak over fork and exec, so a child of a large pytest process starts at that peak and a growth
below it is not seen. ``VmHWM`` belongs to the process's own memory map, new at exec (and at fork, from the
resident size then: a warm worker measures its own growth too).
"""

from __future__ import annotations


def peak_resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")
