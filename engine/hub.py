"""Models from the Hugging Face Hub: `hf://ORG/NAME[@REVISION]` sources.

One module for every place that fetches from the hub: `stallfree download` (the operator's init container runs
exactly it), `stallfree serve --model hf://...`, and the operator's sizing (config + weight bytes, read at
reconcile). huggingface_hub does the transfer (resumable; HF_ENDPOINT and HF_TOKEN honoured); this module
picks the files an engine needs, lays them out under one download dir, and turns hub failures into a short
reason a Kubernetes condition can carry.

Layout: `<download-dir>/<ORG>/<NAME>/<REVISION>/` holds a plain Hugging Face folder; a marker file written
after the last file lands says the folder is complete, so later calls use it without a network call.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

log = logging.getLogger(__name__)

SCHEME = "hf://"
DEFAULT_REVISION = "main"
MARKER = ".stallfree-download.json"
INDEX = "model.safetensors.index.json"
# What an engine reads besides its weights, at the repo's top level (no .bin/.pth/.gguf/onnx); the weights are
# the shards the safetensors index names (see _plan).
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template*",
    "*.jinja",
    "*.safetensors",
    "*.safetensors.index.json",
    "vocab.json",
    "merges.txt",
)
# Permanent reasons: retrying cannot help until the spec or the secret changes.
PERMANENT_REASONS = frozenset(
    {"InvalidSource", "RepoNotFound", "GatedRepo", "Unauthorized", "RevisionNotFound", "NotAModel"}
    | {"TokenSecretNotFound"}  # the operator's: the Secret model.source.tokenSecret names is missing
)

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_URI = re.compile(
    rf"^hf://(?P<org>{_PART})/(?P<name>{_PART})(?:@(?P<rev>[A-Za-z0-9][A-Za-z0-9._/-]{{0,127}}))?$"
)
URI_PATTERN = _URI.pattern  # the CRD's pattern for spec.model.source.uri is the same expression


@dataclass(frozen=True, slots=True)
class HubRef:
    """A parsed `hf://ORG/NAME[@REVISION]`."""

    org: str
    name: str
    revision: str = DEFAULT_REVISION

    @property
    def repo_id(self) -> str:
        return f"{self.org}/{self.name}"

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.repo_id}@{self.revision}"

    def local_dir(self, download_dir: str | Path) -> Path:
        """Where this ref's files live under a download dir (a revision's '/' becomes '--')."""
        return Path(download_dir).expanduser() / self.org / self.name / self.revision.replace("/", "--")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What sizing needs, read from the hub without downloading weights."""

    commit: str
    config: dict
    weight_bytes: int  # sum of the safetensors files' sizes


class HubError(Exception):
    """A hub failure with a short CamelCase reason (RepoNotFound, GatedRepo, Unauthorized, RevisionNotFound,
    DiskFull, HubUnreachable, HubError, InvalidSource) and a one-line message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message

    @property
    def permanent(self) -> bool:
        return self.reason in PERMANENT_REASONS

    def to_json(self) -> str:
        return json.dumps({"reason": self.reason, "message": self.message})


def is_hub_uri(model: str | None) -> bool:
    return bool(model) and str(model).startswith(SCHEME)


def parse_hub_uri(uri: str) -> HubRef:
    """`hf://ORG/NAME[@REVISION]` -> HubRef; raises ValueError naming the expected form."""
    m = _URI.match(uri or "")
    if m is None or ".." in uri:
        raise ValueError(
            f"model source {uri!r} is not hf://ORG/NAME[@REVISION] (e.g. hf://Qwen/Qwen3-8B or "
            "hf://meta-llama/Llama-3.1-8B-Instruct@main)"
        )
    return HubRef(m["org"], m["name"], m["rev"] or DEFAULT_REVISION)


def default_download_dir() -> Path:
    """$STALLFREE_DOWNLOAD_DIR, else $XDG_CACHE_HOME/stallfree/models (~/.cache/stallfree/models)."""
    if os.environ.get("STALLFREE_DOWNLOAD_DIR"):
        return Path(os.environ["STALLFREE_DOWNLOAD_DIR"]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "stallfree" / "models"


def cached_folder(ref: HubRef, download_dir: str | Path) -> Path | None:
    """The complete local folder of `ref`, or None when it was never fully downloaded."""
    folder = ref.local_dir(download_dir)
    return folder if (folder / MARKER).is_file() else None


@dataclass(frozen=True, slots=True)
class _Plan:
    """The files to fetch at one commit: serving files at the repo's top level, and as weights the shards
    the safetensors index names (or, without an index, the top-level *.safetensors). Copies in other layouts
    (original/, a consolidated.safetensors beside the shards) are left on the hub."""

    commit: str
    files: tuple[str, ...]
    weights: tuple[str, ...]
    weight_bytes: int


def _plan(ref: HubRef, token: str | None, endpoint: str | None, timeout: float, index_dir: Path) -> _Plan:
    from huggingface_hub import HfApi, hf_hub_download  # noqa: PLC0415 - only needed when fetching

    api = HfApi(endpoint=endpoint or None, token=token or None)
    info = api.model_info(ref.repo_id, revision=ref.revision, files_metadata=True, timeout=timeout)
    commit = str(info.sha)
    sizes = {f.rfilename: f.size or 0 for f in info.siblings or []}
    top = sorted(n for n in sizes if "/" not in n)
    serving = [
        n for n in top if not n.endswith(".safetensors") and any(fnmatch(n, p) for p in ALLOW_PATTERNS)
    ]
    if INDEX in sizes:
        path = hf_hub_download(ref.repo_id, INDEX, revision=commit, local_dir=str(index_dir), token=token or None,
                               endpoint=endpoint or None, etag_timeout=timeout)  # fmt: skip
        weights = sorted(set(json.loads(Path(path).read_text())["weight_map"].values()))
    else:
        weights = [n for n in top if n.endswith(".safetensors")]
    if "config.json" not in sizes or not weights or any(w not in sizes for w in weights):
        raise HubError("NotAModel", f"{ref.uri} has no config.json or no safetensors weights at {commit} (only "
                       "safetensors checkpoints are served)")  # fmt: skip
    return _Plan(commit, tuple(serving + weights), tuple(weights), sum(sizes[w] for w in weights))


def download(
    ref: HubRef,
    download_dir: str | Path,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    max_workers: int = 8,
    timeout: float = 30.0,
) -> Path:
    """The local folder of `ref`, downloading what is missing (resuming partial files). Once complete the
    folder is marked and later calls return it offline. Raises HubError."""
    done = cached_folder(ref, download_dir)
    if done is not None:
        log.info("%s: already downloaded to %s", ref.uri, done)
        return done
    from huggingface_hub import snapshot_download  # noqa: PLC0415 - only needed when downloading

    folder = ref.local_dir(download_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        plan = _plan(ref, token, endpoint, timeout, folder)
        log.info("%s: %d files at %s, %.1f GiB of weights", ref.uri, len(plan.files), plan.commit,
                 plan.weight_bytes / 2**30)  # fmt: skip
        snapshot_download(
            ref.repo_id,
            revision=plan.commit,  # the commit the plan was made at, even if the branch moves meanwhile
            local_dir=str(folder),
            allow_patterns=list(plan.files),
            token=token or None,
            endpoint=endpoint or None,
            max_workers=max_workers,
        )
        marker = {"uri": ref.uri, "commit": plan.commit, "files": list(plan.files)}
        tmp = folder / (MARKER + ".tmp")
        tmp.write_text(json.dumps(marker))
        tmp.replace(folder / MARKER)
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure is mapped to a reason; unknown ones keep their text
        raise hub_error(e, ref) from e
    log.info("%s: downloaded to %s", ref.uri, folder)
    return folder


def model_facts(
    ref: HubRef, *, token: str | None = None, endpoint: str | None = None, timeout: float = 10.0
) -> ModelFacts:
    """config.json and the weight bytes of `ref`, read from the hub (no weights fetched). Raises HubError."""
    from huggingface_hub import hf_hub_download  # noqa: PLC0415

    try:
        with tempfile.TemporaryDirectory(prefix="stallfree-hub-") as tmp:
            plan = _plan(ref, token, endpoint, timeout, Path(tmp))
            path = hf_hub_download(ref.repo_id, "config.json", revision=plan.commit, local_dir=tmp,
                                   token=token or None, endpoint=endpoint or None, etag_timeout=timeout)  # fmt: skip
            config = json.loads(Path(path).read_text())
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - mapped to a reason
        raise hub_error(e, ref) from e
    return ModelFacts(commit=plan.commit, config=config, weight_bytes=plan.weight_bytes)


def hub_error(e: BaseException, ref: HubRef) -> HubError:
    """Map an exception from huggingface_hub (or the disk) to a HubError with a short reason."""
    from huggingface_hub.errors import (  # noqa: PLC0415
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, GatedRepoError):
        return HubError("GatedRepo", f"{ref.repo_id} is gated: accept its licence on the hub and give a token "
                        "of an account that has access (spec.model.source.tokenSecret / HF_TOKEN)")  # fmt: skip
    if isinstance(e, RevisionNotFoundError):
        return HubError("RevisionNotFound", f"{ref.repo_id} has no revision {ref.revision!r}")
    if isinstance(e, RepositoryNotFoundError):
        return HubError("RepoNotFound", f"{ref.repo_id} does not exist, or is private and the token (if any) "
                        "cannot read it")  # fmt: skip
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return HubError("Unauthorized", f"the hub refused the token for {ref.repo_id} ({status})")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return HubError("DiskFull", f"no space left on the download volume while fetching {ref.uri}: "
                        "give the model cache more room (spec.model.cache.size)")  # fmt: skip
    if isinstance(e, HfHubHTTPError):
        return HubError("HubError", f"the hub answered {status} for {ref.uri}: {_one_line(e)}")
    # Transport failures: the HTTP client's own classes (httpx, httpx2 or requests, by hub version).
    transport = type(e).__module__.split(".")[0] in {"httpx", "httpx2", "requests", "urllib3"}
    if transport or isinstance(
        e, (ConnectionError, TimeoutError, OfflineModeIsEnabled, LocalEntryNotFoundError)
    ):
        return HubError("HubUnreachable", f"cannot reach the hub for {ref.uri}: {_one_line(e)}")
    return HubError("DownloadFailed", f"{ref.uri}: {type(e).__name__}: {_one_line(e)}")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def resolve_model(uri: str, download_dir: str | Path | None = None) -> Path:
    """`stallfree serve --model hf://...`: the local folder, downloaded first when missing (HF_TOKEN and
    HF_ENDPOINT from the environment). Raises ValueError with the hub's reason."""
    ref = parse_hub_uri(uri)
    try:
        return download(
            ref,
            download_dir or default_download_dir(),
            token=os.environ.get("HF_TOKEN") or None,
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except HubError as e:
        raise ValueError(f"--model {uri}: {e}") from e
