"""Export in the public DFlash draft-model format, checked with a loader written from that format (not from the
trainer's module), and the way back (`drafter.init_from`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from trainer.config import from_dict
from trainer.model.dflash_format import read_export, write_export
from trainer.model.mask import build_blocks, dense_mask
from trainer.run.build import build

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "target": {"random_preset": "tiny-qwen3", "dtype": "float32"},
    "drafter": {"num_layers": 2, "block_size": 8},
    "attention": {"backend": "dense"},
    "data": {"anchors_per_seq": 16, "seq_buckets": [128], "synthetic_samples": 8, "holdout": 2},
    "device": "cpu",
    "steps": 3,
    "eval": {"at_end": False},
    "metrics": {"tensorboard": True},  # the same run serves the TensorBoard test (tests/test_run_history.py)
}


def public_names(layers: int) -> set[str]:
    per_layer = [
        "input_layernorm",
        "post_attention_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    return {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{p}.weight" for i in range(layers) for p in per_layer
    }


# ------------------------------------------------------------------ a DFlash draft model from the public format alone


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [T, H, D], rotate-half
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv  # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_draft(cfg: dict, w: dict, target_hidden, noise_emb, ctx_len: int, anchor: int):
    """One block of a DFlash draft model, read from config.json and the public tensor names: the block's tokens
    attend (non-causally) to the projected target context before the anchor and to each other."""
    H, G, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    bs = cfg["dflash_config"]["block_size"]
    ctx = _rms(target_hidden[:anchor] @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # [anchor, C]
    x = noise_emb  # [bs, C]
    q_pos = torch.arange(anchor, anchor + bs)
    kv_pos = torch.cat([torch.arange(anchor), q_pos])
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rms((h @ w[p + "self_attn.q_proj.weight"].T).view(bs, H, D), w[p + "self_attn.q_norm.weight"], eps)
        kv_in = torch.cat([ctx, h])
        k = _rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, G, D), w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, G, D)
        q, k = _rope(q, q_pos, theta), _rope(k, kv_pos, theta)
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(bs, H * D)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = (
            x
            + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
            @ w[p + "mlp.down_proj.weight"].T
        )
    return _rms(x, w["norm.weight"], eps)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    (d / "train.yaml").write_text(json.dumps(CONFIG))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", str(d / "train.yaml"), "--run-dir", str(d / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return d / "run"


def test_training_ends_with_an_export_in_the_public_format(run_dir):
    exp = run_dir / "export"
    cfg = json.loads((exp / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_hidden_layers"] == 2 and cfg["block_size"] == 8 and cfg["num_target_layers"] == 6
    assert set(cfg["dflash_config"]) == {"block_size", "target_layer_ids", "mask_token_id"}
    tensors = load_file(str(exp / "model.safetensors"))
    assert set(tensors) == public_names(2)  # strict: nothing missing, nothing extra (no embedding, no LM head)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    events = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "export" and e["path"].endswith("export") for e in events)


def test_the_public_format_drafts_what_the_trainer_drafts(run_dir, tmp_path):
    """fp32: the trainer's drafter and the format-only reference agree on one block (within 1e-4)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.export",
            "--run-dir",
            str(run_dir),
            "--out",
            str(tmp_path / "e"),
            "--dtype",
            "float32",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    cfg = json.loads((tmp_path / "e" / "config.json").read_text())
    w = load_file(str(tmp_path / "e" / "model.safetensors"))
    parts = build(
        from_dict({**CONFIG, "drafter": {**CONFIG["drafter"], "init_from": str(tmp_path / "e")}}), for_training=False
    )
    S, bs, anchor = 128, 8, 57
    ids = torch.randint(0, 256, (S,), generator=torch.Generator().manual_seed(5))
    b = build_blocks(
        [(ids, torch.ones(S, dtype=torch.long))], S, 16, bs, parts.mask_token_id, 7.0, [torch.tensor([anchor])]
    )
    with torch.no_grad():
        hidden = parts.target.hidden_states(b.input_ids)  # [1, S, n*C]
        emb = parts.target.embed(b.block_ids)
        mine = parts.drafter(hidden, emb, b.block_pos, dense_mask(b.anchors, b.anchor_valid, S, bs), parts.backend)[
            0, :bs
        ]
        ref = reference_draft(cfg, w, hidden[0], emb[0, :bs], S, anchor)
    assert (mine - ref).abs().max().item() <= 1e-4


def test_export_import_export_is_byte_identical(run_dir, tmp_path):
    config, weights = read_export(run_dir / "export")
    again = write_export(tmp_path / "again", weights, {k: v for k, v in config.items() if k != "torch_dtype"})
    for name in ("config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (run_dir / "export" / name).read_bytes(), name


def test_init_from_refuses_a_drafter_of_another_shape(run_dir, tmp_path):
    cfg = {**CONFIG, "drafter": {"num_layers": 3, "block_size": 8, "init_from": str(run_dir / "export")}}
    (tmp_path / "t.yaml").write_text(json.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", str(tmp_path / "t.yaml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "drafter.init_from" in proc.stderr and "num_hidden_layers is 2" in proc.stderr


def test_export_of_something_that_is_no_run_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "metrics.jsonl" in proc.stderr


# ------------------------------------------------------------------------------------------------- the mask token


def test_mask_token_is_dedicated_never_pad_or_eos(tiny_dir):
    """The tokenizer's mask token first; else the family's published id; else a config error naming the key."""
    from types import SimpleNamespace

    from trainer.data.dataset import load_tokenizer
    from trainer.errors import ConfigError
    from trainer.run.build import resolve_mask_token

    cfg = from_dict(CONFIG)
    tok = load_tokenizer(str(tiny_dir / "target"))
    tiny = SimpleNamespace(model_type="qwen3", vocab_size=len(tok), pad_token_id=0, eos_token_id=tok.eos_token_id)
    got = resolve_mask_token(cfg, tiny, tok)
    assert got == tok.mask_token_id == len(tok) - 1 and got not in (tok.pad_token_id, tok.eos_token_id)
    qwen3 = SimpleNamespace(model_type="qwen3", vocab_size=151936, pad_token_id=151643, eos_token_id=151645)
    assert resolve_mask_token(cfg, qwen3, None) == 151669
    for unknown in (
        SimpleNamespace(model_type="llama", vocab_size=128256),
        SimpleNamespace(model_type="qwen3", vocab_size=1000),
    ):
        with pytest.raises(ConfigError, match=r"job.yaml: drafter.mask_token_id: no dedicated mask token"):
            resolve_mask_token(cfg, unknown, None, "job.yaml")
    cfg.drafter.mask_token_id = 128256
    with pytest.raises(ConfigError, match=r"drafter.mask_token_id: 128256 is outside the vocabulary"):
        resolve_mask_token(cfg, SimpleNamespace(model_type="llama", vocab_size=128256), None, "job.yaml")
    cfg.drafter.mask_token_id = 128002
    assert resolve_mask_token(cfg, SimpleNamespace(model_type="llama", vocab_size=128256), None) == 128002


def test_export_records_the_mask_token_the_run_trained_with(run_dir):
    start = next(json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"start"' in x)
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == start["mask_token_id"] == 255  # the tiny preset's reserved row


def _export_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-m", "trainer.export", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120
    )


def test_export_out_never_replaces_what_is_not_an_export(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "start"}\n')
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    link = tmp_path / "link"
    link.symlink_to(other)
    cases = {
        str(run): "is the run dir",
        str(tmp_path): "is the run dir or holds it",
        str(other): "holds other files",
        str(a_file): "is not a folder",
        str(link): "is a symlink",
        ".": "holds other files",
        str(run / "checkpoints"): "holds other files",
    }
    for out, why in cases.items():
        res = _export_cli("--run-dir", str(run), "--out", out, cwd=other)
        assert res.returncode == 2, (out, res.stderr)
        assert why in res.stderr and len(res.stderr.strip().splitlines()) == 1, (out, res.stderr)
        assert "Traceback" not in res.stderr
    assert (other / "thesis.tex").read_text() == "years of work" and a_file.read_text() == "x"
    assert (run / "metrics.jsonl").exists() and (run / "checkpoints" / "step-00000002").is_dir()
    assert not list(tmp_path.rglob(".*tmp*"))  # nothing left behind
    code = (
        "import sys; from trainer.serve.export import main; rc = main(['--run-dir', sys.argv[1], '--out', "
        "sys.argv[1]]); print(rc, 'torch' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(run)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout.split() == ["2", "False"], proc.stderr  # refused before torch's import: a fraction of a second


def test_export_replaces_an_earlier_export_or_fills_an_empty_folder(tmp_path):
    weights = {"fc.weight": torch.ones(2, 2)}
    cfg = {"architectures": ["DFlashDraftModel"]}
    empty = tmp_path / "empty"
    empty.mkdir()
    write_export(empty, weights, cfg, "float32")
    write_export(empty, {"fc.weight": torch.zeros(2, 2)}, cfg, "float32")  # an earlier export: replaced
    _, back = read_export(empty)
    assert torch.equal(back["fc.weight"], torch.zeros(2, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no .tmp or .old sibling left
