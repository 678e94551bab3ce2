"""`stallfree download hf://ORG/NAME[@REVISION]`: fetch a model's serving files into a download dir.

The operator's init container runs exactly this command. On success it prints the local folder; on failure
it exits 1 and writes one JSON line {"reason", "message"} to --termination-message-path, where Kubernetes
puts it in the container status for the operator to turn into the ModelReady condition.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

DEFAULT_TERMINATION_LOG = "/dev/termination-log"

EPILOG = """\
examples:
  stallfree download hf://Qwen/Qwen3-8B
  HF_TOKEN=hf_... stallfree download hf://meta-llama/Llama-3.1-8B-Instruct@main --download-dir /models
  HF_ENDPOINT=https://mirror.example stallfree download hf://ORG/NAME

Downloads only config, tokenizer, chat template and *.safetensors files; an interrupted download resumes.
Once complete, the folder is marked and later runs return it at once, without a network call.
"""


def build_parser() -> argparse.ArgumentParser:
    from stallfree.engine.hub import default_download_dir

    p = argparse.ArgumentParser(
        prog="stallfree download",
        description="Download a model from the Hugging Face Hub for `stallfree serve`.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("source", metavar="hf://ORG/NAME[@REVISION]", help="the model (revision: branch, tag or "
                   "commit; default main)")  # fmt: skip
    p.add_argument("--download-dir", default=None, help="root of the model cache; the model lands in "
                   f"DIR/ORG/NAME/REVISION (default {default_download_dir()}, or $STALLFREE_DOWNLOAD_DIR)")  # fmt: skip
    p.add_argument("--token-env", default="HF_TOKEN", help="environment variable holding the hub token "
                   "(default %(default)s; gated and private repos need one)")  # fmt: skip
    p.add_argument("--endpoint", default=None, help="hub URL (default $HF_ENDPOINT, else the public hub)")
    p.add_argument(
        "--max-workers", type=int, default=8, help="files fetched in parallel (default %(default)s)"
    )
    p.add_argument("--termination-message-path", default=None, help="on failure, write a JSON line "
                   f"{{reason, message}} here (default {DEFAULT_TERMINATION_LOG} when writable)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _write_termination(path: str | None, text: str) -> None:
    if path is None:
        default = Path(DEFAULT_TERMINATION_LOG)
        if not (default.exists() and os.access(default, os.W_OK)):
            return
        path = str(default)
    try:
        Path(path).write_text(text + "\n")
    except OSError as e:
        print(f"stallfree download: cannot write {path}: {e}", file=sys.stderr)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.quiet:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from stallfree.engine.hub import HubError, default_download_dir, download, parse_hub_uri

    try:
        if args.max_workers < 1:
            raise ValueError(f"--max-workers must be >= 1, got {args.max_workers}")
        ref = parse_hub_uri(args.source)
        folder = download(
            ref,
            args.download_dir or default_download_dir(),
            token=os.environ.get(args.token_env) or None,
            endpoint=args.endpoint or os.environ.get("HF_ENDPOINT") or None,
            max_workers=args.max_workers,
        )
    except ValueError as e:
        err = HubError("InvalidSource", str(e))
    except HubError as e:
        err = e
    else:
        print(folder)
        return 0
    _write_termination(args.termination_message_path, err.to_json())
    print(f"stallfree download: error: {err}", file=sys.stderr)
    return 1
