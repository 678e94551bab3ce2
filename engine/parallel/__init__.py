"""Tensor and pipeline parallelism: sharded layers, worker ranks, the leader-side executor."""
