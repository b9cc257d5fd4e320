"""This process's resident memory on Linux, now and at its peak, from /proc/self/status (VmRSS, VmHWM).

The peak is the kernel's high-water mark, which writing 5 to /proc/self/clear_refs resets to the current RSS
(Linux >= 4.0), so a measurement can start anywhere. Not `getrusage(RUSAGE_SELF).ru_maxrss`: in a process that
another started (fork or vfork, then exec) it is the larger of this process's mark and the parent's at the exec,
and resetting the mark does not lower it. Measured: a child of a 2 GiB process reports a 2 GiB ru_maxrss before it
allocates anything; ranks started by a pytest process that earlier tests had grown reported its size as their own.
"""

from __future__ import annotations

import re
from pathlib import Path

STATUS = Path("/proc/self/status")


def _field(name: str) -> int:
    return int(re.search(rf"^{name}:\s+(\d+) kB", STATUS.read_text(), re.M).group(1)) * 1024


def rss_bytes() -> int:
    return _field("VmRSS")


def peak_bytes() -> int:
    """The high-water mark of this process's RSS since it started or since the last `reset_peak`."""
    return _field("VmHWM")


def reset_peak() -> int:
    """Make the current RSS the start of the peak; returns it."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_bytes()
