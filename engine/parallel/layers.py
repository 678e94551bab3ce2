"""Tensor-parallel layers, cut from an already loaded full model.

Megatron's split: the first matmul of a block is column-parallel (each rank owns some output rows: a group
of attention heads, a slice of the MLP's intermediate size), the second is row-parallel (each rank owns the
matching input columns and the partial outputs are summed by one all-reduce). The embedding is split by
vocabulary rows (each rank embeds the ids it owns, zeros elsewhere, all-reduce) and so are the logits (each
rank projects onto its vocabulary rows, all-gather).

Heads are assigned by KV group, so a rank's query heads always read KV heads it holds:
  - num_kv_heads >= T: each rank owns whole KV groups (contiguous, as even as possible; uneven is exact,
    e.g. SmolLM2's 3 KV heads on 2 ranks become 2 + 1);
  - num_kv_heads <  T: each KV head is replicated on the ranks that share it and its group's query heads
    are split among them (every rank needs at least one query head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stallfree.engine.model.config import LlamaConfig
from stallfree.engine.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Collective(Protocol):
    """The tensor-parallel group's two collectives (torch.distributed in workers, stand-ins in tests)."""

    size: int

    def all_reduce(self, x: Tensor) -> Tensor: ...

    def all_gather_last(self, x: Tensor) -> Tensor: ...


class NoCollective:
    """Size-1 group, or the single-process tests' partial sums: every collective is the identity."""

    size = 1

    def all_reduce(self, x: Tensor) -> Tensor:
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        return x


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part `index` when n items are cut into `parts` contiguous, near-even pieces."""
    return index * n // parts, (index + 1) * n // parts


@dataclass(frozen=True, slots=True)
class HeadShard:
    q_heads: tuple[int, ...]  # global query head ids this rank computes
    kv_heads: tuple[int, ...]  # global KV head ids this rank holds (replicated when num_kv_heads < T)


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """Which query and KV heads rank `rank` of `tp_size` owns. Raises ValueError when T is too large."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        lo, hi = split_range(num_kv_heads, tp_size, rank)
        kv = tuple(range(lo, hi))
        return HeadShard(tuple(h for k in kv for h in range(k * group, (k + 1) * group)), kv)
    kv_head = rank * num_kv_heads // tp_size
    sharing = [r for r in range(tp_size) if r * num_kv_heads // tp_size == kv_head]
    if group < len(sharing):
        raise ValueError(
            f"tensor_parallel_size {tp_size} is too large for {num_heads} query heads in {num_kv_heads} KV "
            f"groups: {len(sharing)} ranks would share a group of {group} query heads"
        )
    lo, hi = split_range(group, len(sharing), sharing.index(rank))
    return HeadShard(tuple(range(kv_head * group + lo, kv_head * group + hi)), (kv_head,))


def _rows(heads: tuple[int, ...], head_dim: int, offset: int = 0) -> Tensor:
    return torch.cat([torch.arange(offset + h * head_dim, offset + (h + 1) * head_dim) for h in heads])


class RowParallelLinear(nn.Module):
    """y = all_reduce(x @ W_r^T) + b: W_r is this rank's slice of the input columns."""

    def __init__(self, weight: Tensor, bias: Tensor | None, comm: Collective) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (out, in / T)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    def forward(self, x: Tensor) -> Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + shard) of the embedding; ids outside embed to zero before the all-reduce.

    `weight` is padded with zero rows to the same shard size on every rank, so the logits all-gather
    exchanges equal shapes; the gathered logits are cut back to the vocabulary size.
    """

    def __init__(self, full: Tensor, tp_size: int, rank: int, comm: Collective) -> None:
        super().__init__()
        vocab, hidden = full.shape
        self.shard = -(-vocab // tp_size)
        self.start = rank * self.shard
        stop = min(self.start + self.shard, vocab)
        w = full.new_zeros(self.shard, hidden)
        w[: max(stop - self.start, 0)] = full[self.start : stop]
        self.weight = nn.Parameter(w, requires_grad=False)  # (V / T, C)
        self.comm = comm

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        x = F.embedding(local.clamp(0, self.shard - 1), self.weight)  # (T, C)
        return self.comm.all_reduce(x * inside.unsqueeze(-1).to(x.dtype))


@torch.no_grad()
def shard_attention(attn: LlamaAttention, cfg: LlamaConfig, tp: int, rank: int, comm: Collective) -> None:
    """Keep this rank's heads of the fused qkv_proj; o_proj becomes row-parallel over the same heads."""
    hs = head_shard(cfg.num_heads, cfg.num_kv_heads, tp, rank)
    hd = cfg.head_dim
    rows = torch.cat(
        [
            _rows(hs.q_heads, hd),
            _rows(hs.kv_heads, hd, cfg.q_size),
            _rows(hs.kv_heads, hd, cfg.q_size + cfg.kv_size),
        ]
    )
    qkv = attn.qkv_proj
    new = nn.Linear(qkv.in_features, len(rows), bias=qkv.bias is not None, device="meta")
    new.weight = nn.Parameter(qkv.weight.index_select(0, rows), requires_grad=False)
    if qkv.bias is not None:
        new.bias = nn.Parameter(qkv.bias.index_select(0, rows), requires_grad=False)
    attn.qkv_proj = new
    q_cols = _rows(hs.q_heads, hd)
    o = attn.o_proj
    attn.o_proj = RowParallelLinear(o.weight.index_select(1, q_cols), o.bias, comm)
    attn.num_heads, attn.num_kv_heads = len(hs.q_heads), len(hs.kv_heads)
    attn.q_size, attn.kv_size = len(hs.q_heads) * hd, len(hs.kv_heads) * hd


@torch.no_grad()
def shard_mlp(mlp: LlamaMLP, tp: int, rank: int, comm: Collective) -> None:
    """gate and up keep the same slice of the intermediate size; down_proj becomes row-parallel."""
    inter = mlp.intermediate_size
    lo, hi = split_range(inter, tp, rank)
    w = mlp.gate_up_proj.weight  # (2 I, C): gate rows, then up rows
    gate_up = torch.cat([w[lo:hi], w[inter + lo : inter + hi]])
    new = nn.Linear(w.shape[1], gate_up.shape[0], bias=False, device="meta")
    new.weight = nn.Parameter(gate_up, requires_grad=False)
    mlp.gate_up_proj = new
    mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, lo:hi].contiguous(), None, comm)
    mlp.intermediate_size = hi - lo


class GatheredLogits(nn.Module):
    """The LM head of a vocabulary-parallel model: (N, C) hidden -> (N, vocab) float32 logits of the whole
    vocabulary, this rank's rows projected and the ranks' shards gathered."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, comm: Collective) -> None:
        super().__init__()
        self.weight = weight  # (V / T, C): the sharded embedding's (tied) or lm_head's rows
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, hidden: Tensor) -> Tensor:
        part = F.linear(hidden, self.weight).float()  # (N, V / T)
        return self.comm.all_gather_last(part)[:, : self.vocab_size]


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, tp: int, rank: int, comm: Collective) -> None:
    """Cut every tensor-parallel layer of `model` down to rank `rank`'s share, in place.

    Norms and the rotary tables stay replicated. With tied embeddings the vocabulary-parallel embedding is
    also the LM head; an untied lm_head is cut by the same vocabulary rows. compute_logits then gathers the
    logits of the whole vocabulary (GatheredLogits).
    """
    cfg = model.config
    for layer in model.model.layers:
        shard_attention(layer.self_attn, cfg, tp, rank, comm)
        shard_mlp(layer.mlp, tp, rank, comm)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens.weight, tp, rank, comm)
    if model.lm_head is not None:
        head = VocabParallelEmbedding(model.lm_head.weight, tp, rank, NoCollective())
        new = nn.Linear(cfg.hidden_size, head.shard, bias=False, device="meta")
        new.weight = head.weight
        model.lm_head = new
    weight = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.logits_proj = GatheredLogits(weight, cfg.vocab_size, comm)
