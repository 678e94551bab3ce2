"""The one description of an iteration that every attention backend builds its metadata from.

`host_batch` is the only place that turns the scheduler's chunks and block tables into KV-cache slots: the
token ids, absolute positions, KV slots, the decodes' block tables and lengths, the prefill chunks' offsets,
tables and history slots, the rows to sample, all in numpy. `Stager` copies them to the device in one
transfer (from pinned memory on CUDA, without a synchronisation) as a `DeviceBatch`. Nothing is ever read
back from the device to plan a batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stallfree.engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class HostBatch:
    """One iteration as numpy int64 arrays; rows are decodes first, then prefill chunks."""

    input_ids: np.ndarray  # (T,)
    positions: np.ndarray  # (T,) NOTE: absolute positions in each request, never restarted per chunk
    slot_mapping: np.ndarray  # (T,) cache slot (block * block_size + offset) each new token's K/V goes to
    num_decodes: int
    decode_lens: np.ndarray  # (D,) keys each decode attends to, its new token included
    decode_tables: np.ndarray  # (D, P) block tables, padded with block 0
    prefill_q_starts: np.ndarray  # (C,) first row of each prefill chunk in the flat batch
    prefill_q_lens: np.ndarray  # (C,)
    prefill_ctx_lens: np.ndarray  # (C,) tokens cached before the chunk (= its first absolute position)
    prefill_tables: np.ndarray  # (C, P')
    # Cache slots of every chunk's whole history (positions 0 .. ctx_len + q_len), concatenated, and where
    # chunk c's run starts (C + 1 offsets): what a dense attention kernel gathers from the pages.
    prefill_hist_slots: np.ndarray
    prefill_hist_offsets: np.ndarray
    sample_rows: np.ndarray  # (N,) rows whose logits are sampled: decodes, and prefills that just finished

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_tokens


def _table(rows: list[tuple[int, ...]], pages: list[int]) -> np.ndarray:
    out = np.zeros((len(rows), max(pages, default=1)), dtype=np.int64)
    for i, (row, n) in enumerate(zip(rows, pages, strict=True)):
        out[i, :n] = row[:n]
    return out


def host_batch(out: SchedulerOutput, block_size: int) -> HostBatch:
    """Lay out the scheduler's chunks (decodes first) as the arrays of a `HostBatch`."""
    chunks = out.chunks
    T = out.num_tokens
    ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=T)
    pos = np.empty(T, dtype=np.int64)
    slots = np.empty(T, dtype=np.int64)
    dec_lens, dec_rows, dec_pages = [], [], []
    q_starts, q_lens, ctx, pre_rows, pre_pages, sample_rows = [], [], [], [], [], []
    hist: list[np.ndarray] = []
    hist_offsets = [0]
    row = 0
    for c in chunks:
        n = c.num_tokens
        kv_len = c.start + n
        pages = -(-kv_len // block_size)
        if c.is_decode:
            pos[row] = c.start
            slots[row] = c.block_table[c.start // block_size] * block_size + c.start % block_size
            dec_lens.append(kv_len)
            dec_rows.append(c.block_table)
            dec_pages.append(pages)
        else:
            p = np.arange(kv_len, dtype=np.int64)
            table = np.asarray(c.block_table[:pages], dtype=np.int64)
            history = table[p // block_size] * block_size + p % block_size  # (kv_len,) slots
            pos[row : row + n] = p[c.start :]
            slots[row : row + n] = history[c.start :]  # the chunk's own tokens end its history
            hist.append(history)
            hist_offsets.append(hist_offsets[-1] + kv_len)
            q_starts.append(row)
            q_lens.append(n)
            ctx.append(c.start)
            pre_rows.append(c.block_table)
            pre_pages.append(pages)
        row += n
        if c.sample:
            sample_rows.append(row - 1)  # the chunk's last token predicts the next one
    i64 = np.int64
    return HostBatch(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        num_decodes=len(dec_lens),
        decode_lens=np.asarray(dec_lens, dtype=i64),
        decode_tables=_table(dec_rows, dec_pages),
        prefill_q_starts=np.asarray(q_starts, dtype=i64),
        prefill_q_lens=np.asarray(q_lens, dtype=i64),
        prefill_ctx_lens=np.asarray(ctx, dtype=i64),
        prefill_tables=_table(pre_rows, pre_pages),
        prefill_hist_slots=np.concatenate(hist) if hist else np.zeros(0, dtype=i64),
        prefill_hist_offsets=np.asarray(hist_offsets, dtype=i64),
        sample_rows=np.asarray(sample_rows, dtype=i64),
    )


@dataclass(frozen=True, slots=True)
class DeviceBatch:
    """The arrays of a `HostBatch` on the device (int64 views into one staging buffer, valid for one
    iteration), with the host batch itself for what sizes kernel grids and plans."""

    host: HostBatch
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    slot_mapping: torch.Tensor  # (T,)
    decode_lens: torch.Tensor  # (D,)
    decode_tables: torch.Tensor  # (D, P)
    prefill_q_starts: torch.Tensor  # (C,)
    prefill_q_lens: torch.Tensor
    prefill_ctx_lens: torch.Tensor
    prefill_tables: torch.Tensor  # (C, P')
    prefill_hist_slots: torch.Tensor  # every chunk's history slots, concatenated (HostBatch)
    sample_rows: torch.Tensor  # (N,)


class Stager:
    """Copies a list of int64 numpy arrays to the device in one transfer, through a reused pinned buffer.

    NOTE: the pinned buffer is rewritten only after the previous transfer has finished (a CUDA event), so a
    transfer still in flight is never corrupted; the runner synchronises once per iteration anyway.
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._alloc(capacity)
        self._done = torch.cuda.Event() if self._pinned else None

    def _alloc(self, n: int) -> None:
        self._host = torch.empty(n, dtype=torch.int64, pin_memory=self._pinned)
        self._dev = torch.empty(n, dtype=torch.int64, device=self.device)

    def stage(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors with the arrays' shapes (views into one device buffer, valid until the next call)."""
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self._done is not None:
            self._done.synchronize()
        if total > self._host.numel():
            self._alloc(max(total, 2 * self._host.numel()))
        host = self._host.numpy()
        offset = 0
        for a, n in zip(arrays, sizes, strict=True):
            host[offset : offset + n] = a.reshape(-1)
            offset += n
        dev = self._dev[:total]
        dev.copy_(self._host[:total], non_blocking=self._pinned)
        if self._done is not None:
            self._done.record()
        views, offset = [], 0
        for a, n in zip(arrays, sizes, strict=True):
            views.append(dev[offset : offset + n].view(a.shape))
            offset += n
        return views

    def stage_batch(self, hb: HostBatch) -> DeviceBatch:
        """The whole host batch on the device, in one transfer."""
        return DeviceBatch(
            hb,
            *self.stage(
                [
                    hb.input_ids, hb.positions, hb.slot_mapping, hb.decode_lens, hb.decode_tables,
                    hb.prefill_q_starts, hb.prefill_q_lens, hb.prefill_ctx_lens, hb.prefill_tables,
                    hb.prefill_hist_slots, hb.sample_rows,
                ]
            ),
        )  # fmt: skip
