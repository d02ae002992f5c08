"""Compiled GPU kernels shared by the jobs on one host.

Triton keys every kernel it compiles by a hash of its source, its compile options, the Triton version and the GPU
it is built for, so a kernel one job compiled is exactly what another job would compile: sharing them across jobs
is safe, and spares a new job's first bucket every kernel compile another job already did (one H200, the paper
shape: that bucket's cold preflight 18.4 s with nothing shared, 14.7 s with the kernels of an earlier job; see
docs/benchmarks.md). Inductor's own cache, with its graphs and its autotuning choices, stays the job's
(`inductor_cache: clear`, the default), so a job still makes its own choices on its own measurements.

dflashctl's run script names the host's cache in `DFLASHCTL_KERNEL_CACHE`; the trainer keys it by the versions that
make kernels differ, so the kernels of a torch or Triton no longer installed can be deleted without touching the
rest. The directories it makes are the owner's alone (0700): Triton runs whatever kernel it finds there. A
`TRITON_CACHE_DIR` the job sets itself wins.

FlashAttention-4's kernels (flex's FLASH backend, trainer/model/flash_kernel.py) are compiled by the CuTe DSL in the
job's own process, and are kept only when its disk cache is switched on: here it is, in `flash-attn-cute` inside the
same versioned directory (FA4 keys each kernel by a hash of its own sources and the CuTe DSL's version). A
`FLASH_ATTENTION_CUTE_DSL_CACHE_DIR` the job sets itself wins.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping

import torch

ROOT_VARIABLE = "DFLASHCTL_KERNEL_CACHE"
FLASH_DIR_VARIABLE = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"  # read by flash-attn-4 when it is imported


def version_key(device: torch.device) -> str:
    """torch, Triton and the GPU architecture, as a directory name: `torch2.11.0_cu130-triton3.6.0-sm90`."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # no Triton: no kernels to cache, but the key stays well-formed
        triton_version = "none"
    arch = ""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"-sm{major}{minor}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"torch{torch.__version__}-triton{triton_version}{arch}")


def use_host_kernel_cache(device: torch.device, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Point Triton at the host's kernel cache for these versions (before anything compiles: Inductor's compile
    workers take the environment they start with). Returns the directory, or None where no host cache is named, the
    job chose its own, or the directory cannot be made."""
    root = environ.get(ROOT_VARIABLE)
    if not root or environ.get("TRITON_CACHE_DIR"):
        return None
    path = os.path.join(root, version_key(device))
    try:
        for d in (root, path):  # the owner's alone, as run dirs are: a kernel another user put there would run here
            os.makedirs(d, mode=0o700, exist_ok=True)
    except OSError:  # a cache that cannot be made (a file in its place, no room): Triton's own default, as before
        return None
    environ["TRITON_CACHE_DIR"] = path
    if not environ.get(FLASH_DIR_VARIABLE):
        flash = os.path.join(path, "flash-attn-cute")
        try:
            os.makedirs(flash, mode=0o700, exist_ok=True)
        except OSError:  # FA4 then compiles in memory, as without a host cache
            return path
        environ[FLASH_DIR_VARIABLE], environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = flash, "1"
    return path
