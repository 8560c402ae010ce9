"""What this machine has, as the settings' defaults need to know it: its cores, whether a GPU is visible, which
host names are its loopback, and how its Python was built. Read from files and strings only: the serving process
does not load torch."""

from __future__ import annotations

import ipaddress
import re
import sysconfig
from pathlib import Path

_CPU_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def cpu_list(cores: str) -> set[int] | None:
    """The cores a CPU list names (`0-3,6`, as `taskset` writes it; VLLM_CPU_OMP_THREADS_BIND also separates its
    ranks' lists with `|`); None for anything else (vLLM's `auto` or `nobind`: cores it picks itself)."""
    found: set[int] = set()
    for part in re.split(r"[,|]", cores):
        match = _CPU_RANGE.fullmatch(part.strip())
        if match is None:
            return None
        first, last = int(match[1]), int(match[2] or match[1])
        found.update(range(first, last + 1))
    return found


def gpu_visible(cuda_visible_devices: str | None) -> bool:
    """Whether a GPU is present (a device file of NVIDIA's or AMD's driver) and not hidden by this
    CUDA_VISIBLE_DEVICES (None: not set)."""
    if cuda_visible_devices is not None and cuda_visible_devices.strip() in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()


def is_loopback(host: str) -> bool:
    """Whether `host` (a name, or an address with or without IPv6 brackets) is this machine's loopback."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


_SHARED_LIBPYTHON = re.compile(r"/libpython3[^/\s]*\.so")


def plain_shared_build(config_args: str, maps: str) -> bool:
    """Whether a Python runs from a shared libpython built without profile-guided optimisation: configured
    without `--enable-optimizations` (`config_args`, sysconfig's CONFIG_ARGS) and mapping `libpython3*.so`
    (`maps`, the text of /proc/self/maps). pyenv builds this way by default, and the serving process then spent
    about a tenth more CPU per call, up to a quarter (docs/performance.md, "Which Python runs the gateway").
    Debian's and Ubuntu's `python3` (PGO, a static executable) and the Docker image's (configured with
    `--enable-optimizations`) are not. Empty `maps` (no /proc): False, no claim."""
    return "--enable-optimizations" not in config_args and _SHARED_LIBPYTHON.search(maps) is not None


def slow_interpreter_note() -> str | None:
    """A warning for the log when this process's Python is a `plain_shared_build`, else None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    config_args = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    if not plain_shared_build(config_args, maps):
        return None
    return (
        "this Python is a shared build without profile-guided optimisation (configured without "
        "--enable-optimizations): the gateway spends about a tenth more CPU per call on it than on an optimised "
        "build such as Debian's or Ubuntu's python3 or the Docker image's; docs/operations.md, 'The Python "
        "interpreter', says how to pick another"
    )
