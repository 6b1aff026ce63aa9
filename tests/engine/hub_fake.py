"""A small Hugging Face Hub on localhost for the pull tests: the HTTP calls `huggingface_hub`
makes to pull a model, answered from folders made in the test.

- `GET /api/models/ORG/NAME[/revision/REV]`: the model's info (its commit `sha`, `siblings`);
- `GET /api/models/ORG/NAME/tree/REV?recursive=...`: the file listing, with sizes, git blob ids
  and, for LFS files (the safetensors), their sha256;
- `HEAD` / `GET /ORG/NAME/resolve/REV/PATH`: a file, with `ETag` (the sha256 of an LFS file, the
  git blob id of another), `X-Repo-Commit`, and `Range: bytes=N-` answered with 206.

Errors carry the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound, GatedRepo), which
`huggingface_hub` turns into its typed errors. `stall_after` holds a file's first download
after that many bytes until `release` is set, to interrupt a pull mid-file. Every request is
logged as (method, path, Range header).

`isolated_env` and `wd_engine` run the engine's commands against it with the hub cache and the
user's folders in a temporary folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors",)
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class HubFile:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


class FakeHub:
    def __init__(self):
        self.repos: dict[str, tuple[str, dict[str, HubFile]]] = {}  # id -> (commit, files)
        self.gated: set[str] = set()
        self.log: list[tuple[str, str, str | None]] = []
        self.stall_after: dict[str, int] = {}  # file path -> bytes sent before the stall
        self.release = threading.Event()
        self.corrupt: set[str] = set()  # file paths served with a flipped byte
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(self, repo_id: str, folder: Path, extra: dict[str, bytes] | None = None) -> str:
        """Serve a folder's files (and `extra` ones, paths with folders allowed) as `repo_id`;
        returns its commit hash."""
        files = {
            p.name: HubFile(p.read_bytes(), p.name.endswith(LFS_SUFFIXES))
            for p in sorted(folder.iterdir())
            if p.is_file()
        }
        for path, data in (extra or {}).items():
            files[path] = HubFile(data, path.endswith(LFS_SUFFIXES))
        digest = hashlib.sha1(repo_id.encode())
        for path, f in sorted(files.items()):
            digest.update(path.encode() + f.git_oid.encode())
        commit = digest.hexdigest()
        self.repos[repo_id] = (commit, files)
        return commit

    def requests(self, kind: str = "") -> list[tuple[str, str, str | None]]:
        return [r for r in self.log if kind in r[1]]

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._route(head=True)

            def do_GET(self):
                self._route(head=False)

            def _route(self, head: bool):
                path = urlsplit(self.path).path
                hub.log.append((self.command, path, self.headers.get("Range")))
                parts = [unquote(p) for p in path.strip("/").split("/")]
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    self._api(parts[2] + "/" + parts[3], parts[4:])
                elif len(parts) >= 5 and parts[2] == "resolve":
                    repo_id = parts[0] + "/" + parts[1]
                    self._resolve(repo_id, parts[3], "/".join(parts[4:]), head)
                else:
                    self._error(404, "EntryNotFound", "no such route")

            def _repo(self, repo_id: str, revision: str):
                if repo_id not in hub.repos:
                    self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                    return None
                if repo_id in hub.gated and not self.headers.get("Authorization"):
                    self._error(401, "GatedRepo", f"Access to {repo_id} is restricted")
                    return None
                commit, files = hub.repos[repo_id]
                if revision not in ("main", commit):
                    self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                    return None
                return commit, files

            def _api(self, repo_id: str, rest: list[str]):
                revision = rest[1] if rest[:1] in (["revision"], ["tree"]) and rest[1:] else "main"
                found = self._repo(repo_id, revision)
                if found is None:
                    return
                commit, files = found
                if rest[:1] == ["tree"]:
                    listing = []
                    for path, f in sorted(files.items()):
                        entry = {
                            "type": "file",
                            "oid": f.git_oid,
                            "size": len(f.data),
                            "path": path,
                        }
                        if f.lfs:
                            entry["lfs"] = {
                                "oid": f.sha256,
                                "size": len(f.data),
                                "pointerSize": 134,
                            }
                        listing.append(entry)
                    folders = sorted({p.rsplit("/", 1)[0] for p in files if "/" in p})
                    listing += [
                        {"type": "directory", "oid": "0" * 40, "size": 0, "path": d}
                        for d in folders
                    ]
                    self._json(listing)
                    return
                self._json(
                    {
                        "_id": "0" * 24,
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": commit,
                        "private": False,
                        "gated": repo_id in hub.gated and "manual",
                        "disabled": False,
                        "tags": [],
                        "siblings": [{"rfilename": p} for p in sorted(files)],
                    }
                )

            def _resolve(self, repo_id: str, revision: str, path: str, head: bool):
                found = self._repo(repo_id, revision)
                if found is None:
                    return
                commit, files = found
                if path not in files:
                    self._error(404, "EntryNotFound", f"{path} does not exist")
                    return
                f = files[path]
                data = f.data
                if path in hub.corrupt:
                    data = bytes([data[0] ^ 1]) + data[1:]
                start = 0
                ranged = self.headers.get("Range")
                if ranged and ranged.startswith("bytes=") and ranged.endswith("-"):
                    start = int(ranged[len("bytes=") : -1])
                self.send_response(206 if start else 200)
                self.send_header("ETag", f'"{f.etag}"')
                self.send_header("X-Repo-Commit", commit)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return
                stall = hub.stall_after.get(path)
                if stall is not None and start == 0:
                    self.wfile.write(data[:stall])
                    self.wfile.flush()
                    hub.release.wait(60)
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

            def _json(self, body):
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(raw)

            def _error(self, status: int, code: str, message: str):
                raw = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(raw)

        return Handler


def snapshot_path(tmp_path: Path, hub: FakeHub, repo: str) -> Path:
    """Where a pull into `isolated_env(tmp_path, ...)` puts `repo`'s files."""
    commit = hub.repos[repo][0]
    return tmp_path / "hf" / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots" / commit


def isolated_env(tmp_path: Path, endpoint: str | None = None, **extra) -> dict:
    """The environment of a command under test: the hub cache, the user's folders and the
    engine's runtime folder all in `tmp_path`; no token, no inherited hub settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGING_FACE_", "WD_LSP_", "WD_ENGINE_"))
        and k not in ("TRANSFORMERS_OFFLINE", "XDG_RUNTIME_DIR")
    }
    home = tmp_path / "home"
    run = tmp_path / "run"
    for folder in (home, run):
        folder.mkdir(mode=0o700, exist_ok=True)
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        WD_ENGINE_DIR=str(run),
    )
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    env.update(extra)
    return env


def wd_engine(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
