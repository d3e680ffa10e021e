"""A loopback fake of the HF Hub HTTP API: the endpoints ``huggingface_hub`` calls to create a
repository, commit files (regular and Git LFS) and read paths info. The Hub cannot be reached
from the machines the tests run on, so the real client talks to this server on 127.0.0.1.

Endpoints (as ``huggingface_hub`` 2.4 sends them; ``hf_api.py``, ``_commit_api.py``, ``lfs.py``):

* ``POST /api/repos/create`` — ``{"name", "organization", "type"?, "visibility"?}``; 409 if the
  repository exists; the new repository gets an initial commit holding ``.gitattributes``.
* ``GET /api/models/{ns}/{name}[/revision/{rev}]`` — ``{"id", "sha", "private", "siblings"}``.
* ``POST /api/models/{ns}/{name}/preupload/{rev}`` — per file ``uploadMode`` (``lfs`` for
  binary samples, ``*.gguf`` or >= 10 MB, else ``regular``), ``shouldIgnore`` and the ``oid`` of
  the file already at ``rev``.
* ``POST /{ns}/{name}.git/info/lfs/objects/batch`` — Git LFS batch API (basic transfer): an
  ``upload`` action per object not yet stored.
* ``PUT /_lfs/{ns}/{name}/{oid}`` — the object's bytes (an unauthenticated "presigned" URL, like
  the S3 URL the Hub hands out). With :attr:`FakeHub.corrupt_uploads` set, the stored bytes have
  their first byte flipped: the storage corrupts them.
* ``POST /api/models/{ns}/{name}/commit/{rev}`` — ndjson ``header`` (``parentCommit``),
  ``file`` (base64) and ``lfsFile`` lines; 412 ``A commit has happened since. Please refresh and
  try again.`` when the branch no longer points at ``parentCommit`` (the Hub's answer).
* ``POST /api/models/{ns}/{name}/paths-info/{rev}`` — form ``paths``; per file ``size``, ``oid``
  (git blob id of the stored bytes) and, for LFS files, ``lfs.oid`` = sha256 of the stored bytes.
* ``GET /api/models/{ns}/{name}/tree/{rev}`` — the file listing ``snapshot_download`` reads
  (``type``, ``path``, ``size``, ``oid`` and, for LFS files, ``lfs``), one page.
* ``GET|HEAD /{ns}/{name}/resolve/{rev}/{path}`` — a file's bytes (HEAD: headers only) with
  ``X-Repo-Commit``, ``ETag`` (git blob id; ``X-Linked-Etag`` = sha256 for LFS files) and
  ``Content-Length``, as ``hf_hub_download`` expects; 404 ``EntryNotFound`` for a missing path.

Every ``/api``, LFS batch and ``resolve`` request must carry ``authorization: Bearer <token>`` (else 401).
Commit ids are sha1 digests of the parent id and the tree. Headers are never logged.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

LFS_MIN_BYTES = 10 * 1024 * 1024
"""Files from this size up go to LFS (the Hub's 10 MB rule)."""

GITATTRIBUTES = b"*.gguf filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_id(data: bytes) -> str:
    """Git's object id of ``data`` (``sha1("blob <size>\\0" + data)``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's id


@dataclass
class _Entry:
    data: bytes
    lfs: bool


@dataclass
class _Repo:
    private: bool
    commits: dict[str, dict[str, _Entry]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    lfs_objects: dict[str, bytes] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None


def _commit_id(parent: str | None, tree: dict[str, _Entry], message: str) -> str:
    listing = sorted((path, git_blob_id(entry.data)) for path, entry in tree.items())
    return hashlib.sha1(json.dumps([parent, listing, message]).encode()).hexdigest()  # noqa: S324


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    headers = {"X-Error-Message": message}
    if code:
        headers["X-Error-Code"] = code
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class FakeHub:
    """The fake Hub server. :meth:`start` binds a free loopback port; :meth:`stop` ends it.

    Attributes:
        token: The only bearer token accepted.
        corrupt_uploads: When True, LFS objects uploaded from now on are stored with their first
            byte flipped (so paths-info reports another sha256 than the client's).
        requests: ``(method, path)`` of every request received, in order.
        concurrent_commit: ``(path, bytes)`` committed to the branch by "another writer" just
            before the next commit request is handled (then cleared): a race on the parent.
    """

    def __init__(self, token: str) -> None:
        self.token = token
        self.corrupt_uploads = False
        self.concurrent_commit: tuple[str, bytes] | None = None
        self.requests: list[tuple[str, str]] = []
        self.repos: dict[str, _Repo] = {}
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.endpoint = ""
        repo = "/{ns}/{name}"
        self.app = Starlette(routes=[
            Route("/api/repos/create", self._create_repo, methods=["POST"]),
            Route(f"/api/models{repo}", self._repo_info, methods=["GET"]),
            Route(f"/api/models{repo}/revision/{{rev}}", self._repo_info, methods=["GET"]),
            Route(f"/api/models{repo}/preupload/{{rev}}", self._preupload, methods=["POST"]),
            Route(f"{repo}.git/info/lfs/objects/batch", self._lfs_batch, methods=["POST"]),
            Route(f"/_lfs{repo}/{{oid}}", self._lfs_put, methods=["PUT"]),
            Route(f"/api/models{repo}/commit/{{rev}}", self._commit, methods=["POST"]),
            Route(f"/api/models{repo}/paths-info/{{rev}}", self._paths_info, methods=["POST"]),
            Route(f"/api/models{repo}/tree/{{rev}}", self._tree, methods=["GET"]),
            Route(f"{repo}/resolve/{{rev}}/{{path:path}}", self._resolve, methods=["GET", "HEAD"]),
        ])

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> str:
        """Serve on a free 127.0.0.1 port in a thread; return the endpoint URL."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake Hub server did not start")
            time.sleep(0.02)
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    def stop(self) -> None:
        """Stop the server and wait for its thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- helpers ------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        return request.headers.get("authorization") == f"Bearer {self.token}"

    def _repo(self, request: Request) -> tuple[str, _Repo | None]:
        repo_id = f"{request.path_params['ns']}/{request.path_params['name']}"
        return repo_id, self.repos.get(repo_id)

    def head(self, repo_id: str, branch: str = "main") -> str:
        """The commit ``branch`` points at."""
        return self.repos[repo_id].branches[branch]

    def stored_bytes(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        """The bytes the server holds for ``path`` at ``revision``."""
        repo = self.repos[repo_id]
        return repo.commits[repo.resolve(revision)][path].data

    def _guard(self, request: Request, need_repo: bool = True) -> tuple[str, _Repo | None, Response | None]:
        self.requests.append((request.method, request.url.path))
        if not self._authorized(request):
            return "", None, _error(401, "Invalid credentials in Authorization header")
        if not need_repo:
            return "", None, None
        repo_id, repo = self._repo(request)
        if repo is None:
            return repo_id, None, _error(404, "Repository not found", "RepoNotFound")
        return repo_id, repo, None

    def _guard_rev(self, request: Request) -> tuple[str, _Repo | None, str, Response | None]:
        """:meth:`_guard`, then the commit of the path's ``rev`` (default ``main``); 404 when unknown."""
        repo_id, repo, refused = self._guard(request)
        if refused:
            return repo_id, None, "", refused
        commit = repo.resolve(request.path_params.get("rev", "main"))
        if commit is None:
            return repo_id, None, "", _error(404, "Invalid rev id", "RevisionNotFound")
        return repo_id, repo, commit, None

    # -- endpoints ----------------------------------------------------------------------------
    async def _create_repo(self, request: Request) -> Response:
        _, _, refused = self._guard(request, need_repo=False)
        if refused:
            return refused
        body = await request.json()
        if body.get("type", "model") != "model" or not body.get("organization"):
            return _error(400, "this fake serves model repositories named namespace/name only")
        repo_id = f"{body['organization']}/{body['name']}"
        url = f"{self.endpoint}/{repo_id}"
        with self._lock:
            if repo_id in self.repos:  # the Hub's 409 names the existing repository's url
                message = "You already created this model repo"
                return JSONResponse({"error": message, "url": url}, status_code=409,
                                    headers={"X-Error-Message": message})
            repo = _Repo(private=body.get("visibility", "private") != "public")
            tree = {".gitattributes": _Entry(GITATTRIBUTES, lfs=False)}
            oid = _commit_id(None, tree, "initial commit")
            repo.commits[oid] = tree
            repo.branches["main"] = oid
            self.repos[repo_id] = repo
        return JSONResponse({"url": url, "name": repo_id, "id": oid})

    async def _repo_info(self, request: Request) -> Response:
        repo_id, repo, commit, refused = self._guard_rev(request)
        if refused:
            return refused
        siblings = [{"rfilename": path} for path in sorted(repo.commits[commit])]
        return JSONResponse({"id": repo_id, "sha": commit, "private": repo.private, "siblings": siblings})

    async def _preupload(self, request: Request) -> Response:
        _, repo, commit, refused = self._guard_rev(request)
        if refused:
            return refused
        tree = repo.commits[commit]
        answers = []
        for item in (await request.json())["files"]:
            sample = base64.b64decode(item["sample"])
            lfs = b"\0" in sample or item["path"].endswith((".gguf", ".safetensors")) or item["size"] >= LFS_MIN_BYTES
            existing = tree.get(item["path"])
            oid = None
            if existing is not None:
                oid = hashlib.sha256(existing.data).hexdigest() if existing.lfs else git_blob_id(existing.data)
            answers.append({"path": item["path"], "uploadMode": "lfs" if lfs else "regular",
                            "shouldIgnore": False, "oid": oid})
        return JSONResponse({"files": answers, "commitOid": commit})

    async def _lfs_batch(self, request: Request) -> Response:
        repo_id, repo, refused = self._guard(request)
        if refused:
            return refused
        body = json.loads(await request.body())
        if body.get("operation") != "upload":
            return _error(400, "only the upload operation is served")
        objects = []
        for obj in body["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in repo.lfs_objects:
                entry["actions"] = {"upload": {"href": f"{self.endpoint}/_lfs/{repo_id}/{obj['oid']}"}}
            objects.append(entry)
        return JSONResponse({"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                            media_type="application/vnd.git-lfs+json")

    async def _lfs_put(self, request: Request) -> Response:
        self.requests.append((request.method, request.url.path))
        _, repo = self._repo(request)
        if repo is None:
            return _error(404, "Repository not found", "RepoNotFound")
        data = await request.body()
        if self.corrupt_uploads and data:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        repo.lfs_objects[request.path_params["oid"]] = data
        return Response(status_code=200)

    async def _commit(self, request: Request) -> Response:
        repo_id, repo, refused = self._guard(request)
        if refused:
            return refused
        branch = request.path_params["rev"]
        lines = [json.loads(line) for line in (await request.body()).splitlines() if line.strip()]
        header = next((line["value"] for line in lines if line["key"] == "header"), {})
        with self._lock:
            head = repo.branches.get(branch)
            if head is None:
                return _error(404, "Invalid rev id", "RevisionNotFound")
            if self.concurrent_commit is not None:
                path, data = self.concurrent_commit
                self.concurrent_commit = None
                tree = {**repo.commits[head], path: _Entry(data, lfs=False)}
                head = _commit_id(head, tree, "concurrent writer")
                repo.commits[head] = tree
                repo.branches[branch] = head
            parent = header.get("parentCommit")
            if parent is not None and parent != head:
                return _error(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(repo.commits[head])
            for line in lines:
                value = line["value"]
                if line["key"] == "file":
                    tree[value["path"]] = _Entry(base64.b64decode(value["content"]), lfs=False)
                elif line["key"] == "lfsFile":
                    data = repo.lfs_objects.get(value["oid"])
                    if data is None:
                        return _error(422, f"LFS object {value['oid']} was never uploaded")
                    tree[value["path"]] = _Entry(data, lfs=True)
                elif line["key"] == "deletedFile":
                    tree.pop(value["path"], None)
                elif line["key"] != "header":
                    return _error(400, f"unsupported commit operation {line['key']!r}")
            oid = _commit_id(head, tree, header.get("summary", ""))
            repo.commits[oid] = tree
            repo.branches[branch] = oid
        return JSONResponse({"commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}", "commitOid": oid,
                             "pullRequestUrl": None})

    async def _paths_info(self, request: Request) -> Response:
        _, repo, commit, refused = self._guard_rev(request)
        if refused:
            return refused
        form = parse_qs((await request.body()).decode())
        tree = repo.commits[commit]
        answer = []
        for path in form.get("paths", []):
            entry = tree.get(path)
            if entry is None:
                continue  # the Hub leaves unknown paths out
            answer.append(self._file_info(path, entry))
        return JSONResponse(answer)

    @staticmethod
    def _file_info(path: str, entry: _Entry) -> dict:
        info: dict = {"type": "file", "path": path, "size": len(entry.data), "oid": git_blob_id(entry.data)}
        if entry.lfs:
            info["lfs"] = {"oid": hashlib.sha256(entry.data).hexdigest(), "size": len(entry.data),
                           "pointerSize": 134}
        return info

    async def _tree(self, request: Request) -> Response:
        _, repo, commit, refused = self._guard_rev(request)
        if refused:
            return refused
        return JSONResponse([self._file_info(path, entry) for path, entry in sorted(repo.commits[commit].items())])

    async def _resolve(self, request: Request) -> Response:
        _, repo, commit, refused = self._guard_rev(request)
        if refused:
            return refused
        entry = repo.commits[commit].get(request.path_params["path"])
        if entry is None:
            return _error(404, "Entry not found", "EntryNotFound")
        headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(entry.data)}"',
                   "Content-Length": str(len(entry.data))}
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(entry.data).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(entry.data))
        body = b"" if request.method == "HEAD" else entry.data
        return Response(body, headers=headers, media_type="application/octet-stream")
