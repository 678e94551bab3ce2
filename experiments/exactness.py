"""`python -m experiments.exactness`: each CPU weight/activation mode against the fp32 model, on a fixed prompt set.

For every mode (dtype:quantization) and each of the prompts (60 chat prompts built from fixed topics and
instructions, through the model's chat template):

  first-token logprob error   |log p_mode(t) - log p_fp32(t)| over fp32's 10 most likely first tokens t
                              (max per prompt; the table gives the median and max over prompts)
  greedy agreement            teacher-forced: fed fp32's greedy continuation (--max-tokens, default 32), the
                              share of positions where the mode's argmax is fp32's next token (the first
                              position is the first-token agreement); no compounding after a near tie
  identical outputs           free-running: the mode's own greedy continuation equals fp32's
  matched prefix              free-running: tokens before the first difference, as a share of fp32's output

Prompts run as one batch per mode (greedy outputs do not depend on what shares the batch); first-token
logits are recorded from a one-shot prefill of each prompt alone. Results: exactness.json in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

TOPICS = (
    "the water cycle", "black holes", "photosynthesis", "the French Revolution", "binary search",
    "compound interest", "volcanoes", "the immune system", "public-key cryptography", "coffee brewing",
    "the Roman Empire", "electric cars",
)  # fmt: skip
INSTRUCTIONS = (
    "Explain {} to a ten-year-old.",
    "Write a short poem about {}.",
    "Give three facts about {}.",
    "What is the most common misconception about {}?",
    "Summarize {} in one sentence.",
)
TOP_K = 10


def prompts() -> list[list[dict[str, str]]]:
    """The fixed prompt set: every instruction for every topic (60 chats)."""
    return [[{"role": "user", "content": i.format(t)}] for t in TOPICS for i in INSTRUCTIONS]


def run_mode(mode: str, chats, max_tokens: int, forced: list[list[int]] | None = None) -> dict:
    """(first-token log-softmax rows, greedy outputs) of one mode; mode is "dtype:quantization"."""
    import torch

    from stallfree.engine import LLM, SamplingParams
    from stallfree.engine.model.loader import load_model

    dtype, quantization = mode.split(":")
    t0 = time.perf_counter()
    loaded = load_model(None, dtype=getattr(torch, dtype), quantization=quantization)
    llm = LLM(loaded_model=loaded, dtype=dtype, num_kv_blocks=2048, max_num_seqs=len(chats))
    ids = [loaded.tokenizer.encode_chat(c) for c in chats]
    runner = llm.engine.executor.runner
    model = runner.model
    first: list = []
    compute_logits = model.compute_logits

    def record(hidden):
        out = compute_logits(hidden)
        first.append(torch.log_softmax(out.float(), dim=-1)[0].clone())
        return out

    model.compute_logits = record  # one prompt at a time: the first sampled row is its first token
    for p in ids:
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    del model.compute_logits
    outs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=False)
    result = {
        "first_logprobs": first,
        "greedy": [list(o.token_ids) for o in outs],
        "prompt_tokens": [len(p) for p in ids],
    }
    if forced is not None:
        result["forced_agreement"] = teacher_forced(llm.engine, ids, forced)
    result["seconds"] = time.perf_counter() - t0
    return result


def teacher_forced(engine, ids: list[list[int]], forced: list[list[int]]) -> list[list[bool]]:
    """Per prompt and position: whether the model's argmax is the forced (reference) token; the engine is
    fed the forced tokens whatever it would have chosen."""
    from stallfree.engine import SamplingParams
    from stallfree.engine.sampler import SampleResult

    agree: list[list[bool]] = [[False] * len(f) for f in forced]

    def sample(logits, reqs):
        out = []
        for row, r in zip(logits.argmax(dim=-1).tolist(), reqs, strict=True):
            i, pos = int(r.request_id.removeprefix("p")), r.num_output_tokens
            agree[i][pos] = row == forced[i][pos]
            out.append(SampleResult(forced[i][pos]))
        return out

    engine.executor.runner.sampler.sample = sample
    for i, (p, f) in enumerate(zip(ids, forced, strict=True)):
        if f:
            engine.add_request(
                f"p{i}", p, SamplingParams(max_tokens=len(f), temperature=0.0, ignore_eos=True)
            )
    while engine.has_unfinished_requests():
        engine.step()
    del engine.executor.runner.sampler.sample
    return agree


def compare(ref: dict, got: dict) -> dict:
    import torch

    errs, first_ok, same, prefix = [], [], [], []
    for lr, lg, gr, gg in zip(
        ref["first_logprobs"], got["first_logprobs"], ref["greedy"], got["greedy"], strict=True
    ):
        top = torch.topk(lr, TOP_K).indices
        errs.append(float((lg[top] - lr[top]).abs().max()))
        first_ok.append(int(torch.argmax(lg)) == int(torch.argmax(lr)))
        same.append(gr == gg)
        k = next((i for i, (a, b) in enumerate(zip(gr, gg, strict=False)) if a != b), min(len(gr), len(gg)))
        prefix.append(k / max(1, len(gr)))
    forced = [a for row in got["forced_agreement"] for a in row]
    return {
        "first_logprob_err_median": statistics.median(errs),
        "first_logprob_err_max": max(errs),
        "first_token_agreement": sum(first_ok) / len(first_ok),
        "greedy_agreement": sum(forced) / len(forced),
        "greedy_positions": len(forced),
        "identical_outputs": sum(same) / len(same),
        "matched_prefix": statistics.mean(prefix),
        "per_prompt_first_logprob_err": errs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.exactness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--modes",
        default="bfloat16:none,bfloat16:int8,bfloat16:int4",
        help="dtype:quantization pairs compared with float32:none",
    )
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default="results/exactness", help="folder for exactness.json")
    args = ap.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    chats = prompts()
    ref = run_mode("float32:none", chats, args.max_tokens)
    result: dict = {
        "num_prompts": len(chats),
        "max_tokens": args.max_tokens,
        "top_k": TOP_K,
        "reference": "float32:none",
        "modes": {},
    }
    rows = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        got = run_mode(mode, chats, args.max_tokens, forced=ref["greedy"])
        r = compare(ref, got)
        r["seconds"] = got["seconds"]
        result["modes"][mode] = r
        rows.append(
            f"{mode:18s} {r['first_logprob_err_median']:10.4f} {r['first_logprob_err_max']:10.4f} "
            f"{r['first_token_agreement']:8.1%} {r['greedy_agreement']:8.1%} {r['identical_outputs']:9.1%} "
            f"{r['matched_prefix']:8.1%}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exactness.json").write_text(json.dumps(result, indent=2))
    print(f"{len(chats)} prompts, {args.max_tokens} greedy tokens each, against float32:none")
    print(
        f"{'mode':18s} {'lp err med':>10s} {'lp err max':>10s} {'first':>8s} {'greedy':>8s} "
        f"{'identical':>9s} {'prefix':>8s}"
    )
    print("\n".join(rows))
    print(f"saved {out / 'exactness.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
