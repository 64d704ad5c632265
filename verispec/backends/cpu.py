"""What Linux says about this CPU: its name and instruction sets (empty strings and sets elsewhere)."""

from __future__ import annotations


def _cpuinfo(field: str) -> str:
    """The first ``field`` line's value in Linux's /proc/cpuinfo ("" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return ""


def cpu_name() -> str:
    return _cpuinfo("model name")


def cpu_flags() -> frozenset[str]:
    """The instruction sets Linux reports for this CPU (empty elsewhere)."""
    return frozenset(_cpuinfo("flags").split())
