"""CUDA graphs for the runner: whole decode iterations, and the pieces of hybrid iterations.

Each graph class holds the model and the attention backend (which must support graphs: its `decode_fn`,
`splits`, `bind(..., store=False)` and fused `kernels`), never the runner.

- `DecodeGraphs`: a decode-only iteration (model + logits) is one graph per padded batch size; padding rows
  write no K/V (slot -1) and attend to nothing (length 0).
- `PiecewiseGraphs`: an iteration with prefill chunks (alone or with decodes riding along) up to a few
  thousand tokens: the forward between two attentions (o_proj, add+RMSNorm, MLP, add+RMSNorm, the next
  layer's QKV, RoPE and K/V store) is one graph per padded token count, and attention, whose shape depends
  on every request's history, runs eagerly in between. Per iteration that is L + 1 graph launches and L
  attention calls instead of ~12 launches per layer from Python, which made a 512-token hybrid iteration
  host-bound on the H200 (docs/gpu.md).

Graphs read and write persistent buffers that a replay fills first; all are captured at start-up, before the
engine reports ready.
"""

from __future__ import annotations

import gc

import torch
from torch import nn

from stallfree.engine.attention.backend import AttentionBackend
from stallfree.engine.attention.batch import HostBatch
from stallfree.engine.model.llama import AttentionFn


def graph_batch_sizes(max_num_seqs: int, largest: int = 512) -> list[int]:
    """Padded decode batch sizes to capture: 1, 2, 4, 8, then steps of 8 to 32, of 16 to 128, of 32 on."""
    sizes = [1, 2, 4, 8, *range(16, 33, 8), *range(48, 129, 16), *range(160, largest + 1, 32)]
    cap = min(max_num_seqs, largest)
    out = [s for s in sizes if s < cap]
    return [*out, cap] if cap not in out else out


class DecodeGraphs:
    """CUDA graphs of whole decode iterations (model + logits), one per padded batch size.

    The graphs read persistent device buffers (token ids, positions, KV slots, block tables, lengths); a
    replay first fills them from pinned host mirrors with asynchronous copies.
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, sizes: list[int], max_pages: int) -> None:
        self.model, self.backend = model, backend
        self.sizes = sorted(sizes)
        dev = backend.cache.device
        n = self.sizes[-1]
        self.host = {
            "ids": torch.zeros(n, dtype=torch.int64, pin_memory=True),
            "pos": torch.zeros(n, dtype=torch.int64, pin_memory=True),
            "slots": torch.full((n,), -1, dtype=torch.int64, pin_memory=True),
            "lens": torch.zeros(n, dtype=torch.int64, pin_memory=True),
            "tables": torch.zeros((n, max_pages), dtype=torch.int64, pin_memory=True),
        }
        self.dev = {k: torch.zeros_like(v, device=dev) for k, v in self.host.items()}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._copied = torch.cuda.Event()

    def padded(self, batch: int) -> int | None:
        """The smallest captured size that holds `batch` decodes (None when none does)."""
        return next((s for s in self.sizes if s >= batch), None)

    def fits(self, hb: HostBatch) -> bool:
        """Whether this iteration replays a decode graph: decodes only, and few enough of them."""
        return hb.decode_only and self.padded(hb.num_decodes) is not None

    def _forward(self, size: int) -> torch.Tensor:
        b, d = self.backend, self.dev
        attend = b.decode_fn(d["slots"][:size], d["tables"][:size], d["lens"][:size], b.splits(size))
        hidden = self.model(d["ids"][:size], d["pos"][:size], attend, b.kernels)  # (size, C)
        return self.model.compute_logits(hidden)  # (size, V) float32

    def capture(self, pool) -> None:
        with _NoGC():
            self._capture(pool)

    def _capture(self, pool) -> None:
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self._fill_dummy(size)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(size)  # compiles the kernels for this shape outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def _fill_dummy(self, size: int) -> None:
        for key, value in (("ids", 0), ("pos", 0), ("slots", -1), ("lens", 1), ("tables", 0)):
            self.dev[key][:size].fill_(value)

    def run(self, hb: HostBatch) -> torch.Tensor:
        """Replay the graph for this decode-only batch; returns its logits (D, V)."""
        D = hb.num_decodes
        size = self.padded(D)
        assert size is not None
        self._copied.synchronize()  # the mirrors may be rewritten only once the last copies have landed
        h = self.host
        h["ids"][:D] = torch.from_numpy(hb.input_ids)
        h["pos"][:D] = torch.from_numpy(hb.positions)
        h["slots"][:D] = torch.from_numpy(hb.slot_mapping)
        h["slots"][D:size] = -1
        h["lens"][:D] = torch.from_numpy(hb.decode_lens)
        h["lens"][D:size] = 0
        width = hb.decode_tables.shape[1]
        h["tables"][:D, :width] = torch.from_numpy(hb.decode_tables)
        for key in self.host:
            self.dev[key][:size].copy_(h[key][:size], non_blocking=True)
        self._copied.record()
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:D]


def piecewise_sizes(largest: int = 1024) -> list[int]:
    """Padded token counts of hybrid iterations: steps of 32 (a GEMM tile) up to `largest`.

    NOTE: 32-token steps, because padding costs real GEMM rows: on the H200 a 544-token hybrid iteration
    padded to 576 paid for it. Above 1024 tokens the eager path measured better (chunked prefill at budget
    2048: 1.05x one-shot eager, 1.13x piecewise), so iterations that large run eagerly.
    """
    return list(range(32, largest + 1, 32)) if largest >= 32 else []


class _NoGC:
    """Keeps Python's cyclic GC from running during a capture: collecting an old engine's CUDA graph then
    (cudaGraphExecDestroy) invalidates the capture in progress (seen on the H200 when tests build engines
    one after another)."""

    def __enter__(self) -> None:
        gc.collect()
        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc) -> None:
        if self._was:
            gc.enable()


class PiecewiseGraphs:
    """The forward between attentions as CUDA graphs, per padded token count (see the module docstring).

    Persistent buffers (largest size, sliced): token ids, positions, KV slots (inputs), the current layer's
    fused qkv, the residual stream, the attention output and the final hidden states. Segment s of a size
    runs layer s - 1's post-attention part and layer s's pre-attention part (s = 0: the embedding; s = L: the
    final norm).
    """

    def __init__(self, model: nn.Module, backend: AttentionBackend, sizes: list[int]) -> None:
        self.model, self.backend = model, backend
        self.sizes = sorted(sizes)
        dev = backend.cache.device
        cfg = model.config
        n, dtype = self.sizes[-1], model.model.embed_tokens.weight.dtype
        self.num_layers = cfg.num_layers
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        width = cfg.q_size + 2 * cfg.kv_size
        self.qkv = torch.zeros(n, width, dtype=dtype, device=dev)  # (n, (nh + 2 nkv) hd)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.attn = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=dtype, device=dev)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def padded(self, tokens: int) -> int | None:
        """The smallest captured size that holds `tokens` (None when none does or before capture)."""
        return next((s for s in self.sizes if s >= tokens and s in self.graphs), None)

    def _segment(self, s: int, size: int) -> None:
        m, fused = self.model, self.backend.kernels
        layers = m.model.layers
        if s == 0:
            x, residual = m.model.embed_tokens(self.ids[:size]), None
        else:
            x, residual = layers[s - 1].post_attention(self.attn[:size], self.residual[:size], fused)
        if s == self.num_layers:
            self.hidden[:size].copy_(fused.add_rmsnorm(x, residual, m.model.norm.weight, m.model.norm.eps)[0])
            return
        qkv, residual = layers[s].pre_attention(x, residual, self.pos[:size], m.rotary, fused)
        _, k, v = layers[s].self_attn.split_qkv(qkv)
        kf, vf = self.backend.cache.flat(s)
        fused.store_kv(k, v, kf, vf, self.slots[:size])
        self.qkv[:size].copy_(qkv)
        self.residual[:size].copy_(residual)

    def capture(self, pool) -> None:
        with _NoGC():
            self._capture(pool)

    def _capture(self, pool) -> None:
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            self.slots[:size].fill_(-1)  # padding and warm-up rows write no K/V
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for s in range(self.num_layers + 1):
                    self._segment(s, size)  # compiles every kernel for this shape outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graphs = []
            for s in range(self.num_layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._segment(s, size)
                graphs.append(graph)
            self.graphs[size] = graphs
        torch.cuda.synchronize()

    def run(
        self, hb: HostBatch, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, attend: AttentionFn
    ) -> torch.Tensor:
        """Forward of a batch of T tokens (device inputs already staged); returns hidden states (T, C)."""
        T = hb.num_tokens
        size = self.padded(T)
        assert size is not None
        self.ids[:T].copy_(ids)
        self.pos[:T].copy_(pos)
        self.slots[:T].copy_(slots)
        if size > T:
            self.slots[T:size].fill_(-1)
        split = self.model.model.layers[0].self_attn.split_qkv
        graphs = self.graphs[size]
        for s in range(self.num_layers + 1):
            graphs[s].replay()
            if s < self.num_layers:
                q, k, v = split(self.qkv[:T])
                self.attn[:T].copy_(attend(s, q, k, v))
        return self.hidden[:T]
