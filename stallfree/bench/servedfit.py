"""Fit the cost model to a server's own iterations (`stallfree profile --from-log LOG ...`).

`stallfree serve --iteration-log FILE` writes one line per iteration: its chunks, the step's wall time, and
the period from the previous iteration's end (stallfree.engine.server.iteration_log). The period is what a
streaming client sees between tokens, so it is the default target: it includes the per-stream work the
server does between steps, which an offline profile of the forward pass alone does not see. Iterations
after an idle engine have no period and are skipped.

A seeded fraction of the iterations is held out, in contiguous blocks (neighbouring iterations look
alike, so a random split would flatter the fit), and the model's error on them is reported.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from stallfree.costmodel.features import iteration_features
from stallfree.costmodel.fit import fit_held_out
from stallfree.costmodel.fitted import FittedCostModel

TARGETS = ("period", "step")
BLOCK = 50  # iterations per hold-out block


class Shape(NamedTuple):
    num_tokens: int
    start: int
    is_decode: bool


def read_log(paths: Sequence[str | Path], target: str = "period") -> list[dict]:
    """Points {"features", "time_s", "decodes", "prefill_tokens", "source"} from iteration logs; raises
    ValueError naming the file and line of anything that is not an iteration record."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    key = "period_s" if target == "period" else "step_s"
    points: list[dict] = []
    for path in map(Path, paths):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError as e:
            raise ValueError(f"{path}: no such iteration log (write one with `stallfree serve "
                             "--iteration-log FILE`)") from e  # fmt: skip
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                chunks = [Shape(int(n), int(s), bool(d)) for n, s, d in rec["chunks"]]
                value = rec[key]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{no}: not an iteration record ({e})") from e
            if value is None or value <= 0 or not chunks:
                continue
            f = iteration_features(chunks)
            points.append(
                {
                    "features": f,
                    "time_s": float(value),
                    "decodes": int(f["decode_tokens"]),
                    "prefill_tokens": int(f["prefill_tokens"]),
                    "source": path.name,
                }
            )
    if not points:
        raise ValueError(f"no iterations with a {key} in {', '.join(map(str, paths))}")
    return points


def block_holdout(n: int, fraction: float, seed: int, block: int = BLOCK) -> set[int]:
    """Indices of a seeded `fraction` of contiguous blocks of `block` iterations (at least one block when
    fraction > 0 and there are two blocks or more)."""
    if not fraction:
        return set()
    blocks = (n + block - 1) // block
    if blocks < 2:
        return set()
    k = min(blocks - 1, max(1, int(round(blocks * fraction))))
    chosen = np.random.default_rng(seed).choice(blocks, size=k, replace=False)
    return {i for b in chosen.tolist() for i in range(b * block, min(n, (b + 1) * block))}


def fit_points(points: list[dict], holdout: float, seed: int) -> tuple[FittedCostModel, dict]:
    model, fit_error = fit_held_out(points, block_holdout(len(points), holdout, seed))
    # What the SLO cares about: the tail of the iteration times, measured vs predicted on held-out data.
    fit_error["held_out_p99_s"] = _p99_pair([p for p in points if p["held_out"]])
    return model, fit_error


def fit_logs(
    paths: Sequence[str | Path], target: str = "period", holdout: float = 0.25, seed: int = 0
) -> tuple[FittedCostModel, list[dict]]:
    """The cost model fitted to iteration logs, with the metadata saying where it came from, and the
    points it was fitted to. Raises ValueError as read_log does."""
    points = read_log(paths, target)
    model, fit_error = fit_points(points, holdout, seed)
    model.meta = {
        "source": "iteration-log",
        "logs": [str(p) for p in paths],
        "target": target,
        "num_iterations": len(points),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "fit_error": fit_error,
        # The log's times are the served wall times, contention included: nothing to scale.
        "contention_factor": 1.0,
        "units": "seconds per iteration; features as in stallfree.costmodel.features",
    }
    return model, points


def _p99_pair(points: list[dict]) -> dict[str, float] | None:
    if not points:
        return None
    return {
        "measured": float(np.percentile([p["time_s"] for p in points], 99)),
        "predicted": float(np.percentile([p["predicted_s"] for p in points], 99)),
    }


def plot(points: list[dict], out: Path) -> Path:
    from stallfree.bench.report import measured_vs_predicted, pyplot

    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    measured_vs_predicted(a1, points, "served iteration period, ms", "Cost model fitted to served iterations",
                          fit_marker=".", s=8, alpha=0.5)  # fmt: skip
    held = [p for p in points if p["held_out"]] or points
    for key, lab in (("time_s", "measured"), ("predicted_s", "predicted")):
        v = np.sort([p[key] * 1e3 for p in held])
        a2.plot(v, np.linspace(0, 1, len(v)), label=lab)
    a2.set_xscale("log")
    a2.set_xlabel("iteration period, ms (log)")
    a2.set_ylabel("fraction of held-out iterations")
    a2.set_title("Distribution (held out)")
    a2.legend()
    fig.tight_layout()
    path = out / "profile.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
