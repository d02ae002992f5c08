"""The frozen target model: load any Hugging Face causal LM, capture the hidden states of chosen layers.

Only the layers the drafter needs are run: a forward hook on the last needed layer stops the forward pass, so
neither later layers nor the LM head run, and no other layer's output is kept.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn

from trainer.config import TargetConfig
from trainer.errors import ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def qwen3_8b_config() -> dict:
    """Qwen3-8B's shape (random weights are fine for speed measurements)."""
    return dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )


def tiny_qwen3_config() -> dict:
    """A few-MB Qwen3 for CPU tests and the demo."""
    return dict(
        model_type="qwen3",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.3,  # a trained LM head is far from the 0.02 init: make logits of a normed state matter
        mask_token_id=255,  # the last row, reserved as the drafter's mask token
    )


def llama3_70b_config() -> dict:
    """Llama-3.3-70B's shape: 141 GB in bf16, more than one H200 holds next to a drafter."""
    return dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )


RANDOM_PRESETS = {"qwen3-8b": qwen3_8b_config, "tiny-qwen3": tiny_qwen3_config, "llama3-70b": llama3_70b_config}
BUILD_WHOLE_MAX = 2e9  # a sharded random target above this many parameters is built on the meta device


def default_layer_ids(num_target_layers: int, num_drafter_layers: int) -> list[int]:
    """Spread evenly from the second to the third-to-last layer (Qwen3-8B, 36 layers, 5: 1, 9, 17, 25, 33)."""
    lo, hi = 1, num_target_layers - 3
    if num_drafter_layers == 1:
        return [lo]
    return [round(lo + i * (hi - lo) / (num_drafter_layers - 1)) for i in range(num_drafter_layers)]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class _StopForward(Exception):
    pass


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ConfigError("<target>", "target", f"{type(model).__name__} has no .model.layers (not a decoder LM?)")
    return layers


@dataclass
class Target:
    """A frozen causal LM plus which layers feed the drafter."""

    model: nn.Module
    layer_ids: list[int]

    def __post_init__(self) -> None:
        self.model.requires_grad_(False)
        self.model.eval()
        self.layers = _decoder_layers(self.model)
        self._compiled: list = []
        self.embed: nn.Module = self.model.get_input_embeddings()
        self.lm_head: nn.Module = self.model.get_output_embeddings()
        self.config = self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def compile_layers(self, backend: str = "inductor") -> None:
        """Regional compilation: each needed decoder layer's forward through torch.compile. The layers share one code
        object and their weights are graph inputs, so one graph serves all of them; with the sequence length symbolic
        (dynamic=True: the weights fix every other size) it serves every shape bucket too, so the preflight compiles
        the target once, not once a bucket (on an H200 at the paper shape, about 3 s of each later bucket, at the same
        step time). Used by training only (`compiled=True`): decoding stays eager. Whether to compile is decided in
        trainer/run/parallelize.py."""
        last = max(self.layer_ids)
        self._compiled = [
            torch.compile(layer.forward, backend=backend, dynamic=True) for layer in self.layers[: last + 1]
        ]

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        """[B, S] token ids -> [B, S, len(layer_ids) * hidden] outputs of the chosen layers, concatenated."""
        if compiled and self._compiled:
            for layer, fn in zip(self.layers, self._compiled, strict=False):
                layer.forward = fn  # an instance attribute: deleting it restores the class's forward
            try:
                return self._hidden_states(input_ids)
            finally:
                for layer in self.layers[: len(self._compiled)]:
                    del layer.forward
        return self._hidden_states(input_ids)

    def _hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        try:
            with self._capturing(stop=True) as captured:
                self.model.model(input_ids=input_ids, use_cache=False)
        except _StopForward:
            pass
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1)  # [B, S, n * hidden]

    @contextlib.contextmanager
    def _capturing(self, stop: bool):
        """Forward hooks that keep each chosen layer's output in the dict this yields (layer index -> output) while the
        block runs; with `stop`, the last chosen layer ends the forward (_StopForward), so later layers and the LM head
        never run."""
        captured: dict[int, torch.Tensor] = {}
        last = max(self.layer_ids)

        def hook(index: int):
            def fn(_module, _args, output):
                captured[index] = output[0] if isinstance(output, tuple) else output
                if stop and index == last:
                    raise _StopForward

            return fn

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]
        try:
            yield captured
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def forward_cached(
        self, input_ids: torch.Tensor, positions: torch.Tensor, width: int, cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoding many rows at once: [B, q] tokens at their own positions [B, q] (`width`: one past the largest,
        from the host: reading it off the device would make the host wait), attending to what `cache`
        (trainer.model.kv_cache.PositionCache) holds below them -> (the chosen layers' outputs [B, q, n*hidden],
        the final normed hidden states [B, q, hidden]: the LM head is left to the caller, who needs a few rows)."""
        from trainer.model.kv_cache import causal_by_position

        cache.prepare(positions, width)
        mask = causal_by_position(positions, width, self.embed.weight.dtype)
        with self._capturing(stop=False) as captured:
            out = self.model.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
        if not cache.keys:  # a transformers release that swapped in a cache of its own: every later step would be wrong
            raise RuntimeError(f"{type(self.model).__name__} did not write its keys and values into the given cache")
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1), out.last_hidden_state

    @functools.cached_property
    def _cache_kwarg(self) -> str:
        """transformers 5 names the cache `cache`; 4.x `past_key_values` (5 still takes it, with a warning). Read once
        per target, not every decoding step."""
        import inspect

        return "cache" if "cache" in inspect.signature(self.model.model.forward).parameters else "past_key_values"

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full forward for verification during evaluation: [B, S] -> [B, S, vocab]."""
        return self.model(input_ids=input_ids, use_cache=False).logits


def end_token_ids(model: nn.Module) -> set[int]:
    """Every id that ends generation: the model config's and the generation config's (chat models list several)."""
    found: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        found |= set(eos if isinstance(eos, (list, tuple)) else [eos])
    return {int(t) for t in found if t is not None}


def target_config(cfg: TargetConfig, source: str = "<config>"):
    """The target's HF config alone (no weights): for the memory plan and shapes before anything is loaded."""
    from transformers import AutoConfig

    if cfg.random_preset is not None:
        if cfg.random_preset not in RANDOM_PRESETS:
            known = ", ".join(RANDOM_PRESETS)
            raise ConfigError(source, "target.random_preset", f"unknown preset {cfg.random_preset!r} ({known})")
        kwargs = RANDOM_PRESETS[cfg.random_preset]()
        if cfg.init_std is not None:
            kwargs["initializer_range"] = cfg.init_std
        return AutoConfig.for_model(**kwargs)
    try:
        return AutoConfig.from_pretrained(cfg.path, local_files_only=True)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(source, "target.path", f"cannot load a causal LM from {cfg.path}: {first}") from None


def build_model(cfg: TargetConfig, device: torch.device, source: str = "<config>", sharded: bool = False) -> nn.Module:
    """The target, whole, on `device`. With `sharded`, it is left for trainer/run/parallelize.py to shard and place:
    built on the CPU, or on the meta device for a random target too large to build whole (each rank then allocates
    only its shard)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the log is for the trainer's lines; a bar per load only adds noise
    dtype = DTYPES[cfg.dtype]
    hf_config = target_config(cfg, source)
    if cfg.random_preset is not None:
        rough = 12 * int(hf_config.hidden_size) ** 2 * int(hf_config.num_hidden_layers)
        if sharded and rough > BUILD_WHOLE_MAX:  # filled once sharded (trainer/model/parallel.py shard_and_place)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        with torch.device("cpu" if sharded else device):
            torch.manual_seed(0)  # the same random target on every rank and every run
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype, local_files_only=True)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(source, "target.path", f"cannot load a causal LM from {cfg.path}: {first}") from None
    return model if sharded else model.to(device)


def load_target(
    cfg: TargetConfig, num_drafter_layers: int, device: torch.device, source: str = "<config>", sharded: bool = False
) -> Target:
    """The frozen target and the layers that feed the drafter; with `sharded`, not yet placed (see `build_model`)."""
    model = build_model(cfg, device, source, sharded)
    n_layers = int(model.config.num_hidden_layers)
    layer_ids = cfg.layer_ids or default_layer_ids(n_layers, num_drafter_layers)
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(source, "target.layer_ids", f"{bad} out of range for a {n_layers}-layer target")
    return Target(model, sorted(layer_ids))
