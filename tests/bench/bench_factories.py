"""Factories for bench tests: small traces and workloads, built visibly (cost models:
tests/costmodel/costmodel_factories.py)."""

from __future__ import annotations

from pathlib import Path

from stallfree.bench.traces import load_trace, make_workload


def write_trace(path: Path, rows: list[tuple[int, int]], arrivals: list[float] | None = None) -> Path:
    head = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio"
    if arrivals is not None:
        head += ",arrived_at"
    lines = [head]
    for i, (p, d) in enumerate(rows):
        line = f"{p},{d},{p + d},{p / d}"
        if arrivals is not None:
            line += f",{arrivals[i]}"
        lines.append(line)
    path.write_text("\n".join(lines) + "\n")
    return path


def make_trace(tmp_path: Path, n: int = 200, prompt: int = 400, output: int = 20):
    """A trace whose prompts vary from prompt/2 to prompt*3/2 and outputs from output/2 to output*3/2."""
    rows = [(prompt // 2 + (i * 37) % prompt, output // 2 + (i * 11) % output) for i in range(n)]
    return load_trace(str(write_trace(tmp_path / "trace.csv", rows)))


def make_sim_workload(tmp_path: Path, n: int = 60, qps: float = 1.0, seed: int = 0, **kw):
    return make_workload(make_trace(tmp_path, **kw), n, qps=qps, seed=seed)
