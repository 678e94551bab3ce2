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

Both work on the model class, whole or as one pipeline stage (the parallel workers), and run its own forward:
the decode graphs capture `forward` and `compute_logits`, the piecewise ones its `segment`s. A later stage's
graphs read the previous stage's hidden states from a persistent input buffer instead of embedding token ids,
and a stage before the last ends with its residual stream (what it hands on) instead of the final norm and
logits.
Tensor-parallel collectives (the all-reduces after o_proj and down_proj, the logits' all-gather) are
captured with the layers.

Graphs read and write persistent buffers that a replay fills first; all are captured at start-up, before the
engine reports ready.
"""

from __future__ import annotations

import gc

import torch

from stallfree.engine.attention.backend import AttentionBackend
from stallfree.engine.attention.batch import HostBatch
from stallfree.engine.model.llama import AttentionFn, LlamaForCausalLM


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

    def __init__(
        self, model: LlamaForCausalLM, backend: AttentionBackend, sizes: list[int], max_pages: int
    ) -> None:
        self.model, self.backend = model, backend
        self.sizes = sorted(sizes)
        dev = backend.cache.device
        n = self.sizes[-1]
        pin = dev.type == "cuda"  # (a CPU stand-in in the tests builds these too)
        self.host = {
            "ids": torch.zeros(n, dtype=torch.int64, pin_memory=pin),
            "pos": torch.zeros(n, dtype=torch.int64, pin_memory=pin),
            "slots": torch.full((n,), -1, dtype=torch.int64, pin_memory=pin),
            "lens": torch.zeros(n, dtype=torch.int64, pin_memory=pin),
            "tables": torch.zeros((n, max_pages), dtype=torch.int64, pin_memory=pin),
        }
        self.dev = {k: torch.zeros_like(v, device=dev) for k, v in self.host.items()}
        self.last = model.last_stage  # ends in logits; else in the hidden states handed on
        # A later pipeline stage's input: the previous stage's hidden states, copied in before a replay.
        self.x_in = None if model.first_stage else _hidden_buffer(model, n, dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._copied = torch.cuda.Event() if pin else None

    def padded(self, batch: int) -> int | None:
        """The smallest captured size that holds `batch` decodes (None when none does)."""
        return next((s for s in self.sizes if s >= batch), None)

    def fits(self, hb: HostBatch) -> bool:
        """Whether this iteration replays a decode graph: decodes only, and few enough of them."""
        return hb.decode_only and self.padded(hb.num_decodes) is not None

    def _forward(self, size: int) -> torch.Tensor:
        b, d = self.backend, self.dev
        attend = b.decode_fn(d["slots"][:size], d["tables"][:size], d["lens"][:size], b.splits(size))
        x = d["ids"][:size] if self.x_in is None else self.x_in[:size]
        hidden = self.model(x, d["pos"][:size], attend, b.kernels)  # (size, C)
        return self.model.compute_logits(hidden) if self.last else hidden  # (size, V) float32 | (size, C)

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

    def run(self, hb: HostBatch, x: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the graph for this decode-only batch; returns its logits (D, V), or on a stage before the
        last its hidden states (D, C) (a view of a persistent buffer: the next replay overwrites it).
        x: a later stage's input, the previous stage's hidden states (D, C)."""
        D = hb.num_decodes
        size = self.padded(D)
        assert size is not None
        if self.x_in is not None:
            assert x is not None, "a later pipeline stage replays with the previous stage's hidden states"
            self.x_in[:D].copy_(x)
        if self._copied is not None:
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
        if self._copied is not None:
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


def _hidden_buffer(model: LlamaForCausalLM, rows: int, device: torch.device) -> torch.Tensor:
    """A persistent (rows, C) buffer in the model's activation dtype."""
    norm = model.model.layers[0].input_layernorm.weight
    return torch.zeros(rows, model.config.hidden_size, dtype=norm.dtype, device=device)


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

    Persistent buffers (largest size, sliced): token ids or, on a later pipeline stage, the previous stage's
    hidden states, positions, KV slots (inputs), the current layer's fused qkv, the residual stream, the
    attention output and the final hidden states. Graph s of a size is the model's `segment(s)` (layer
    s - 1's post-attention part and layer s's pre-attention part; s = 0 starts with the embedding, or the
    input as it came; s = L ends in the final norm, or on a stage before the last the residual stream it
    hands on), plus the K/V store of layer s. Head counts are this rank's (tensor parallel shards them).
    """

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, sizes: list[int]) -> None:
        self.model, self.backend = model, backend
        self.sizes = sorted(sizes)
        dev = backend.cache.device
        n = self.sizes[-1]
        attn = model.model.layers[0].self_attn
        self.num_layers = model.num_layers
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.x_in = None if model.first_stage else _hidden_buffer(model, n, dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.residual = _hidden_buffer(model, n, dev)
        dtype = self.residual.dtype
        width = attn.q_size + 2 * attn.kv_size
        self.qkv = torch.zeros(n, width, dtype=dtype, device=dev)  # (n, (nh + 2 nkv) hd)
        self.attn = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=dev)
        self.hidden = _hidden_buffer(model, n, dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def padded(self, tokens: int) -> int | None:
        """The smallest captured size that holds `tokens` (None when none does or before capture)."""
        return next((s for s in self.sizes if s >= tokens and s in self.graphs), None)

    def _segment(self, s: int, size: int) -> None:
        model, fused = self.model, self.backend.kernels
        if s == 0:
            h = model.model.embed_tokens(self.ids[:size]) if self.x_in is None else self.x_in[:size]
            residual = None
        else:
            h, residual = self.attn[:size], self.residual[:size]
        out, residual = model.segment(s, h, residual, self.pos[:size], fused)
        if s == self.num_layers:
            self.hidden[:size].copy_(out)  # the final norm's output, or the residual stream handed on
            return
        _, k, v = model.model.layers[s].self_attn.split_qkv(out)
        kf, vf = self.backend.cache.flat(s)
        fused.store_kv(k, v, kf, vf, self.slots[:size])
        self.qkv[:size].copy_(out)
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
        """Forward of a batch of T tokens (device inputs already staged); returns hidden states (T, C), a view
        of a persistent buffer. `ids`: token ids (T,), or on a later pipeline stage the previous stage's
        hidden states (T, C)."""
        T = hb.num_tokens
        size = self.padded(T)
        assert size is not None
        (self.ids if self.x_in is None else self.x_in)[:T].copy_(ids)
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
