"""Describe the machine a measurement was taken on, so results carry their context.

Everything here reads the system when called (never at import) and degrades to ``None`` where a
fact cannot be read: a container may hide the CPU governor, a laptop has no Jetson power mode.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from anytime.errors import AnytimeError


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _run(cmd: list[str], timeout: float = 5.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's marketing name, from /proc/cpuinfo where available."""
    info = _read("/proc/cpuinfo") or ""
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware"):
            return value.strip()
    return platform.processor() or platform.machine()


def cpu_governor() -> str | None:
    """The cpufreq scaling governor of CPU 0 (``performance``, ``schedutil``...), if exposed."""
    return _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")


def jetson_power_mode() -> str | None:
    """A Jetson board's nvpmodel power mode, or ``None`` on other machines."""
    out = _run(["nvpmodel", "-q"])
    if out:
        return " ".join(out.split())
    return None


def gpu_info() -> dict[str, Any] | None:
    """Name, memory and (via nvidia-smi when present) clocks of the current CUDA device."""
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    info: dict[str, Any] = {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 2),
        "capability": f"{props.major}.{props.minor}",
        "count": torch.cuda.device_count(),
    }
    clocks = _run(
        [
            "nvidia-smi",
            f"--id={index}",
            "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm,power.limit,pstate",
            "--format=csv,noheader",
        ]
    )
    if clocks:
        info["clocks_sm_mem_maxsm_powerlimit_pstate"] = clocks
    return info


def storage_of(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The mount point, file system and block device (rotational or not) that hold ``path``."""
    try:
        target = Path(path).resolve()
        target.stat()
    except OSError:
        return None
    best: tuple[str, str, str] | None = None
    for line in (_read("/proc/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        device, mount, fstype = parts[0], parts[1], parts[2]
        if (str(target) == mount or str(target).startswith(mount.rstrip("/") + "/")) and (
            best is None or len(mount) > len(best[1])
        ):
            best = (device, mount, fstype)
    if best is None:
        return {"path": str(target)}
    device, mount, fstype = best
    result: dict[str, Any] = {"path": str(target), "device": device, "mount": mount, "fstype": fstype}
    name = Path(device).name
    rotational = _read(f"/sys/class/block/{name}/queue/rotational")
    if rotational is not None:
        result["rotational"] = rotational == "1"
    return result


def drop_page_cache() -> tuple[bool, str]:
    """Ask the kernel to drop the OS page cache (needs root and a writable /proc/sys).

    Returns whether it was dropped and a sentence saying so, or why not, for the results file.
    """
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as handle:
            handle.write("3\n")
    except OSError as exc:
        return False, f"page cache not dropped: {exc.strerror or exc} (needs root on a host, not a container)"
    return True, "page cache dropped (echo 3 > /proc/sys/vm/drop_caches)"


def git_sha(start: str | os.PathLike[str] | None = None) -> str | None:
    """The current commit of the repository holding ``start`` (default: this package), with ``-dirty`` if modified."""
    where = Path(start) if start is not None else Path(__file__).resolve().parent
    sha = _run(["git", "-C", str(where), "rev-parse", "HEAD"])
    if sha is None:
        return None
    dirty = _run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"])
    return f"{sha}-dirty" if dirty else sha


def describe_machine(data_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Everything worth recording beside a measurement: CPU, threads, governor, GPU, power mode, software."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_governor": cpu_governor(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": gpu_info(),
        "jetson_power_mode": jetson_power_mode(),
    }
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        info["torchvision"] = None
    if data_path is not None:
        info["data_storage"] = storage_of(data_path)
    return info


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present; ``cuda`` without a GPU is an error the user can act on."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise AnytimeError(f"--device {name} asked for, but torch sees no CUDA GPU here; use --device cpu or auto")
        try:
            device = torch.device(name)
        except RuntimeError:
            raise AnytimeError(f"'{name}' is not a device name; use cuda or cuda:N") from None
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise AnytimeError(f"{name} does not exist: torch sees {torch.cuda.device_count()} GPU(s)")
        return device
    raise AnytimeError(f"unknown device '{name}'; use auto, cpu or cuda")


def bf16_emulated(device: torch.device) -> bool:
    """True on a CPU whose instructions have no bfloat16 arithmetic (no AVX-512 or AMX: an AVX2-only x86, say),
    where oneDNN emulates bf16 autocast: a fastcnn training step ran 13x slower than in float32 on a 2-core AVX2
    EPYC."""
    return (
        device.type == "cpu"
        and platform.machine().lower() in ("x86_64", "amd64")
        and not bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def device_label(device: torch.device) -> str:
    """A short name for a device, for records and plot titles: the GPU's name, or the CPU's model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()
