"""`stallfree generate`: offline generation from the command line (the engine without a server)."""

from __future__ import annotations

import argparse
import json
import sys

from stallfree.engine.config import DTYPES, POLICIES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="stallfree generate",
        description="Generate text offline with the stall-free engine (vLLM-style LLM.generate).",
    )
    ap.add_argument("prompts", nargs="*", help="prompts (default: read one prompt per line from stdin)")
    ap.add_argument(
        "--model", default=None, help="a .gguf file or Hugging Face folder (default: bundled SmolLM2-135M)"
    )
    ap.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message with the chat template"
    )
    ap.add_argument("--policy", default="sarathi", choices=POLICIES)
    ap.add_argument("--token-budget", type=int, default=512, help="tokens per iteration (sarathi)")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto", choices=DTYPES)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    args = ap.parse_args(argv)

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        ap.error("give at least one prompt (arguments or stdin)")
    from stallfree.engine import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=tuple(args.stop),
        )
        llm = LLM(
            args.model,
            policy=args.policy,
            token_budget=args.token_budget,
            max_num_seqs=args.max_num_seqs,
            block_size=args.block_size,
            dtype=args.dtype,
        )
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outs = llm.generate(prompts, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"stallfree generate: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "finish_reason": out.finish_reason,
                        "prompt_tokens": len(out.prompt_token_ids),
                        "completion_tokens": len(out.token_ids),
                    }
                )
            )
        else:
            print(out.text)
    return 0
