"""A small real HTTP server that speaks the part of the Hugging Face Hub's file API huggingface_hub uses.

Enough for `snapshot_download`, `hf_hub_download` and `HfApi.model_info` with HF_ENDPOINT (or endpoint=)
pointing at it, as huggingface_hub calls them (read from its source):

  GET  /api/models/ORG/NAME[/revision/REV]      model info: sha, siblings (with sizes)
  GET  /api/models/ORG/NAME/tree/REV[/PATH]     recursive file listing (one page)
  HEAD /ORG/NAME/resolve/REV/FILE               X-Repo-Commit, ETag, Content-Length
  GET  /ORG/NAME/resolve/REV/FILE               the bytes; honours Range (resumed downloads)

Failures answer the way the hub does, with the X-Error-Code header huggingface_hub maps to its exceptions:
a missing repo (404 RepoNotFound), a gated repo's files without the right token (401 GatedRepo; its info and
listing stay public, as on the hub), a missing revision
(404 RevisionNotFound), a missing file (404 EntryNotFound). Every request is logged in `requests` so tests
can check that a filled cache makes no call.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str
    revisions: dict[str, str]  # branch/tag name -> commit
    token: str | None = None  # gated: file downloads must carry "Bearer <token>" (listings stay public)
    sizes: dict[str, int] = field(default_factory=dict)  # sizes the listings report instead of len(bytes)

    def size(self, name: str) -> int:
        return self.sizes.get(name, len(self.files[name]))


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    ranges: list[tuple[str, str]] = field(default_factory=list)  # (path, Range header) of ranged GETs
    truncate_once: dict[str, int] = field(default_factory=dict)  # file -> bytes sent by its first GET
    url: str = ""
    _server: ThreadingHTTPServer | None = None

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes] | Path,
        *,
        token: str | None = None,
        tags: tuple[str, ...] = (),
        sizes: dict[str, int] | None = None,
    ) -> FakeRepo:
        """Publish `files` (a dict, or every file of a folder) as repo_id at main (and at each tag).
        `sizes` makes the model info and tree listings report other sizes (a 140 GB checkpoint for sizing
        tests without 140 GB of bytes); downloads still serve the bytes."""
        if isinstance(files, Path):
            files = {p.relative_to(files).as_posix(): p.read_bytes() for p in files.rglob("*") if p.is_file()}
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha1(files[name]).digest())
        commit = digest.hexdigest()
        revisions = {"main": commit, **dict.fromkeys(tags, commit)}
        repo = FakeRepo(dict(files), commit, revisions, token, dict(sizes or {}))
        self.repos[repo_id] = repo
        return repo

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep pytest output quiet
        pass

    # ---- answers ------------------------------------------------------------------------------------
    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    # ---- routing ------------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        path = urlsplit(self.path).path
        self.fake.requests.append((self.command, path))
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
            repo = self._repo(repo_id, files=False)
            if repo is None:
                return
            if not rest:
                return self._info(repo_id, repo, "main")
            if rest[0] == "revision" and len(rest) >= 2:
                return self._info(repo_id, repo, "/".join(rest[1:]))
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(repo, rest[1], "/".join(rest[2:]))
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo(f"{parts[0]}/{parts[1]}", files=True)
            if repo is None:
                return
            return self._file(repo, parts[3], "/".join(parts[4:]))
        self._error(404, "NotFound", f"no route {path}")

    def _repo(self, repo_id: str, files: bool) -> FakeRepo | None:
        repo = self.fake.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository not found: {repo_id}")
            return None
        # As on the hub, a gated repo's info and file list are public; its files need an accepted token.
        if files and repo.token is not None and self.headers.get("authorization") != f"Bearer {repo.token}":
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access")
            return None
        return repo

    def _commit(self, repo: FakeRepo, revision: str) -> str | None:
        if revision in repo.revisions:
            return repo.revisions[revision]
        if revision == repo.commit:
            return revision
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return None

    def _info(self, repo_id: str, repo: FakeRepo, revision: str) -> None:
        commit = self._commit(repo, revision)
        if commit is not None:
            siblings = [{"rfilename": n, "size": repo.size(n)} for n in sorted(repo.files)]
            self._json(
                {"id": repo_id, "modelId": repo_id, "sha": commit, "siblings": siblings, "private": False}
            )

    def _tree(self, repo: FakeRepo, revision: str, prefix: str) -> None:
        commit = self._commit(repo, revision)
        if commit is not None:
            entries = [
                {"type": "file", "path": n, "size": repo.size(n), "oid": hashlib.sha1(b).hexdigest()}
                for n, b in sorted(repo.files.items())
                if n.startswith(prefix)
            ]
            self._json(entries)

    def _file(self, repo: FakeRepo, revision: str, name: str) -> None:
        commit = self._commit(repo, revision)
        if commit is None:
            return
        data = repo.files.get(name)
        if data is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist", commit)
        start = 0
        ranged = self.headers.get("Range", "")
        if ranged.startswith("bytes=") and self.command == "GET":
            self.fake.ranges.append((name, ranged))
            start = int(ranged[len("bytes=") :].split("-")[0] or 0)
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        cut = self.fake.truncate_once.pop(name, None)
        if cut is not None and not start:
            self.wfile.write(body[:cut])  # then drop the connection mid-file, as a broken download would
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)
