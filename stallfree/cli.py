"""The `stallfree` command: a thin dispatcher to subcommands.

Each subcommand lives in its own module with a `main(argv: list[str]) -> int` that parses its own
arguments (with `prog="stallfree <name>"`), so `stallfree --help` stays fast and needs neither torch nor
kopf. Adding a command is one line in COMMANDS. Only what a user runs is here; the experiments that produced
the docs' figures live in the repository's experiments/ folder (experiments/README.md).
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("stallfree.engine.generate_cli", "offline generation with the engine (vLLM-style LLM)"),
    "serve": ("stallfree.engine.serve_cli", "OpenAI-compatible server with stall-free batching"),
    "download": ("stallfree.engine.download_cli", "fetch a model from the Hugging Face Hub (hf://ORG/NAME)"),
    "up": ("stallfree.local", "run a SarathiDeployment on this machine (local mode)"),
    "operator": ("stallfree.operator.cli", "the Kubernetes operator (kopf)"),
    "bench": ("stallfree.bench.cli", "load generator, capacity search and sweeps (serve, capacity, sweep)"),
    "profile": ("stallfree.bench.profile", "profile iteration time and fit a cost model"),
    "tune": ("stallfree.bench.tune", "derive a token budget from a TBT SLO and a cost model"),
    "simulate": ("stallfree.bench.simulate", "discrete-event simulation with the real scheduler"),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: stallfree <command> [options]", "", "commands:"]
    lines += [f"  {n.ljust(width)}  {h}" for n, (_, h) in COMMANDS.items()]
    lines += ["", "Run `stallfree <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from stallfree import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"stallfree: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(
                f"stallfree: the {name!r} command is not available in this build ({e.name})", file=sys.stderr
            )
            return 2
        raise
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
