"""The paged KV cache: per layer one K and one V tensor of pages."""

from __future__ import annotations

import torch


class KVCache:
    """Per layer one K and one V tensor of shape (num_blocks, block_size, num_kv_heads, head_dim).

    Separate K and V tensors (FlashInfer's NHD tuple layout) keep each one's flat slot view contiguous.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_blocks * block_size, num_kv_heads, head_dim) views of one layer's K and V."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, k.shape[2], k.shape[3]), v.view(-1, v.shape[2], v.shape[3])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kf, vf = self.flat(layer)
        kf.index_copy_(0, slots, k.to(kf.dtype))
        vf.index_copy_(0, slots, v.to(vf.dtype))
