"""A local HTTP server that answers the Hugging Face Hub's routes for dataset repos laid out in directories, so that
the real `huggingface_hub` client downloads from it (HF_ENDPOINT=server.url). A test fixture, written from the
protocol the client speaks (huggingface_hub 2.x), not product code:

- `HEAD /`: the endpoint answers (opentau's reachability probe).
- `GET /api/datasets/ORG/NAME/revision/REV`: the repo's info at REV (a branch or a commit): `sha`, `siblings`.
- `GET /api/datasets/ORG/NAME/tree/COMMIT[/PATH]?recursive=...`: the commit's files with size, blob id and LFS sha256.
- `HEAD|GET /datasets/ORG/NAME/resolve/REV/PATH`: a file, with `X-Repo-Commit`, `ETag` and `Content-Length` (LFS
  files' ETag is their sha256, as the Hub answers for them).

Every request is logged (`server.log`: (method, path) tuples), so a test can prove what was never asked for.
`publish` adds a commit holding a directory's files and moves a branch to it, as a push would.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".parquet", ".mp4")  # LeRobot's repos keep these in LFS


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {path: bytes}
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


class HubServer:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.log: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                server._answer(self, body=False)

            def do_GET(self):
                server._answer(self, body=True)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def start(self) -> "HubServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def publish(self, repo_id: str, folder: Path, branch: str = "main") -> str:
        """A new commit of `repo_id` holding `folder`'s files; `branch` moves to it. Returns the commit."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        repo = self.repos.setdefault(repo_id, Repo())
        digest = hashlib.sha1()
        for path, data in files.items():
            digest.update(path.encode() + b"\0" + hashlib.sha1(data).digest())
        digest.update(str(len(repo.commits)).encode())
        commit = digest.hexdigest()
        with self._lock:
            repo.commits[commit] = files
            repo.refs[branch] = commit
        return commit

    def requested(self, method: str = "GET") -> list[str]:
        """The paths asked for with `method`, in order."""
        with self._lock:
            return [path for m, path in self.log if m == method]

    # --- the routes ---
    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        with self._lock:
            self.log.append((handler.command, path))
        parts = path.strip("/").split("/")
        if path == "/":
            return self._send(handler, 200, b"", body=body)
        if parts[:2] == ["api", "datasets"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo = self.repos.get("/".join(parts[2:4]))
            commit = repo.commit_of(parts[5]) if repo else None
            if commit is None:
                return self._error(handler, 404, "RevisionNotFound" if repo else "RepoNotFound", body)
            files = repo.commits[commit]
            if parts[4] == "revision":
                info = {"id": "/".join(parts[2:4]), "sha": commit, "private": False, "disabled": False,
                        "siblings": [{"rfilename": p} for p in files]}
                return self._json(handler, info, body)
            prefix = "/".join(parts[6:])
            return self._json(handler, [self._tree_entry(p, d) for p, d in files.items()
                                        if not prefix or p.startswith(prefix + "/")], body)
        if parts[0] == "datasets" and len(parts) >= 6 and parts[3] == "resolve":
            repo = self.repos.get("/".join(parts[1:3]))
            commit = repo.commit_of(parts[4]) if repo else None
            data = repo.commits[commit].get("/".join(parts[5:])) if commit else None
            if data is None:
                return self._error(handler, 404, "EntryNotFound", body)
            name = "/".join(parts[5:])
            etag = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else _blob_id(data)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
            return self._send(handler, 200, data, body=body, headers=headers)
        return self._error(handler, 404, "EntryNotFound", body)

    @staticmethod
    def _tree_entry(path: str, data: bytes) -> dict:
        entry = {"type": "file", "path": path, "size": len(data), "oid": _blob_id(data)}
        if path.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
        return entry

    def _json(self, handler, value, body: bool) -> None:
        self._send(handler, 200, json.dumps(value).encode(), body=body, headers={"Content-Type": "application/json"})

    def _error(self, handler, status: int, code: str, body: bool) -> None:
        self._send(handler, status, json.dumps({"error": code}).encode(), body=body,
                   headers={"Content-Type": "application/json", "X-Error-Code": code})

    @staticmethod
    def _send(handler, status: int, data: bytes, *, body: bool, headers: dict | None = None) -> None:
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
