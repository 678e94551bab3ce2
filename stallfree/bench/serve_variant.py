"""`python -m stallfree.bench.serve_variant --no-hybrid-batching [serve options]`: `stallfree serve` with
the scheduler's hybrid batching off (the paper's "chunking only" ablation: sarathi's prefill chunks and
decodes take turns instead of sharing iterations). Used by `stallfree bench capacity --policies
sarathi-nohybrid`; everything else is the real server.
"""

from __future__ import annotations

import sys
from dataclasses import replace


def main(argv: list[str]) -> int:
    from stallfree.engine import serve_cli

    if "--no-hybrid-batching" in argv:
        argv = [a for a in argv if a != "--no-hybrid-batching"]
        build = serve_cli.build_configs

        def build_no_hybrid(args):
            engine_config, settings = build(args)
            sched = replace(engine_config.scheduler, hybrid_batching=False)
            return replace(engine_config, scheduler=sched), settings

        serve_cli.build_configs = build_no_hybrid
    return serve_cli.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
