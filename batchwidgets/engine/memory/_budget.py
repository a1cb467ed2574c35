"""Memory budgets: sizes as people write them ("512MB", "16GiB", "1G"), and how much host
memory this process can still take (MemAvailable, its cgroup, its rlimits).

Usage:
    >>> from batchwidgets.engine.memory import parse_bytes
    >>> parse_bytes("512M")
    536870912
"""

from __future__ import annotations

import math
import os
import re

# NOTE [ Size units ]
# "512MB" is decimal (10**6) and "512MiB" binary (2**20), as the SI and IEC prefixes say. A single
# letter ("512M", "1G", "1.5g") is binary, the way Docker (--memory 512m), Slurm (--mem=16G),
# ``ulimit`` and PyTorch's own out-of-memory messages write sizes. Case does not matter.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_UNITS_HELP = ("units: B; KB, MB, GB, TB = 1000**n; KiB, MiB, GiB, TiB = 1024**n; K, M, G, T "
               "= 1024**n as Docker and Slurm write them")


def parse_bytes(value: int | float | str | None, name: str = "budget") -> int | None:
    """A size in bytes from an int, a float or a string (see NOTE [ Size units ]).

    ``"512MB"`` -> 512_000_000 and ``"1.5GB"`` -> 1_500_000_000 (decimal); ``"16GiB"`` ->
    17_179_869_184 (binary); ``"512M"`` -> 536_870_912 and ``"1.5g"`` -> 1_610_612_736 (one
    letter: binary, as Docker and Slurm write it); ``"1e9"`` -> 1_000_000_000; ``2**20`` ->
    1_048_576. Raises ValueError for what is not a positive, finite size, TypeError for
    what is not a number or a string.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{name} should be bytes as an int or a string such as '512MB' or "
                        f"'16GiB', but got {name}={value!r}.")
    given = value
    unit = ""
    if isinstance(value, str):
        match = _BUDGET_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name} should be a size such as '512MB', '1.5GB', '16GiB' or "
                             f"'512M' ({_UNITS_HELP}), but got {name}={value!r}.")
        value = float(match.group(1)) * _UNITS[unit]
    if unit in ("", "b") and math.isfinite(value) and value != int(value):  # budget=1.5
        raise ValueError(f"{name} should be a whole number of bytes, or a size with its unit "
                         f"such as '1.5GB' or '1.5GiB', but got {name}={given!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} should be a finite number of bytes, but got {name}={given!r}; "
                         f"leave it out (None) for no budget.")
    if value < 1:
        raise ValueError(f"{name} should be a positive number of bytes, but got {name}={given!r}.")
    return int(value)


def available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where it cannot be read."""
    return _meminfo("MemAvailable")


def _meminfo(key: str, path: str = "/proc/meminfo") -> int | None:
    """A ``key: N kB`` line of /proc/meminfo or /proc/self/status, in bytes."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_number(path: str) -> int | None:
    try:
        with open(path) as file:
            text = file.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _cgroup_dirs() -> list[tuple[str, str, str]]:
    """(directory, limit file, usage file) of this process's memory cgroup and its parents."""
    found = []
    try:
        with open("/proc/self/cgroup") as lines:
            entries = [line.strip().split(":", 2) for line in lines]
    except OSError:
        return found
    for _, controllers, path in (e for e in entries if len(e) == 3):
        if controllers == "":  # cgroup v2 (unified)
            root, files = "/sys/fs/cgroup", ("memory.max", "memory.current")
            if not os.path.exists(os.path.join(root, "cgroup.controllers")):
                root = "/sys/fs/cgroup/unified"
        elif "memory" in controllers.split(","):  # cgroup v1
            root, files = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes",
                                                    "memory.usage_in_bytes")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # a container sees its own cgroup as the root
            found.append((os.path.join(root, *parts[:depth]), *files))
    return found


def cgroup_available_bytes() -> int | None:
    """What this process's memory cgroup (v1 or v2, the tightest level) still lets it use."""
    room = None
    for directory, limit_file, usage_file in _cgroup_dirs():
        limit = _read_number(os.path.join(directory, limit_file))
        if limit is None or limit >= 2**60:  # v1 writes "no limit" as a huge number
            continue
        usage = _read_number(os.path.join(directory, usage_file)) or 0
        room = max(0, limit - usage) if room is None else min(room, max(0, limit - usage))
    return room


def rlimit_available_bytes() -> int | None:
    """What ``ulimit -v`` (RLIMIT_AS) and ``ulimit -d`` (RLIMIT_DATA) still let this process map."""
    try:
        import resource  # POSIX only
    except ImportError:
        return None
    room = None
    for limit_name, used_key in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        soft, _ = resource.getrlimit(getattr(resource, limit_name))
        if soft == resource.RLIM_INFINITY:
            continue
        used = _meminfo(used_key, "/proc/self/status") or 0
        left = max(0, soft - used)
        room = left if room is None else min(room, left)
    return room


def available_memory_bytes() -> int | None:
    """The host memory this process can still take: the smallest of MemAvailable, its cgroup's
    room (a container's or a job's limit) and its rlimits; None where none can be read."""
    known = [value for value in (available_ram_bytes(), cgroup_available_bytes(),
                                 rlimit_available_bytes()) if value is not None]
    return min(known) if known else None
