"""Sampling on the GPU, with one device-to-host copy for the whole batch.

The CPU sampler (stallfree.engine.sampler) walks rows one by one and reads each token back as it goes; on a
GPU every such read is a host synchronisation. Here all rows are sampled by a few batched kernels:
temperature, top-k and top-p as per-row tensors, then the exponential race argmax(p / E), E ~ Exp(1), which
is a draw from p. Greedy rows take the argmax of the logits. Rows of requests with their own seed draw E
from their own generator (one small kernel per such row, no sync), so a seeded request draws the same
tokens whatever else shares its batches; the others share the sampler's generator.

The chosen tokens, their logprobs and the top-k logprobs travel back in one float64 tensor: one copy, one
synchronisation per iteration.
"""

from __future__ import annotations

import torch

from stallfree.engine.penalties import to_device
from stallfree.engine.sampler import Sampler, SampleRequest, SampleResult, mask_disallowed, min_p_mask


class GpuSampler(Sampler):
    """Same contract as `Sampler.sample` (and the same min_tokens rule); everything stays on the device."""

    def sample(self, logits: torch.Tensor, reqs: list[SampleRequest]) -> list[SampleResult]:
        """logits: (N, V) float32 on the device, one row per request in `reqs`."""
        dev = logits.device
        logits = logits.float()
        ban_rows, ban_cols = [], []
        for i, r in enumerate(reqs):
            for t in self._suppressed(r):
                ban_rows.append(i)
                ban_cols.append(t)
        if ban_rows:
            idx = to_device(torch.tensor([ban_rows, ban_cols], dtype=torch.int64), dev)
            logits = logits.index_put(
                (idx[0], idx[1]), torch.full((len(ban_rows),), float("-inf"), device=dev)
            )
        mask_disallowed(logits, reqs)  # the grammar first, as vLLM: penalties never revive a masked token
        logits = self.penalties.apply(logits, reqs)
        tokens = torch.argmax(logits, dim=-1)  # (N,) greedy for every row; random rows replaced below
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            tokens = self._sample_random(logits, reqs, random_rows, tokens)
        k = max((r.params.logprobs or 0) for r in reqs)
        need_lp = any(r.params.logprobs is not None for r in reqs)
        parts = [tokens.double()[:, None]]
        if need_lp:
            logprobs = torch.log_softmax(logits, dim=-1)  # (N, V)
            parts.append(logprobs.gather(1, tokens[:, None]).double())
            if k > 0:
                vals, ids = torch.topk(logprobs, k, dim=-1)  # (N, k)
                parts += [ids.double(), vals.double()]
        host = torch.cat(parts, dim=1).cpu()  # NOTE: the iteration's one synchronisation
        results = [self._result(row, r, k, need_lp) for row, r in zip(host.tolist(), reqs, strict=True)]
        self.penalties.record(reqs, [res.token_id for res in results])
        return results

    @staticmethod
    def _result(vals: list[float], req: SampleRequest, k: int, need_lp: bool) -> SampleResult:
        tok = int(vals[0])
        if not need_lp or req.params.logprobs is None:
            return SampleResult(tok)
        n = req.params.logprobs
        top = tuple((int(vals[2 + j]), vals[2 + k + j]) for j in range(n)) if k else ()
        return SampleResult(tok, vals[1], top)

    def _sample_random(
        self, logits: torch.Tensor, reqs: list[SampleRequest], rows: list[int], tokens: torch.Tensor
    ) -> torch.Tensor:
        dev = logits.device
        params = [reqs[i].params for i in rows]
        host = torch.tensor(
            [[p.temperature, p.top_k if p.top_k > 0 else 0, p.top_p, p.min_p] for p in params],
            dtype=torch.float32,
        )
        temp, top_k, top_p, min_p = to_device(host, dev).unbind(1)
        sel = to_device(torch.tensor(rows, dtype=torch.int64), dev)
        x = logits.index_select(0, sel) / temp[:, None]  # (R, V)
        if any(p.min_p > 0 for p in params):
            x = x.masked_fill(min_p_mask(x, min_p), float("-inf"))
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
            x = _top_k_top_p(x, top_k.long(), top_p)
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        shared = [j for j, i in enumerate(rows) if reqs[i].params.seed is None]
        if len(shared) == len(rows):
            noise.exponential_(generator=self._default)
        else:
            for j, i in enumerate(rows):
                noise[j].exponential_(generator=self._generator(reqs[i]))
        return tokens.index_copy(0, sel, torch.argmax(probs / noise, dim=-1))


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits x (R, V) outside each row's top-k (0 = all) and top-p nucleus, as `Sampler._sample_row`."""
    vocab = x.shape[1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_x.gather(1, (k - 1)[:, None])  # (R, 1)
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least the best token).
    drop = torch.cumsum(probs, dim=-1) - probs >= top_p[:, None]
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
