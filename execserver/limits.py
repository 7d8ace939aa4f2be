"""Per-process resource limits: the value, the server's defaults and ceilings.

A process's limits (``process/start``'s ``limits``; docs/process-control.md,
"Resource limits") bound its whole tree: memory, processes and CPU through
its cgroup(s) (:mod:`execserver.containment` places and reads them), file
size through ``RLIMIT_FSIZE``, which every descendant inherits.

The effective limit of each kind is the request's, else the server's default
(``--default-limits``), else its ceiling (``--limit-ceiling``): a ceiling is
a bound no process escapes, so it also applies to a process that asked for
nothing. A request above the ceiling is refused (-32602).
"""

from __future__ import annotations

import re
from typing import Final, Literal

import attrs

from execserver.errors import RpcError

Kind = Literal["memory", "processes", "cpu", "fileSize"]

#: Wire name (``limits`` object of ``process/start``) -> attribute.
FIELDS: Final[dict[str, str]] = {
    "memoryBytes": "memory_bytes",
    "maxProcesses": "max_processes",
    "cpuPercent": "cpu_percent",
    "fileSizeBytes": "file_size_bytes",
}
#: Wire name -> the ``limitExceeded`` value it produces.
KINDS: Final[dict[str, Kind]] = {
    "memoryBytes": "memory",
    "maxProcesses": "processes",
    "cpuPercent": "cpu",
    "fileSizeBytes": "fileSize",
}
#: The smallest value of each field: a memory limit below a few pages cannot
#: even run ``exec``; the CFS quota's minimum is 1 ms per 100 ms period.
MINIMUM: Final[dict[str, int]] = {
    "memoryBytes": 1 << 20,
    "maxProcesses": 1,
    "cpuPercent": 1,
    "fileSizeBytes": 1,
}
#: Beyond these a value means nothing to the kernel (and would overflow it).
MAXIMUM: Final = (1 << 62) - 1
MAX_CPU_PERCENT: Final = 100 * 4096

_SUFFIXES: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@attrs.frozen
class Limits:
    """The limits of one process (None: no limit of that kind)."""

    memory_bytes: int | None = None
    max_processes: int | None = None
    cpu_percent: int | None = None
    file_size_bytes: int | None = None

    def __bool__(self) -> bool:
        return not (
            self.memory_bytes is None
            and self.max_processes is None
            and self.cpu_percent is None
            and self.file_size_bytes is None
        )

    def get(self, field: str) -> int | None:
        value: int | None = getattr(self, FIELDS[field])
        return value

    def set_fields(self) -> list[str]:
        """The wire names of the limits that are set."""
        return [field for field in FIELDS if self.get(field) is not None]

    def cgroup_controllers(self) -> list[str]:
        """The cgroup controllers these limits need (file size needs none)."""
        needed = []
        if self.memory_bytes is not None:
            needed.append("memory")
        if self.max_processes is not None:
            needed.append("pids")
        if self.cpu_percent is not None:
            needed.append("cpu")
        return needed

    def to_wire(self) -> dict[str, int]:
        return {
            field: value
            for field, attr in FIELDS.items()
            if (value := getattr(self, attr)) is not None
        }


NO_LIMITS: Final = Limits()


def check_value(field: str, value: int) -> None:
    """Raise -32602 if ``value`` is out of the range ``field`` accepts."""
    low = MINIMUM[field]
    high = MAX_CPU_PERCENT if field == "cpuPercent" else MAXIMUM
    if not low <= value <= high:
        raise RpcError.invalid_params(
            f"limits.{field} must be between {low} and {high}, got {value}"
        )


def resolve(requested: Limits | None, defaults: Limits, ceiling: Limits) -> Limits:
    """The effective limits of one start (raises -32602 above a ceiling)."""
    values: dict[str, int | None] = {}
    for field, attr in FIELDS.items():
        asked: int | None = getattr(requested, attr) if requested is not None else None
        top: int | None = getattr(ceiling, attr)
        if asked is not None:
            check_value(field, asked)
            if top is not None and asked > top:
                raise RpcError.invalid_params(
                    f"limits.{field} {asked} is above this server's ceiling {top} "
                    f"(--limit-ceiling {field}={top})",
                    {"field": field, "ceiling": top},
                )
            values[attr] = asked
        else:
            fallback: int | None = getattr(defaults, attr)
            values[attr] = fallback if fallback is not None else top
    return Limits(**values)


def parse_spec(text: str, option: str) -> Limits:
    """``memoryBytes=1G,maxProcesses=512`` -> Limits (raises ValueError with the reason)."""
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in FIELDS:
            raise ValueError(
                f"{option} takes NAME=VALUE[,NAME=VALUE...] with NAME one of "
                f"{', '.join(FIELDS)}; got `{item}`"
            )
        match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", raw)
        if match is None:
            raise ValueError(
                f"{option}: {name} takes a whole number (K, M, G, T suffixes), got `{raw}`"
            )
        value = int(match.group(1)) * _SUFFIXES[match.group(2).lower()]
        low = MINIMUM[name]
        high = MAX_CPU_PERCENT if name == "cpuPercent" else MAXIMUM
        if not low <= value <= high:
            raise ValueError(f"{option}: {name} must be between {low} and {high}, got {value}")
        values[FIELDS[name]] = value
    return Limits(**values)


def check_defaults(defaults: Limits, ceiling: Limits) -> None:
    """Raise ValueError if a default is above its ceiling."""
    for field in FIELDS:
        default, top = defaults.get(field), ceiling.get(field)
        if default is not None and top is not None and default > top:
            raise ValueError(
                f"--default-limits {field}={default} is above --limit-ceiling {field}={top}"
            )


__all__ = [
    "FIELDS",
    "KINDS",
    "NO_LIMITS",
    "Kind",
    "Limits",
    "check_defaults",
    "check_value",
    "parse_spec",
    "resolve",
]
