"""Helpers for the model tests: a dense single-sequence attention, a greedy loop, tiny HF/GGUF checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from stallfree.engine.model.llama import LlamaForCausalLM


class DenseCausalAttention:
    """An `AttentionFn` for one sequence: keeps every layer's K/V and attends causally over all of it.

    Calls may feed the sequence in pieces (whole prompt, chunks, or token by token); each call's queries
    see the K/V of all earlier calls plus the causal part of their own. GQA groups query heads by a
    reshape, without repeating K/V.
    """

    def __init__(self) -> None:
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if layer_idx in self.k:
            k = torch.cat([self.k[layer_idx], k])  # (S, nkv, hd)
            v = torch.cat([self.v[layer_idx], v])
        self.k[layer_idx], self.v[layer_idx] = k, v
        T, nh, hd = q.shape
        S, nkv, _ = k.shape
        # Query i of this call is token S - T + i of the sequence: it sees keys 0 .. S - T + i.
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(diagonal=S - T)
        qg = q.view(T, nkv, nh // nkv, hd).permute(1, 2, 0, 3)  # (nkv, group, T, hd)
        out = F.scaled_dot_product_attention(
            qg, k.transpose(0, 1).unsqueeze(1), v.transpose(0, 1).unsqueeze(1), attn_mask=mask
        )  # (nkv, group, T, hd); K/V broadcast over the group dimension
        return out.permute(2, 0, 1, 3).reshape(T, nh, hd)


@torch.no_grad()
def prefill_logits(model: LlamaForCausalLM, ids: list[int], start_pos: int = 0) -> Tensor:
    """All-position logits (T, vocab) of one sequence fed in one call."""
    hidden = model(torch.tensor(ids), torch.arange(start_pos, start_pos + len(ids)), DenseCausalAttention())
    return model.compute_logits(hidden)


@torch.no_grad()
def greedy(model: LlamaForCausalLM, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of `ids` (prefill once, then one token per call)."""
    attn = DenseCausalAttention()
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
    out: list[int] = []
    next_id = int(model.compute_logits(hidden[-1:]).argmax(-1))
    for _ in range(max_new_tokens):
        out.append(next_id)
        pos = len(ids) + len(out) - 1
        hidden = model(torch.tensor([next_id]), torch.tensor([pos]), attn)
        next_id = int(model.compute_logits(hidden).argmax(-1))
    return out
