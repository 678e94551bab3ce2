"""`stallfree tune --tbt-slo S`: derive the token budget from a TBT SLO and the profiled cost model.

With stall-free batching every running decode gets one token per iteration, so a decode's TBT is the
iteration time. The worst iteration is a full one: the expected running decodes plus a prefill chunk that
fills the rest of the budget, at the deepest prefill context (the last chunk of a long prompt). The tuned
budget is the largest tile-aligned budget whose worst iteration is predicted to meet the SLO (times a safety
margin). Its price is TTFT: a prompt is prefilled over more, smaller chunks; the predicted prefill time of a
--prompt-len prompt next to the decodes is reported for every budget, against one-shot prefill.

--chunk-context-scale auto (or a number) tunes for `stallfree serve --chunk-context-scale C`, which charges a
chunk for the context it attends over, so chunks deep in a prompt are shorter: every chunk of the
--prompt-len prompt is then checked, not only the deepest full one, and "auto" reads C off the cost model
(the context at which a prefill token's attention costs as much as the rest of its forward pass). Iterations
then cost about the same at any depth, so a larger budget meets the same SLO and short prompts prefill faster.

Output (--out): tune.json and tune.png (predicted iteration time and TTFT vs budget).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stallfree.bench.report import pyplot, table, write_json
from stallfree.costmodel.fitted import FittedCostModel
from stallfree.engine.scheduler import fit_chunk


def context_scale(cost: FittedCostModel, chunk: int = 256, context: int = 2048) -> int | None:
    """C for --chunk-context-scale from the cost model: with a chunk's time n (a + k x its mean context), the
    context a / k at which a token's attention costs as much as the rest of it. None when the model has no
    context term (attention free of context, nothing to charge)."""
    base = cost.iteration_time(0, 0, 0, 0)
    shallow = cost.iteration_time(chunk, 0, 0, 0) - base
    deep = cost.iteration_time(chunk, 0, context, 0) - base  # context more
    if shallow <= 0 or deep <= shallow:
        return None
    k = (deep - shallow) / (chunk * context)
    a = shallow / chunk - k * (chunk + 1) / 2  # the features' mean context of a chunk at 0
    return max(1, round(a / k)) if a > 0 else None


def chunk_starts(budget: int, decodes: int, prompt_len: int, scale: int | None) -> list[tuple[int, int]]:
    """(start, full chunk) of each iteration prefilling a prompt_len prompt next to `decodes` decodes: the
    chunk the budget allows at that start (the last may take less of the prompt; others fill the rest)."""
    left, out, done = budget - decodes, [], 0
    if left < 1:
        return out
    while done < prompt_len:
        n = fit_chunk(left, done, scale)
        if n < 1:
            break
        out.append((done, n))
        done += n
    return out


def worst_iteration(
    cost: FittedCostModel, budget: int, decodes: int, decode_context: int, prompt_len: int,
    scale: int | None = None,
) -> float:  # fmt: skip
    """Predicted time of a full iteration: `decodes` decodes + prefill filling the rest of the budget (from
    several prompts when one is shorter), the deepest chunk ending a prompt_len-token prompt; with a context
    scale, the slowest of the prompt's chunks (each as long as its charge allows)."""
    chunk = max(0, budget - decodes)
    if scale is None:
        return cost.iteration_time(chunk, decodes, max(0, prompt_len - chunk), decode_context)
    return max(
        (cost.iteration_time(n, decodes, s, decode_context) for s, n in chunk_starts(budget, decodes, prompt_len, scale)),
        default=cost.iteration_time(0, decodes, 0, decode_context),
    )  # fmt: skip


def prefill_time(
    cost: FittedCostModel, budget: int, decodes: int, decode_context: int, prompt_len: int,
    scale: int | None = None,
) -> tuple[float, int]:  # fmt: skip
    """Predicted time to prefill a prompt_len prompt in budget-sized chunks alongside `decodes` decodes.
    Returns (seconds, number of iterations); inf when the budget leaves no room for prefill."""
    chunks = chunk_starts(budget, decodes, prompt_len, scale)
    if not chunks or sum(n for _, n in chunks) < prompt_len:
        return float("inf"), 0
    t = sum(cost.iteration_time(min(n, prompt_len - s), decodes, s, decode_context) for s, n in chunks)
    return t, len(chunks)


def slo_from_decode(cost: FittedCostModel, multiple: float, decodes: int, context: int) -> float:
    """The paper's SLO rule: `multiple` x the predicted time of a decode-only iteration of `decodes`
    requests at `context` tokens (Sarathi-Serve: 5x strict, 25x relaxed, for 32 decodes after a 4K prompt)."""
    if multiple <= 0 or decodes < 1 or context < 0:
        raise ValueError("need --tbt-slo-x > 0, --slo-decodes >= 1 and --slo-context >= 0")
    return multiple * cost.iteration_time(0, decodes, 0, context)


def tune(
    cost: FittedCostModel,
    slo: float,
    *,
    decodes: int,
    decode_context: int,
    prompt_len: int,
    align: int = 32,
    max_budget: int = 4096,
    margin: float = 1.0,
    scale: int | None = None,
) -> dict:
    """Every tile-aligned budget's predicted cost, and the largest one meeting the SLO (chunks charged for
    their context when `scale` is given: stallfree serve --chunk-context-scale)."""
    if slo <= 0 or align < 1 or max_budget < align or not 0 < margin <= 1:
        raise ValueError("need --tbt-slo > 0, --align >= 1, --max-budget >= --align and 0 < --margin <= 1")
    one_shot = cost.iteration_time(prompt_len, decodes, 0, decode_context)
    rows = []
    for b in range(align, max_budget + 1, align):
        it = worst_iteration(cost, b, decodes, decode_context, prompt_len, scale)
        ttft, n = prefill_time(cost, b, decodes, decode_context, prompt_len, scale)
        rows.append(
            {
                "budget": b,
                "iteration_s": it,
                "meets": it <= slo * margin,
                "prefill_s": ttft,
                "prefill_iterations": n,
                "ttft_cost_vs_one_shot": ttft / one_shot if one_shot > 0 else None,
            }
        )
    ok = [r for r in rows if r["meets"] and r["prefill_iterations"] > 0]
    best = ok[-1] if ok else None
    decode_only = cost.iteration_time(0, decodes, 0, decode_context)
    return {
        "tbt_slo_s": slo,
        "margin": margin,
        "decodes": decodes,
        "decode_context": decode_context,
        "prompt_len": prompt_len,
        "chunk_context_scale": scale,
        "align": align,
        "decode_only_iteration_s": decode_only,
        "one_shot_prefill_s": one_shot,
        "token_budget": best["budget"] if best else None,
        "chosen": best,
        "feasible": best is not None,
        "note": ""
        if best
        else (
            f"even a {align}-token budget misses the SLO with {decodes} running decodes "
            f"(a decode-only iteration is predicted at {decode_only * 1e3:.0f} ms): lower the decode load "
            "(fewer running requests per replica) or relax the SLO"
        ),
        "budgets": rows,
    }


def _scale_arg(value: str | None, cost: FittedCostModel) -> int | None:
    """--chunk-context-scale: None (off), "auto" (from the cost model) or a positive integer."""
    if value is None:
        return None
    if value == "auto":
        scale = context_scale(cost)
        if scale is None:
            raise ValueError("the cost model has no prefill-context term: --chunk-context-scale auto has nothing "
                             "to charge (give a number, or leave it off)")  # fmt: skip
        return scale
    try:
        scale = int(value)
    except ValueError:
        scale = 0
    if scale < 1:
        raise ValueError(f"--chunk-context-scale must be 'auto' or a positive integer, got {value!r}")
    return scale


def _plot(res: dict, out: Path) -> Path:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    b = [r["budget"] for r in res["budgets"]]
    a1.plot(b, [r["iteration_s"] * 1e3 for r in res["budgets"]], marker=".")
    a1.axhline(res["tbt_slo_s"] * 1e3, color="red", ls="--", label="TBT SLO")
    if res["token_budget"]:
        a1.axvline(res["token_budget"], color="green", ls=":", label=f"budget {res['token_budget']}")
    a1.set_xlabel("token budget")
    a1.set_ylabel("predicted full-iteration ms")
    a1.set_title(f"{res['decodes']} decodes + budget-filling chunk")
    a1.legend()
    a2.plot(b, [r["prefill_s"] for r in res["budgets"]], marker=".")
    a2.axhline(res["one_shot_prefill_s"], color="grey", ls="--", label="one-shot prefill")
    a2.set_xlabel("token budget")
    a2.set_ylabel(f"predicted prefill time of {res['prompt_len']} tokens, s")
    a2.set_title("TTFT cost of the budget")
    a2.legend()
    fig.tight_layout()
    path = out / "tune.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="stallfree tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    slo = ap.add_mutually_exclusive_group(required=True)
    slo.add_argument("--tbt-slo", type=float, help="P99 TBT SLO, seconds")
    slo.add_argument("--tbt-slo-x", type=float, metavar="K", help="P99 TBT SLO = K x a decode-only iteration "
                     "of --slo-decodes decodes at --slo-context (the paper: 5 strict, 25 relaxed)")  # fmt: skip
    ap.add_argument("--slo-decodes", type=int, default=32, help="with --tbt-slo-x: decodes in the reference "
                    "iteration (the paper's: 32)")  # fmt: skip
    ap.add_argument("--slo-context", type=int, default=4096, help="with --tbt-slo-x: their context (the "
                    "paper's: a 4K prompt)")  # fmt: skip
    ap.add_argument(
        "--cost-model", default="results/profile/cost_model.json", help="from `stallfree profile`"
    )
    ap.add_argument("--decodes", type=int, default=16, help="expected running decodes per iteration")
    ap.add_argument("--decode-context", type=int, default=512, help="their typical context length")
    ap.add_argument("--prompt-len", type=int, default=1024, help="prompt length for the TTFT cost")
    ap.add_argument("--align", type=int, default=32, help="tile: budgets are multiples of this")
    ap.add_argument("--max-budget", type=int, default=4096)
    ap.add_argument("--margin", type=float, default=0.9, help="meet margin x SLO, leaving room for noise")
    ap.add_argument("--chunk-context-scale", default=None, metavar="auto|C",
                    help="tune for stallfree serve --chunk-context-scale C (chunks charged for their context); "
                    "auto: C from the cost model (default: off, the plain token count)")  # fmt: skip
    ap.add_argument("--out", default="results/tune", help="folder for tune.json and tune.png")
    args = ap.parse_args(argv)
    try:
        cost = FittedCostModel.load(args.cost_model)
        if args.tbt_slo_x is not None:
            args.tbt_slo = slo_from_decode(cost, args.tbt_slo_x, args.slo_decodes, args.slo_context)
        scale = _scale_arg(args.chunk_context_scale, cost)
        res = tune(
            cost,
            args.tbt_slo,
            decodes=args.decodes,
            decode_context=args.decode_context,
            prompt_len=args.prompt_len,
            align=args.align,
            max_budget=args.max_budget,
            margin=args.margin,
            scale=scale,
        )
    except ValueError as e:
        print(f"stallfree tune: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res["cost_model"] = args.cost_model
    if args.tbt_slo_x is not None:
        res["slo_rule"] = {"multiple": args.tbt_slo_x, "decodes": args.slo_decodes,
                           "context": args.slo_context, "decode_iteration_s": args.tbt_slo / args.tbt_slo_x}  # fmt: skip
    path = write_json(out, "tune.json", res)
    png = _plot(res, out)
    pick = {res["token_budget"]} if res["token_budget"] else set()
    shown = [r for r in res["budgets"] if r["budget"] in {128, 256, 512, 1024, 2048} | pick]
    print(
        table(
            ["budget", "iteration ms", "meets", "prefill s", "chunks", "vs one-shot"],
            [
                [
                    r["budget"],
                    f"{r['iteration_s'] * 1e3:.1f}",
                    "yes" if r["meets"] else "no",
                    f"{r['prefill_s']:.3f}",
                    r["prefill_iterations"],
                    f"{r['ttft_cost_vs_one_shot']:.2f}x",
                ]
                for r in shown
            ],
            title=(
                f"TBT SLO {args.tbt_slo * 1e3:.0f} ms (x{args.margin:g} margin), {args.decodes} decodes at "
                f"{args.decode_context} context, {args.prompt_len}-token prompt; decode-only iteration "
                f"{res['decode_only_iteration_s'] * 1e3:.1f} ms"
            ),
        )
    )
    if res["feasible"]:
        c = res["chosen"]
        print(
            f"\ntoken budget: {c['budget']} (predicted full iteration {c['iteration_s'] * 1e3:.1f} ms; "
            f"prefill of {args.prompt_len} tokens {c['prefill_s']:.3f} s = {c['ttft_cost_vs_one_shot']:.2f}x one-shot)"
        )
        flags = f"--token-budget {c['budget']}" + (f" --chunk-context-scale {scale}" if scale else "")
        print(f"serve with: stallfree serve {flags}")
    else:
        print(f"\nno budget meets the SLO: {res['note']}")
    print(f"saved {path} and {png}")
    return 0 if res["feasible"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
