"""Triton's compiled kernels shared by the jobs on one host (trainer/run/kernel_cache.py): every job that dflashctl
launches names the host's cache, the trainer keys it by the versions that make kernels differ and reports it, and a
job's own TRITON_CACHE_DIR wins."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli, run_trainer_cli
from tests.e2e.test_launch import cli_json, write_project
from trainer.run.kernel_cache import FLASH_DIR_VARIABLE, ROOT_VARIABLE, use_host_kernel_cache, version_key


def test_the_host_cache_is_keyed_by_torch_and_triton_versions_and_a_job_s_own_cache_wins(tmp_path):
    env = {ROOT_VARIABLE: str(tmp_path / "kc")}
    path = use_host_kernel_cache(torch.device("cpu"), env)
    key = version_key(torch.device("cpu"))
    assert path == str(tmp_path / "kc" / key) and env["TRITON_CACHE_DIR"] == path
    flash = tmp_path / "kc" / key / "flash-attn-cute"  # FlashAttention-4's compiled kernels, switched on beside
    assert env[FLASH_DIR_VARIABLE] == str(flash) and env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    for d in (tmp_path / "kc", tmp_path / "kc" / key, flash):  # nobody else may put a kernel there for this job to run
        assert d.is_dir() and d.stat().st_mode & 0o077 == 0, oct(d.stat().st_mode)
    mine = {ROOT_VARIABLE: str(tmp_path / "kc"), FLASH_DIR_VARIABLE: "/mine-fa"}
    assert use_host_kernel_cache(torch.device("cpu"), mine) == path and mine[FLASH_DIR_VARIABLE] == "/mine-fa"
    assert "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED" not in mine  # the job's own choice of FA4 cache, untouched
    assert use_host_kernel_cache(torch.device("cpu"), {ROOT_VARIABLE: str(tmp_path / "kc")}) == path  # again: same
    assert key.startswith(f"torch{torch.__version__}".replace("+", "_")) and "-triton" in key
    assert all(c.isalnum() or c in "._-" for c in key)  # one directory name, whatever the version strings hold
    own = {ROOT_VARIABLE: str(tmp_path / "kc"), "TRITON_CACHE_DIR": "/mine"}
    assert use_host_kernel_cache(torch.device("cpu"), own) is None and own["TRITON_CACHE_DIR"] == "/mine"
    (tmp_path / "afile").write_text("")
    blocked = {ROOT_VARIABLE: str(tmp_path / "afile")}  # a file where the cache would go: no host cache, no crash
    assert use_host_kernel_cache(torch.device("cpu"), blocked) is None and "TRITON_CACHE_DIR" not in blocked
    bare: dict[str, str] = {}
    assert use_host_kernel_cache(torch.device("cpu"), bare) is None and bare == {}


def test_the_trainer_uses_and_reports_the_host_kernel_cache(tmp_path):
    cfg = tmp_path / "t.yaml"
    cfg.write_text(
        "target: {random_preset: tiny-qwen3, dtype: float32}\ndrafter: {num_layers: 1, block_size: 8}\n"
        "attention: {backend: dense}\ndata: {anchors_per_seq: 16, seq_buckets: [128], synthetic_samples: 2, "
        "holdout: 0}\neval: {at_end: false}\ndevice: cpu\nsteps: 1\n"
    )
    proc = run_trainer_cli(
        cfg, "--run-dir", str(tmp_path / "run"), env={ROOT_VARIABLE: str(tmp_path / "kc")}, unset=("TRITON_CACHE_DIR",)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    pre = next(r for r in recs if r.get("event") == "preflight")
    assert pre["kernel_cache"] == str(tmp_path / "kc" / version_key(torch.device("cpu")))


@pytest.mark.slow
def test_jobs_launched_on_one_host_share_its_kernel_cache_beside_their_own_inductor_caches(client, tmp_path):
    p = write_project(client, tmp_path)
    show = 'echo "KC=$DFLASHCTL_KERNEL_CACHE IC=$TORCHINDUCTOR_CACHE_DIR"; sleep 300'
    for name in ("one", "two"):
        (p / "jobs" / f"{name}.yaml").write_text(
            f"name: {name}\nhost: box\ncommand: {json.dumps(show)}\nkill_grace_s: 1\n"
        )
    assert run_cli("deploy", "box").code == 0
    ids = [cli_json("launch", f"jobs/{name}.yaml")["id"] for name in ("one", "two")]
    try:
        workdir = tmp_path / "remote" / "plain"
        seen = {}
        deadline = time.monotonic() + 30
        while len(seen) < 2 and time.monotonic() < deadline:
            for log in workdir.rglob("train.log"):
                line = next((x for x in log.read_text().splitlines() if x.startswith("KC=")), None)
                if line:
                    kc, ic = (part.split("=", 1)[1] for part in line.split())
                    seen[log.parent] = (os.path.realpath(kc), os.path.realpath(ic))
            time.sleep(0.2)
        assert len(seen) == 2, seen
        kernel, inductor = zip(*seen.values(), strict=True)
        assert set(kernel) == {os.path.realpath(workdir / "kernel-cache")}  # one for the host
        assert len(set(inductor)) == 2 and all(
            Path(ic).parent == Path(rd).resolve() for rd, (_, ic) in seen.items()
        )  # each job its own
    finally:
        for job_id in ids:
            run_cli("kill", job_id, "--grace", "1")
