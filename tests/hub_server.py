"""A local HTTP server that answers the Hugging Face Hub's routes for dataset and model repos held in memory, so that
the real `huggingface_hub` client downloads from it and uploads to it (HF_ENDPOINT=server.url). A test fixture,
written from the protocol the client speaks (huggingface_hub 2.x in our venv, 0.35 in LeRobot's), not product code.

Reading (`KIND` is `datasets` or `models`; a dataset's file URLs start with `/datasets`, a model's do not):
- `HEAD /`: the endpoint answers (opentau's reachability probe).
- `GET /api/KIND/ORG/NAME[/revision/REV]`: the repo's info at REV (a branch or a commit; default main): `sha`, `siblings`.
- `GET /api/KIND/ORG/NAME/tree/REV[/PATH]?recursive=...`: the commit's files with size, blob id and LFS sha256.
- `HEAD|GET [/datasets]/ORG/NAME/resolve/REV/PATH`: a file, with `X-Repo-Commit`, `ETag` and `Content-Length` (LFS
  files' ETag is their sha256, as the Hub answers for them).

Writing, as `HfApi.create_repo` / `create_branch` / `create_commit` ask (each needs `Authorization: Bearer TOKEN` with a
token in `tokens`; a wrong one is a 401 "Invalid credentials in Authorization header", as the Hub answers):
- `POST /api/repos/create`: a new repo whose first commit holds a `.gitattributes` (409 when it exists).
- `POST /api/KIND/ORG/NAME/branch/BRANCH`: a branch at `startingPoint` (default: main's head).
- `POST /api/validate-yaml`: the README's front matter must be a YAML mapping whose list fields are lists.
- `POST /api/KIND/ORG/NAME/preupload/REV`: each file's upload mode: `lfs` for the `.gitattributes` LFS patterns, binary
  samples (a NUL byte) and files over 10 MB, else `regular`; with the file's oid at REV (the client skips unchanged ones).
- `POST [/datasets]/ORG/NAME.git/info/lfs/objects/batch`: basic-transfer upload actions (a PUT to `/lfs/...` and a
  verify POST), none for an object the store already holds.
- `PUT /lfs/ORG/NAME/OID`: the object's bytes (refused with 400 when their sha256 is not OID, with 403 when the test
  put OID in `refused_objects`: a storage server refusing one object midway through a push).
- `POST /api/KIND/ORG/NAME/commit/REV`: the ndjson commit (header with `parentCommit`, `file` base64 contents,
  `lfsFile` objects that must be in the store, deletions); refused with 412 when `parentCommit` is not the branch head.
  One commit moves the branch; nothing else ever does.

Every request is logged (`server.log`: (method, path) tuples), so a test can prove what was never asked for, and the
bodies of the writes are kept (`server.received`) so a test can search them. `publish` adds a commit holding a
directory's files and moves a branch to it, as a push would.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".parquet", ".mp4")  # LeRobot's repos keep these in LFS
# What the Hub writes into a new repo's .gitattributes (a few of its patterns: those a policy repo holds).
GITATTRIBUTES = "".join(f"{pattern} filter=lfs diff=lfs merge=lfs -text\n" for pattern in (
    "*.bin", "*.safetensors", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.npz", "*.parquet", "*.mp4", "*.zip"))
REGULAR_MAX = 10 * 1000 * 1000  # larger files go to LFS whatever their name


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    files: dict[str, bytes]
    parent: str | None = None
    message: str = ""
    description: str = ""


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {path: bytes}
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    history: dict[str, Commit] = field(default_factory=dict)  # commit -> its parent, message and files
    lfs_paths: dict[str, set[str]] = field(default_factory=dict)  # commit -> its files that are LFS objects
    private: bool = False

    def commit_of(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)

    def log(self, branch: str = "main") -> list[Commit]:
        """The branch's commits, newest first."""
        out, commit = [], self.refs.get(branch)
        while commit is not None:
            out.append(self.history[commit])
            commit = self.history[commit].parent
        return out


class HubServer:
    def __init__(self, tokens: set[str] | None = None):
        self.repos: dict[str, Repo] = {}  # "datasets/ORG/NAME" or "models/ORG/NAME"
        self.tokens = set(tokens or ())
        self.objects: dict[str, bytes] = {}  # the LFS store: sha256 -> bytes (uploaded, committed or not)
        self.refused_objects: set[str] = set()
        self.log: list[tuple[str, str]] = []
        self.received: list[bytes] = []  # every request body
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                server._answer(self, body=False)

            def do_GET(self):
                server._answer(self, body=True)

            def do_POST(self):
                server._write(self)

            def do_PUT(self):
                server._write(self)

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

    def repo(self, repo_id: str, kind: str = "models") -> Repo | None:
        return self.repos.get(f"{kind}/{repo_id}")

    def publish(self, repo_id: str, folder: Path, branch: str = "main", kind: str = "datasets") -> str:
        """A new commit of `repo_id` holding `folder`'s files; `branch` moves to it. Returns the commit."""
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        with self._lock:
            repo = self.repos.setdefault(f"{kind}/{repo_id}", Repo())
            lfs = {p for p in files if p.endswith(LFS_SUFFIXES) or self._lfs_by_name(p, files)}
            return self._commit(repo, branch, files, lfs, "publish")

    def requested(self, method: str = "GET") -> list[str]:
        """The paths asked for with `method`, in order."""
        with self._lock:
            return [path for m, path in self.log if m == method]

    # --- the state (called under the lock) ---
    def _commit(self, repo: Repo, branch: str, files: dict[str, bytes], lfs: set[str], message: str,
                description: str = "") -> str:
        parent = repo.refs.get(branch)
        digest = hashlib.sha1()
        for path, data in sorted(files.items()):
            digest.update(path.encode() + b"\0" + hashlib.sha1(data).digest())
        digest.update(f"{parent}\0{message}\0{len(repo.commits)}".encode())
        commit = digest.hexdigest()
        repo.commits[commit] = files
        repo.lfs_paths[commit] = lfs
        repo.history[commit] = Commit(files, parent, message, description)
        repo.refs[branch] = commit
        return commit

    @staticmethod
    def _lfs_by_name(path: str, files: dict[str, bytes]) -> bool:
        patterns = [line.split()[0] for line in files.get(".gitattributes", GITATTRIBUTES.encode()).decode().splitlines()
                    if "filter=lfs" in line]
        return any(fnmatch.fnmatch(path.rpartition("/")[2], p) or fnmatch.fnmatch(path, p) for p in patterns)

    # --- reading ---
    @staticmethod
    def _parts(handler) -> list[str]:
        return [unquote(p) for p in urlsplit(handler.path).path.strip("/").split("/")]

    def _authorized(self, handler) -> bool | None:
        """True: a known token; False: a token the server does not know; None: no token."""
        header = handler.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            return None
        return not self.tokens or header.removeprefix("Bearer ") in self.tokens  # no tokens set: any one is good

    def _readable(self, handler, key: str) -> Repo | None:
        repo = self.repos.get(key)
        if repo is not None and repo.private and not self._authorized(handler):
            return None  # the Hub hides a private repo from whoever cannot read it
        return repo

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        with self._lock:
            self.log.append((handler.command, path))
        if self._authorized(handler) is False:
            return self._unauthorized(handler, body)
        parts = self._parts(handler)
        if path == "/":
            return self._send(handler, 200, b"", body=body)
        if parts[0] == "api" and len(parts) >= 4 and parts[1] in ("datasets", "models"):
            kind, repo_id, rest = parts[1], "/".join(parts[2:4]), parts[4:]
            with self._lock:
                repo = self._readable(handler, f"{kind}/{repo_id}")
            if repo is None:
                return self._error(handler, 404, "RepoNotFound", body)
            if rest == ["refs"]:
                branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in repo.refs.items()]
                return self._json(handler, {"branches": branches, "tags": [], "converts": []}, body)
            if rest and rest[0] not in ("revision", "tree"):
                return self._error(handler, 404, "EntryNotFound", body)
            commit = repo.commit_of(rest[1] if len(rest) > 1 else "main")
            if commit is None:
                return self._error(handler, 404, "RevisionNotFound", body)
            files = repo.commits[commit]
            if not rest or rest[0] == "revision":
                info = {"id": repo_id, "sha": commit, "private": repo.private, "disabled": False, "gated": False,
                        "siblings": [{"rfilename": p} for p in files]}
                return self._json(handler, info, body)
            prefix = "/".join(rest[2:])
            return self._json(handler, [self._tree_entry(p, d, p in repo.lfs_paths[commit]) for p, d in files.items()
                                        if not prefix or p.startswith(prefix + "/")], body)
        kind, parts = ("datasets", parts[1:]) if parts[0] == "datasets" else ("models", parts)
        if len(parts) >= 5 and parts[2] == "resolve":
            with self._lock:
                repo = self._readable(handler, f"{kind}/{'/'.join(parts[:2])}")
            commit = repo.commit_of(parts[3]) if repo else None
            name = "/".join(parts[4:])
            data = repo.commits[commit].get(name) if commit else None
            if data is None:
                return self._error(handler, 404, "EntryNotFound" if repo else "RepoNotFound", body)
            lfs = name in repo.lfs_paths[commit]
            etag = hashlib.sha256(data).hexdigest() if lfs else _blob_id(data)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
            if lfs:
                headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
            return self._send(handler, 200, data, body=body, headers=headers)
        return self._error(handler, 404, "EntryNotFound", body)

    @staticmethod
    def _tree_entry(path: str, data: bytes, lfs: bool) -> dict:
        entry = {"type": "file", "path": path, "size": len(data), "oid": _blob_id(data)}
        if lfs:
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 130}
        return entry

    # --- writing ---
    @staticmethod
    def _body(handler) -> bytes:
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(handler.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    handler.rfile.readline()
                    return data
                data += handler.rfile.read(size)
                handler.rfile.readline()
        return handler.rfile.read(int(handler.headers.get("Content-Length") or 0))

    def _write(self, handler: BaseHTTPRequestHandler) -> None:
        path = unquote(urlsplit(handler.path).path)
        data = self._body(handler)
        with self._lock:
            self.log.append((handler.command, path))
            self.received.append(data)
        parts = self._parts(handler)
        if parts[0] != "lfs" and not self._authorized(handler):  # object uploads go to presigned URLs: no token
            return self._unauthorized(handler, True)
        try:
            with self._lock:
                return self._route_write(handler, parts, data, parse_qs(urlsplit(handler.path).query))
        except (ValueError, KeyError) as exc:
            return self._error(handler, 400, "BadRequest", True, str(exc))

    def _route_write(self, handler, parts: list[str], data: bytes, query: dict) -> None:
        if handler.command == "PUT" and parts[0] == "lfs" and len(parts) == 4:
            oid = parts[3]
            if oid in self.refused_objects:
                return self._error(handler, 403, "Forbidden", True, "the storage refused this object")
            if hashlib.sha256(data).hexdigest() != oid:
                return self._error(handler, 400, "BadRequest", True, "the object's bytes do not hash to its oid")
            self.objects[oid] = data
            return self._send(handler, 200, b"", body=True)
        if parts[0] == "lfs" and parts[-1] == "verify":
            info = json.loads(data)
            ok = info["oid"] in self.objects and len(self.objects[info["oid"]]) == info["size"]
            return self._json(handler, {}, True) if ok else self._error(handler, 404, "EntryNotFound", True)
        if parts[:3] == ["api", "repos", "create"]:
            info = json.loads(data)
            kind = (info.get("type") or "model") + "s"
            repo_id = f"{info['organization']}/{info['name']}" if info.get("organization") else info["name"]
            key = f"{kind}/{repo_id}"
            url = f"{self.url}/{'datasets/' if kind == 'datasets' else ''}{repo_id}"
            if key in self.repos:
                return self._error(handler, 409, "Conflict", True, "You already created this repo", {"url": url})
            repo = self.repos[key] = Repo(private=bool(info.get("private")) or info.get("visibility") == "private")
            self._commit(repo, "main", {".gitattributes": GITATTRIBUTES.encode()}, set(), "initial commit")
            return self._json(handler, {"url": url, "name": repo_id}, True)
        if parts[:2] == ["api", "validate-yaml"]:
            return self._validate_yaml(handler, json.loads(data)["content"])
        if parts[0] == "api" and len(parts) >= 6 and parts[1] in ("datasets", "models"):
            repo = self.repos.get(f"{parts[1]}/{'/'.join(parts[2:4])}")
            if repo is None:
                return self._error(handler, 404, "RepoNotFound", True)
            action, revision = parts[4], "/".join(parts[5:])
            if action == "branch":
                if revision in repo.refs:
                    return self._error(handler, 409, "Conflict", True, "the branch exists")
                start = repo.commit_of((json.loads(data or b"{}") or {}).get("startingPoint") or "main")
                if start is None:
                    return self._error(handler, 404, "RevisionNotFound", True)
                repo.refs[revision] = start
                return self._json(handler, {}, True)
            commit = repo.commit_of(revision)
            if commit is None:
                return self._error(handler, 404, "RevisionNotFound", True)
            if action == "preupload":
                return self._json(handler, {"files": [self._mode(repo, commit, f) for f in json.loads(data)["files"]]}, True)
            if action == "commit":
                url = f"{self.url}/{'datasets/' if parts[1] == 'datasets' else ''}{'/'.join(parts[2:4])}"
                return self._apply_commit(handler, repo, revision, commit, data, url)
        if len(parts) >= 6 and parts[-4:] == ["info", "lfs", "objects", "batch"]:
            repo_id = "/".join(parts[-6:-4]).removesuffix(".git")
            objects = [self._batch_object(repo_id, o) for o in json.loads(data)["objects"]]
            return self._json(handler, {"transfer": "basic", "objects": objects}, True)
        return self._error(handler, 404, "EntryNotFound", True)

    def _mode(self, repo: Repo, commit: str, file: dict) -> dict:
        sample = base64.b64decode(file["sample"])
        lfs = self._lfs_by_name(file["path"], repo.commits[commit]) or b"\0" in sample or file["size"] > REGULAR_MAX
        existing = repo.commits[commit].get(file["path"])
        oid = None
        if existing is not None:
            oid = hashlib.sha256(existing).hexdigest() if lfs else _blob_id(existing)
        return {"path": file["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid}

    def _batch_object(self, repo_id: str, obj: dict) -> dict:
        if obj["oid"] in self.objects:
            return {"oid": obj["oid"], "size": obj["size"]}
        href = f"{self.url}/lfs/{repo_id}/{obj['oid']}"
        return {"oid": obj["oid"], "size": obj["size"],
                "actions": {"upload": {"href": href, "header": {}}, "verify": {"href": f"{href}/verify", "header": {}}}}

    def _apply_commit(self, handler, repo: Repo, branch: str, head: str, data: bytes, url: str) -> None:
        lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        header = lines[0]["value"]
        if header.get("parentCommit") not in (None, head):
            return self._error(handler, 412, "PreconditionFailed", True,
                               "A commit has happened since. Please refresh and try again.")
        files, lfs = dict(repo.commits[head]), set(repo.lfs_paths[head])
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
                lfs.discard(value["path"])
            elif key == "lfsFile":
                if value["oid"] not in self.objects:
                    return self._error(handler, 422, "BadRequest", True, f"LFS object {value['oid']} was never uploaded")
                files[value["path"]] = self.objects[value["oid"]]
                lfs.add(value["path"])
            elif key == "deletedFile":
                files.pop(value["path"])
            elif key == "deletedFolder":
                for path in [p for p in files if p.startswith(value["path"].rstrip("/") + "/")]:
                    del files[path]
        if branch not in repo.refs:  # a commit id is not a branch: nothing moves
            return self._error(handler, 400, "BadRequest", True, "commits go to a branch")
        commit = self._commit(repo, branch, files, lfs, header["summary"], header.get("description", ""))
        return self._json(handler, {"commitUrl": f"{url}/commit/{commit}", "commitOid": commit,
                                    "pullRequestUrl": None}, True)

    def _validate_yaml(self, handler, content: str) -> None:
        import yaml

        errors = []
        if content.startswith("---\n"):
            try:
                meta = yaml.safe_load(content[4:].partition("\n---")[0])
            except yaml.YAMLError as exc:
                meta, errors = None, [f"the metadata is not YAML: {exc}"]
            if not errors and not isinstance(meta, dict):
                errors.append("the metadata is not a mapping")
            for name in ("tags", "datasets"):
                if isinstance(meta, dict) and name in meta and not isinstance(meta[name], list):
                    errors.append(f"'{name}' must be a list")
        if errors:
            return self._send(handler, 400, json.dumps({"errors": [{"message": e} for e in errors]}).encode(), body=True,
                              headers={"Content-Type": "application/json"})
        return self._json(handler, {"errors": [], "warnings": []}, True)

    # --- answers ---
    def _json(self, handler, value, body: bool) -> None:
        self._send(handler, 200, json.dumps(value).encode(), body=body, headers={"Content-Type": "application/json"})

    def _error(self, handler, status: int, code: str, body: bool, message: str = "", extra: dict | None = None) -> None:
        self._send(handler, status, json.dumps({"error": message or code, **(extra or {})}).encode(), body=body,
                   headers={"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message or code})

    def _unauthorized(self, handler, body: bool) -> None:
        message = "Invalid credentials in Authorization header"
        self._send(handler, 401, json.dumps({"error": message}).encode(), body=body,
                   headers={"Content-Type": "application/json", "X-Error-Message": message})

    @staticmethod
    def _send(handler, status: int, data: bytes, *, body: bool, headers: dict | None = None) -> None:
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
