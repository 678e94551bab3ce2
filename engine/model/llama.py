"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM2) over one flattened ragged batch.

The model sees T tokens from many requests at once, with their **absolute** positions, and never the KV
cache: attention is a callable handed in by the caller (the model runner), which owns the cache pages and
the per-request batch metadata. Shapes use T = tokens in the batch, nh = query heads, nkv = key/value
heads, hd = head dim, C = hidden size.

Parameter names follow Hugging Face checkpoint keys, except that q/k/v are fused into `qkv_proj` and
gate/up into `gate_up_proj` (one matmul each instead of three/two, which matters on CPU);
`load_hf_state_dict` does that fusing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stallfree.engine.model.config import Llama3RopeScaling, LlamaConfig

if TYPE_CHECKING:
    from stallfree.engine.model.cpu_stack import CpuStack, PagedRows


class AttentionFn(Protocol):
    """Causal attention over the KV cache, supplied by the model runner.

    Called once per layer with this batch's new queries/keys/values, already rotated (RoPE):
    q `(T, nh, hd)`, k and v `(T, nkv, hd)`. It must store k/v in its cache and return `(T, nh, hd)`:
    each token attending to its own request's history plus the causal part of the current chunk.
    K/V heads are not repeated for grouped-query attention: query head h reads kv head h // (nh // nkv).
    """

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 whatever the parameter dtype (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # One fused op instead of six small ones per norm (60 norms per iteration of a 30-layer model).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: Llama3RopeScaling | None = None,
    freq_factors: tuple[float, ...] | None = None,
) -> Tensor:
    """Inverse frequencies (hd/2,) of the rotary embedding, with optional Llama 3.1 scaling or divisors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float64)
    if scaling is not None:
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`; short ones are kept; the band between is blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, blended, scaled)
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """RoPE in the Hugging Face "rotate_half" layout: dims i and i + hd/2 form a rotating pair.

    cos/sin are precomputed for every position up to max_position_embeddings and indexed by the absolute
    positions of the batch's tokens.
    """

    cos_cache: Tensor
    sin_cache: Tensor

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(
            config.head_dim, config.rope_theta, config.rope_scaling, config.rope_freq_factors
        ).to(device)
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # (max_pos, hd/2)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin of shape (T, 1, hd/2) for positions (T,); broadcast over heads."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (T, n, hd) by position: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), halves of hd."""
    x1, x2 = x.chunk(2, dim=-1)  # (T, n, hd/2) each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: per-head RMSNorm of q and k (weights of size hd, shared by the heads), before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (nh + 2 nkv) hd)
        # q and k rotated together: one set of elementwise ops for both instead of one each.
        qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)  # (T, nh + nkv, hd)
        q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)  # (T, nkv, hd)
        out = attn(self.layer_idx, q, k, v)  # (T, nh, hd)
        return self.o_proj(out.reshape(T, self.q_size))  # (T, C)

    def split_qkv(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (T, nh, hd), k and v (T, nkv, hd) as views of a fused projection output (T, (nh + 2 nkv) hd)."""
        T = qkv.shape[0]
        q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def qkv_rope(self, x: Tensor, positions: Tensor, rotary: RotaryEmbedding, kernels: ModuleType) -> Tensor:
        """The fused path's projection (T, (nh + 2 nkv) hd), q and k rotated in place by one kernel."""
        qkv = self.qkv_proj(x)
        q, k, _ = self.split_qkv(qkv)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: normed in place (views of qkv)
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        kernels.rope_(q, k, positions, rotary.cos_cache, rotary.sin_cache)
        return qkv


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionFn) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def pre_attention(
        self,
        x: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        rotary: RotaryEmbedding,
        kernels: ModuleType,
    ) -> tuple[Tensor, Tensor]:
        """Fused path, up to attention: (rotated fused qkv (T, (nh + 2 nkv) hd), residual stream (T, C)).
        The residual add rides in the RMSNorm kernel (residual None: the first layer of a stage); same
        arithmetic as `forward`, fewer kernels. `kernels` is the module of fused ops (see
        LlamaForCausalLM.forward)."""
        norm = self.input_layernorm
        h, residual = kernels.add_rmsnorm(x, residual, norm.weight, norm.eps)
        return self.self_attn.qkv_rope(h, positions, rotary, kernels), residual

    def post_attention(
        self, attn_out: Tensor, residual: Tensor, kernels: ModuleType
    ) -> tuple[Tensor, Tensor]:
        """Fused path, from the attention output (T, nh, hd): (MLP branch output (T, C), residual stream)."""
        x = self.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1))
        norm = self.post_attention_layernorm
        h, residual = kernels.add_rmsnorm(x, residual, norm.weight, norm.eps)
        mlp = self.mlp
        return mlp.down_proj(kernels.silu_and_mul(mlp.gate_up_proj(h))), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head, or one pipeline stage of it. `forward` returns final hidden states;
    `compute_logits` projects them.

    Logits are computed separately so that the runner projects only the rows it samples from (the last
    token of a finished prefill, each decode), not every prompt token.

    Pipeline roles: a whole model is both its first and its last stage. `keep_layers` makes it one stage of a
    pipeline (stallfree.engine.parallel.stage.build_stage): the first stage embeds token ids, a later one
    takes the previous stage's output; the last one ends in the final norm, an earlier one hands its
    residual stream on whole. Same class, same forward, same CUDA graphs (stallfree.engine.cuda_graphs).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # With tied embeddings the LM head *is* the embedding matrix; there is no separate parameter.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(config)
        # Set by cpu_linear.pack_for_cpu: the LM head in compact weights (the embedding stays for lookups),
        # and the layers as one C++ call (cpu_stack.CpuStack) where the model allows it. Set by
        # parallel.layers.shard_model: the LM head of this rank's vocabulary rows, the logits gathered.
        self.logits_proj: nn.Module | None = None
        self.cpu_stack: CpuStack | None = None
        # Pipeline roles (see the class doc): this stage's decoder layers [first, last) of the whole model.
        self.first_stage = self.last_stage = True
        self.layer_range = (0, config.num_layers)

    @property
    def num_layers(self) -> int:
        """Decoder layers this model (or stage) runs."""
        return len(self.model.layers)

    def keep_layers(self, first: int, last: int, *, first_stage: bool, last_stage: bool) -> None:
        """Become the pipeline stage of decoder layers [first, last), in place (the others are dropped)."""
        self.model.layers = nn.ModuleList(self.model.layers[first:last])
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.layer_idx = i  # NOTE: an index into this rank's KV cache: only these layers
        self.first_stage, self.last_stage = first_stage, last_stage
        self.layer_range = (first, last)
        self.cpu_stack = None  # NOTE: the C++ stack runs a whole model (every layer and the final norm)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        attn: AttentionFn,
        kernels: ModuleType | None = None,
        paged_rows: PagedRows | None = None,
    ) -> Tensor:
        """Run the decoder (or this stage's layers) over one flattened ragged batch.

        x: (T,) int64 token ids on the first stage (a whole model is one), else (T, C) the previous stage's
        output. positions: (T,) int64. NOTE: positions are absolute (the token's index in its own request,
        counting the cached history), not offsets within this chunk or batch; a prefill chunk starting at
        token 512 of its prompt uses positions 512, 513, ... Each must be below
        config.max_position_embeddings. Returns (T, C): hidden states after the final norm on the last
        stage, else the residual stream to hand on.
        kernels: the module whose add_rmsnorm / rope_ / silu_and_mul run the layers' elementwise work (the
        attention backend's `kernels`: stallfree.engine.kernels.fused's Triton kernels on CUDA, .cpu_fused's
        C++ ones on the CPU), or None for plain torch ops (the reference path).
        paged_rows: what the attention backend offers a model that stores and attends by itself
        (AttentionBackend.paged_rows: the cpu backend's caches and per-row tables); a model packed for the
        CPU then runs its layers in one C++ call (cpu_stack), else it is not needed.
        """
        if self.first_stage:
            x = self.model.embed_tokens(x)  # (T, C)
        if self.cpu_stack is not None and paged_rows is not None and x.dtype == torch.bfloat16:
            return self.cpu_stack(x, positions, paged_rows)  # the fused path below, bit for bit, from C++
        if kernels is not None:
            out, residual = self.segment(0, x, None, positions, kernels)
            for s in range(1, self.num_layers + 1):
                attn_layer = self.model.layers[s - 1].self_attn
                h = attn(attn_layer.layer_idx, *attn_layer.split_qkv(out))  # (T, nh, hd)
                out, residual = self.segment(s, h, residual, positions, kernels)
            return out
        cos, sin = self.rotary(positions)  # (T, 1, hd/2) each, float32, shared by all layers
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # cast once, not per layer
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x) if self.last_stage else x

    def segment(
        self, s: int, h: Tensor, residual: Tensor | None, positions: Tensor, kernels: ModuleType
    ) -> tuple[Tensor, Tensor | None]:
        """Piece s (0 .. L, L = num_layers) of the fused forward, the work between two attentions.

        s = 0 takes the stage's input h (T, C) (embedded on the first stage), residual None; s > 0 takes
        layer s - 1's attention output h (T, nh, hd) and runs its o_proj, add+RMSNorm and MLP. s < L then
        runs layer s up to its attention and returns (its rotated fused qkv (T, (nh + 2 nkv) hd), the
        residual stream (T, C)); s = L returns (the final norm's output on the last stage, else the residual
        stream whole, (T, C); None). The eager forward runs the pieces with attention between them; the
        piecewise CUDA graphs capture one graph per piece.
        """
        layers, x = self.model.layers, h
        if s > 0:
            x, residual = layers[s - 1].post_attention(h, residual, kernels)
        if s < len(layers):
            return layers[s].pre_attention(x, residual, positions, self.rotary, kernels)
        assert residual is not None
        if not self.last_stage:
            return x + residual, None  # NOTE: the next stage takes the residual stream whole
        norm = self.model.norm
        return kernels.add_rmsnorm(x, residual, norm.weight, norm.eps)[0], None

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """(N, C) hidden states -> (N, vocab) float32 logits."""
        if self.logits_proj is not None:
            return self.logits_proj(hidden).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def num_params(self) -> int:
        """Number of weights (a tied embedding counted once; rotary caches are buffers, not counted)."""
        return sum(p.numel() for p in self.parameters())

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV-cache bytes one token needs across all layers: 2 * layers * nkv * hd * element size."""
        return self.config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())

    @torch.no_grad()
    def load_hf_state_dict(self, weights: Mapping[str, Tensor]) -> None:
        """Copy weights named as in a Hugging Face Llama checkpoint into this model (fusing q/k/v, gate/up).

        Raises ValueError naming the missing, unexpected or mis-shaped tensors.
        """
        load_hf_weights(self, weights)

    @classmethod
    def from_hf_state_dict(
        cls,
        config: LlamaConfig,
        weights: Mapping[str, Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LlamaForCausalLM:
        """Build the model straight from HF-named weights, without a wasted random initialisation.

        The (fused) checkpoint tensors become the parameters themselves when dtype and device already
        match: no copy. Raises ValueError when names or shapes do not match the config.
        """
        with torch.device("meta"):
            model = cls(config)
        fused = {k: v.to(device=device, dtype=dtype) for k, v in hf_to_fused(config, weights).items()}
        _check_names_and_shapes(model, fused)
        model.load_state_dict(fused, strict=True, assign=True)
        model.rotary = RotaryEmbedding(config, device=device)  # its buffers are derived, not loaded
        return model.eval()


def hf_to_fused(config: LlamaConfig, weights: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Map HF checkpoint keys to this module's keys: q/k/v -> qkv_proj, gate/up -> gate_up_proj.

    Ignores `*.rotary_emb.inv_freq` (a derived buffer some checkpoints carry) and `lm_head.weight` when
    the embeddings are tied.
    """
    out: dict[str, Tensor] = {}
    pending: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            pending[name] = tensor
        else:
            out[name] = tensor
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind in ("weight", "bias"):
            parts = [pending.pop(f"{attn}.{p}.{kind}", None) for p in ("q_proj", "k_proj", "v_proj")]
            if all(p is not None for p in parts):
                out[f"{attn}.qkv_proj.{kind}"] = torch.cat(parts, dim=0)  # type: ignore[arg-type]
            elif any(p is not None for p in parts):
                raise ValueError(f"layer {i}: q_proj/k_proj/v_proj {kind}s must all be present or all absent")
        gate, up = pending.pop(f"{mlp}.gate_proj.weight", None), pending.pop(f"{mlp}.up_proj.weight", None)
        if gate is not None and up is not None:
            out[f"{mlp}.gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
    if pending:
        raise ValueError(f"unexpected weights for a {config.num_layers}-layer model: {sorted(pending)[:5]}")
    return out


def load_hf_weights(model: LlamaForCausalLM, weights: Mapping[str, Tensor]) -> None:
    """Copy HF-named weights into `model` in place (see `hf_to_fused`), checking names and shapes."""
    fused = hf_to_fused(model.config, weights)
    _check_names_and_shapes(model, fused)
    params = dict(model.named_parameters())
    for name, tensor in fused.items():
        params[name].copy_(tensor)


def _check_names_and_shapes(model: nn.Module, fused: Mapping[str, Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(fused))
    unexpected = sorted(set(fused) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in fused.items():
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != shape {tuple(params[name].shape)} from the config"
            )
