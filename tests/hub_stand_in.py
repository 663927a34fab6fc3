"""A local stand-in of the Hugging Face Hub's HTTP API, as much of it as ``huggingface_hub`` (1.x, 2.x) uses to create
a model repo and upload a folder to it: ``POST /api/repos/create``, the ``preupload`` endpoint (answering "regular" for
every file, so that no LFS or Xet storage is used), the ``commit`` endpoint (its ndjson body: a header, then files as
base64 and deleted paths), the repo tree (``upload_folder(delete_patterns=...)`` lists it) and the repo's info.

``HubStandIn()`` starts it in a thread; ``HF_ENDPOINT=stand_in.url`` (with ``HF_HUB_OFFLINE=0``) points a process's
huggingface_hub at it. It records what was created and committed, and holds each branch's files."""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

USER = "stand-in-user"  # the namespace of a repo created without one (the token's user on the real Hub)


class HubStandIn:
    def __init__(self):
        self.repos: dict[str, dict] = {}  # repo id -> {"private": ..., "branches": {name: {path: bytes}}}
        self.commits: list[dict] = []  # {"repo", "revision", "summary", "added": {path: bytes}, "deleted": [paths]}
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str, revision: str = "main") -> dict[str, bytes]:
        """The files of ``repo``'s branch ``revision`` as the commits left them."""
        return dict(self.repos[repo]["branches"].get(revision, {}))

    # --- the API, as the handler calls it: (status, JSON body)

    def create(self, body: dict):
        repo = f"{body.get('organization') or USER}/{body['name']}"
        with self.lock:
            exists = repo in self.repos
            if not exists:
                self.repos[repo] = {"private": body.get("private", body.get("visibility") == "private"),
                                    "branches": {"main": {}}}
        url = f"{self.url}/{repo}"
        return (409, {"error": "You already created this model repo", "url": url}) if exists else (200, {"url": url})

    def preupload(self, repo: str, body: dict):
        if repo not in self.repos:
            return 404, {"error": f"Repository {repo} not found"}
        return 200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                               for f in body["files"]]}

    def commit(self, repo: str, revision: str, lines: list[dict]):
        if repo not in self.repos:
            return 404, {"error": f"Repository {repo} not found"}
        header = next(x["value"] for x in lines if x["key"] == "header")
        added = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"}
        deleted = [x["value"]["path"] for x in lines if x["key"] in ("deletedFile", "deletedFolder")]
        unknown = sorted({x["key"] for x in lines} - {"header", "file", "deletedFile", "deletedFolder"})
        if unknown:  # lfsFile, copies: nothing jodpo's pushes need
            return 400, {"error": f"the stand-in does not take {unknown}"}
        with self.lock:
            files = self.repos[repo]["branches"].setdefault(revision, {})
            for path in deleted:
                for p in [p for p in files if p == path or p.startswith(path.rstrip("/") + "/")]:
                    del files[p]
            files.update(added)
            self.commits.append({"repo": repo, "revision": revision, "summary": header["summary"], "added": added,
                                 "deleted": deleted})
            oid = hashlib.sha1(f"{repo}{len(self.commits)}".encode()).hexdigest()
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid}

    def tree(self, repo: str, revision: str, prefix: str):
        if repo not in self.repos:
            return 404, {"error": f"Repository {repo} not found"}
        files = self.repos[repo]["branches"].get(revision, {})
        return 200, [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                     for p, b in sorted(files.items()) if not prefix or p.startswith(prefix.rstrip("/") + "/")]

    def info(self, repo: str, revision: str):
        if repo not in self.repos:
            return 404, {"error": f"Repository {repo} not found"}
        sha = hashlib.sha1(f"{repo}{len(self.commits)}".encode()).hexdigest()
        files = self.repos[repo]["branches"].get(revision, {})
        return 200, {"id": repo, "modelId": repo, "sha": sha, "private": self.repos[repo]["private"],
                     "siblings": [{"rfilename": p} for p in sorted(files)]}


_REPO = r"/api/models/(?P<repo>[^/]+/[^/]+)"


def _handler(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_POST(self):
            path = urlparse(self.path).path
            body = self._body()
            if path == "/api/repos/create":
                return self._send(*hub.create(json.loads(body)))
            if m := re.fullmatch(_REPO + r"/preupload/(?P<rev>[^/]+)", path):
                return self._send(*hub.preupload(m["repo"], json.loads(body)))
            if m := re.fullmatch(_REPO + r"/commit/(?P<rev>[^/]+)", path):
                lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
                return self._send(*hub.commit(m["repo"], unquote(m["rev"]), lines))
            self._send(404, {"error": f"the stand-in has no POST {path}"})

        def do_GET(self):
            path = urlparse(self.path).path
            if m := re.fullmatch(_REPO + r"/tree/(?P<rev>[^/]+)(?P<prefix>/.*)?", path):
                return self._send(*hub.tree(m["repo"], unquote(m["rev"]), unquote(m["prefix"] or "").lstrip("/")))
            if m := re.fullmatch(_REPO + r"(?:/revision/(?P<rev>[^/]+))?", path):
                return self._send(*hub.info(m["repo"], unquote(m["rev"] or "main")))
            self._send(404, {"error": f"the stand-in has no GET {path}"})

    return Handler


def environment(hub: HubStandIn) -> dict[str, str]:
    """The variables that point a subprocess's huggingface_hub at ``hub`` (the suite runs offline otherwise), with a
    token of its own, so that no token of the machine's is ever sent."""
    return {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_stand_in"}


def patch(hub: HubStandIn, monkeypatch) -> None:
    """This process's huggingface_hub pointed at ``hub`` (its endpoint and offline mode are read when it is imported,
    so the environment variables come too late here)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_stand_in")
