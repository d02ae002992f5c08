"""Greedy batched decoding for regeneration: a static KV cache, one shared write position, CUDA graphs per length.

`model.generate` re-plans every step in Python (masks, cache growth, stopping criteria), which left one H200 at
11K generated tokens/s for a 0.5B target: the GPU waited on the host. Here the decode step is the target's own
weights run by a short fixed function over preallocated buffers, so the whole step (embedding, layers, cache write,
LM head, argmax, EOS bookkeeping, position advance) is captured once per attention length and replayed with no host
work at all. Prompts are left-padded so every row writes its new key/value at the same cache slot; a row's pad slots
are masked out and its rotary positions start at its first real token, so each row decodes exactly as it would alone.

Works for Hugging Face decoder LMs of the Llama/Qwen2/Qwen3 shape (q/k/v/o projections, optional q/k norms,
SwiGLU MLP, RMSNorm, the model's own rotary embedding module). Greedy only: sampling stays with `model.generate`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

TILE = 128  # attention lengths are rounded up to this: one captured graph per 128 cache slots


@dataclass
class Shapes:
    heads: int
    kv_heads: int
    head_dim: int


def shapes_of(model) -> Shapes:
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return Shapes(heads, int(getattr(cfg, "num_key_value_heads", None) or heads), head_dim)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x_BHLD: torch.Tensor, cos_BLD: torch.Tensor, sin_BLD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BLD[:, None], sin_BLD[:, None]  # [B, 1, L, D]
    return x_BHLD * cos + rotate_half(x_BHLD) * sin


class StaticDecoder:
    """Decodes batches of up to `rows` prompts of at most `max_prompt` tokens for `max_new` new tokens each."""

    def __init__(
        self, model, rows: int, max_prompt: int, max_new: int, eos: set[int], pad: int, graphs: bool | None = None
    ) -> None:
        self.model, self.base = model, model.model
        self.layers = list(self.base.layers)
        self.s = shapes_of(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.rows, self.max_new, self.pad = rows, max_new, pad
        self.capacity = TILE * -(-(max_prompt + max_new) // TILE)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        B, L, s = rows, self.capacity, self.s
        kv = (B, s.kv_heads, L, s.head_dim)
        self.k = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.v = [torch.zeros(kv, dtype=self.dtype, device=self.device) for _ in self.layers]
        dev = self.device
        self.eos = torch.tensor(sorted(eos) or [-1], device=dev)
        # the step's state: everything the captured graph reads and writes lives in these buffers
        self.tok = torch.zeros(B, dtype=torch.long, device=dev)  # the token each row feeds next
        self.start = torch.zeros(B, dtype=torch.long, device=dev)  # each row's first real cache slot (its padding)
        self.t = torch.zeros((), dtype=torch.long, device=dev)  # the cache slot written this step (shared by rows)
        self.t0 = torch.zeros((), dtype=torch.long, device=dev)  # the slot of the first new token
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.out = torch.full((B, max_new + 1), pad, dtype=torch.long, device=dev)
        self._graph: dict[int, torch.cuda.CUDAGraph] = {}

    # --- one decode step over the first `span` cache slots ----------------------------------------------------------

    def _attend(
        self, i: int, x_BC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, span: int, mask_B11L: torch.Tensor
    ) -> torch.Tensor:
        attn, s, B = self.layers[i].self_attn, self.s, x_BC.shape[0]
        q = attn.q_proj(x_BC).view(B, 1, s.heads, s.head_dim)  # [B, 1, H, D]
        k = attn.k_proj(x_BC).view(B, 1, s.kv_heads, s.head_dim)
        v = attn.v_proj(x_BC).view(B, 1, s.kv_heads, s.head_dim)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before rope
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = rope(q.transpose(1, 2), cos, sin)  # [B, H, 1, D]
        k = rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, 1, D]
        self.k[i].index_copy_(2, self.t.view(1), k)
        self.v[i].index_copy_(2, self.t.view(1), v.transpose(1, 2))
        g = s.heads // s.kv_heads  # query heads per key/value head: head h reads kv head h // g
        q_BKGD = q.reshape(B, s.kv_heads, g, s.head_dim)  # the g heads of one kv head as g query rows
        o = F.scaled_dot_product_attention(
            q_BKGD,
            self.k[i][:, :, :span],
            self.v[i][:, :, :span],
            attn_mask=mask_B11L,
            scale=attn.scaling if hasattr(attn, "scaling") else None,
        )
        return attn.o_proj(o.reshape(B, s.heads * s.head_dim))  # [B, C]

    def _step(self, span: int) -> None:
        B = self.rows
        slots = torch.arange(span, device=self.device)
        mask = ((slots[None] >= self.start[:, None]) & (slots[None] <= self.t)).view(B, 1, 1, span)
        pos = (self.t - self.start).view(B, 1)  # each row's own position: its first real token is 0
        x = self.base.embed_tokens(self.tok)  # [B, C]
        cos, sin = self.base.rotary_emb(x[:, None], pos)  # [B, 1, D] each
        for i, layer in enumerate(self.layers):
            x = x + self._attend(i, layer.input_layernorm(x), cos, sin, span, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        nxt = self.model.lm_head(self.base.norm(x)).argmax(-1)  # [B]
        nxt = torch.where(self.done, torch.full_like(nxt, self.pad), nxt)
        self.out.index_copy_(1, (self.t + 1 - self.t0).view(1), nxt[:, None])
        self.done |= (nxt[:, None] == self.eos[None]).any(-1)
        self.tok.copy_(nxt)
        self.t += 1

    def _run_step(self, span: int) -> None:
        if not self.graphs:
            self._step(span)
            return
        graph = self._graph.get(span)
        if graph is None:
            try:
                graph = self._capture(span)
            except RuntimeError as e:  # a model whose step cannot be captured still decodes, eagerly
                print(
                    f"static_decode: CUDA graph capture failed, decoding eagerly: {str(e).splitlines()[0]}",
                    file=sys.stderr,
                )
                self.graphs = False
                torch.cuda.synchronize()
                self._step(span)
                return
        graph.replay()

    def _capture(self, span: int) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream, then record one step; the step's state is restored after each."""
        state = (self.tok, self.t, self.done, self.out)
        saved = [b.clone() for b in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(span)
        torch.cuda.current_stream().wait_stream(side)
        for b, v in zip(state, saved, strict=True):
            b.copy_(v)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._step(span)
        finally:
            for b, v in zip(state, saved, strict=True):
                b.copy_(v)
        self._graph[span] = graph
        return graph

    # --- a batch ------------------------------------------------------------------------------------------------------

    def _prefill(self, ids_BP: torch.Tensor, start_B: torch.Tensor, chunk: int = 64) -> torch.Tensor:
        """Every prompt's keys and values into slots [0, P); the first new token of each row."""
        B, P = ids_BP.shape
        s, first = self.s, []
        slots = torch.arange(P, device=self.device)
        for r0 in range(0, B, chunk):  # a few rows at a time: the prompt's activations stay small
            ids, start = ids_BP[r0 : r0 + chunk], start_B[r0 : r0 + chunk]
            b = ids.shape[0]
            pos = (slots[None] - start[:, None]).clamp(min=0)  # [b, P]
            keep = slots[None] >= start[:, None]  # [b, P]: real tokens
            mask = (slots[None, :, None] >= slots[None, None, :]) & keep[:, None, :]  # [b, P(q), P(k)]
            mask = mask | ~keep[:, :, None]  # a pad query sees everything: no empty row, its output unused
            x = self.base.embed_tokens(ids)  # [b, P, C]
            cos, sin = self.base.rotary_emb(x, pos)  # [b, P, D]
            for i, layer in enumerate(self.layers):
                attn, h = layer.self_attn, layer.input_layernorm(x)
                q = attn.q_proj(h).view(b, P, s.heads, s.head_dim)
                k = attn.k_proj(h).view(b, P, s.kv_heads, s.head_dim)
                v = attn.v_proj(h).view(b, P, s.kv_heads, s.head_dim)
                if getattr(attn, "q_norm", None) is not None:
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = rope(q.transpose(1, 2), cos, sin), rope(k.transpose(1, 2), cos, sin)  # [b, H(kv), P, D]
                v = v.transpose(1, 2)
                self.k[i][r0 : r0 + b, :, :P] = k
                self.v[i][r0 : r0 + b, :, :P] = v
                g = s.heads // s.kv_heads
                scale = attn.scaling if hasattr(attn, "scaling") else None
                kg, vg = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [b, H, P, D]: head h reads h // g
                o = F.scaled_dot_product_attention(q, kg, vg, attn_mask=mask[:, None], scale=scale)
                x = x + attn.o_proj(o.transpose(1, 2).reshape(b, P, s.heads * s.head_dim))  # [b, P, C]
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            first.append(self.model.lm_head(self.base.norm(x[:, -1])).argmax(-1))  # [b]
        return torch.cat(first)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], check_every: int = 16) -> list[list[int]]:
        """Each prompt's greedy continuation, cut after its first end token or at `max_new` tokens."""
        n = len(prompts)
        if not 0 < n <= self.rows:
            raise ValueError(f"{n} prompts for a decoder of {self.rows} rows")
        P = max(len(p) for p in prompts)
        if P + self.max_new > self.capacity:
            raise ValueError(f"a prompt of {P} tokens does not fit the cache ({self.capacity} slots)")
        B, dev = self.rows, self.device
        ids = torch.full((B, P), self.pad, dtype=torch.long)
        start = torch.full((B,), P - 1, dtype=torch.long)  # unused rows: one pad token, already done
        for r, p in enumerate(prompts):
            ids[r, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            start[r] = P - len(p)
        ids, start = ids.to(dev), start.to(dev)
        self.start.copy_(start)
        first = self._prefill(ids, start)
        live = torch.arange(B, device=dev) < n
        self.out.fill_(self.pad)
        self.out[:, 0] = first
        self.done.copy_(~live | (first[:, None] == self.eos[None]).any(-1))
        self.tok.copy_(first)
        self.t.fill_(P)
        self.t0.fill_(P)
        for step in range(1, self.max_new):
            if step % check_every == 0 and bool(self.done.all()):  # a host sync: only every few steps
                break
            span = TILE * -(-(P + step) // TILE)  # slots [0, P + step) are read: the prompt and the tokens so far
            self._run_step(span)
        rows = self.out[:n, : self.max_new].tolist()
        eos = set(self.eos.tolist())
        return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]
