"""What every benchmark result carries: when, which revision, on what machine; and where results are written."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil

RESULTS_DIR = Path(__file__).parent / "results"  # git-ignored


def _git(*command: str) -> str:
    return subprocess.run(["git", *command], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()


def machine() -> dict:
    import torch  # only here: every engine's process imports this module, and a llama.cpp one must not load torch

    cpu = platform.processor()
    if sys.platform == "linux":
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    return {
        "cpu": cpu,
        "cores": psutil.cpu_count(logical=False),
        "logical_cpus": psutil.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),  # a busy machine makes every number slower and noisier
    }


def provenance() -> dict:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "revision": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain")),  # measured with uncommitted changes
        "machine": machine(),
    }


def result_stem(name: str, directory: Path = RESULTS_DIR) -> Path:
    """`directory/<name>-<time>`, the directory created; callers add .json, .html, ... to it."""
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
