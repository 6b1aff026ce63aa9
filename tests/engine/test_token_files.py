"""Token files of `wd-engine serve`: the one kept in the runtime dir is created owner-only with
O_EXCL and never written through a link; a file the user names must be owner-only (as ssh wants
of a private key). And the daemon's log, opened through engine.ipc.paths: 0600 in a 0700 dir."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine.ipc.token_files import TokenFileError, read_token_file, runtime_token


@pytest.fixture
def run_dir(tmp_path) -> Path:
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277])
def test_a_new_token_file_is_0600_and_created_exclusively(run_dir, monkeypatch, umask):
    opened = []
    real_open = os.open
    monkeypatch.setattr(
        os,
        "open",
        lambda path, flags, *a: opened.append((str(path), flags)) or real_open(path, flags, *a),
    )
    path = run_dir / "http.token"
    old = os.umask(umask)
    try:
        token, written = runtime_token(path)
    finally:
        os.umask(old)
    assert written and len(token) >= 32
    assert path.read_text() == token and stat.S_ISREG(path.lstat().st_mode) and mode(path) == 0o600
    creating = [flags for name, flags in opened if name == str(path) and flags & os.O_CREAT]
    needed = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY
    assert creating and all(flags & needed == needed for flags in creating)


def test_an_earlier_runs_private_token_is_reused(run_dir):
    path = run_dir / "engine.token"
    first, written = runtime_token(path)
    again, written_again = runtime_token(path)
    assert written and not written_again and again == first and mode(path) == 0o600


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlink_at_the_token_path_is_refused_and_its_target_untouched(
    tmp_path, run_dir, dangling
):
    target = tmp_path / "precious"
    if not dangling:
        target.write_text("do not touch")
        target.chmod(0o644)
    path = run_dir / "http.token"
    path.symlink_to(target)
    with pytest.raises(TokenFileError, match="symbolic link") as error:
        runtime_token(path)
    assert str(path) in str(error.value)
    assert path.is_symlink()
    if dangling:
        assert not target.exists()  # O_CREAT through the link would have made it
    else:
        assert target.read_text() == "do not touch" and mode(target) == 0o644


def test_a_file_of_another_user_is_refused(run_dir, monkeypatch):
    path = run_dir / "http.token"
    path.write_text("theirs")
    path.chmod(0o600)
    monkeypatch.setattr(os, "geteuid", lambda: path.stat().st_uid + 1)
    with pytest.raises(TokenFileError, match="not to this user") as error:
        runtime_token(path)
    assert str(path) in str(error.value) and path.read_text() == "theirs"


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_something_other_than_a_regular_file_is_refused(run_dir, kind):
    path = run_dir / "http.token"
    os.mkfifo(path, 0o600) if kind == "fifo" else path.mkdir(mode=0o700)
    with pytest.raises(TokenFileError, match="not a regular file"):
        runtime_token(path)  # a FIFO must not block the start waiting for a writer


def test_a_token_file_open_to_others_is_replaced_atomically(tmp_path, run_dir):
    """Others may have read it: a new token, written to a new file renamed over the old, so the
    old file's other name (a hard link here) keeps its content and no temporary is left."""
    path = run_dir / "http.token"
    path.write_text("leaked")
    path.chmod(0o644)
    before = path.stat().st_ino
    token, written = runtime_token(path)
    assert written and token != "leaked"
    assert path.read_text() == token and mode(path) == 0o600 and path.stat().st_ino != before
    assert sorted(p.name for p in run_dir.iterdir()) == ["http.token"]


def test_a_hard_linked_token_file_is_replaced_not_rewritten(tmp_path, run_dir):
    path = run_dir / "http.token"
    path.write_text("shared")
    path.chmod(0o600)
    other = tmp_path / "other-name"
    os.link(path, other)
    token, written = runtime_token(path)
    assert written and path.read_text() == token != "shared" and other.read_text() == "shared"


@pytest.mark.parametrize("content", [b"", b"  \n", b"\xff\xfe", b"x" * 5000])
def test_an_own_file_without_a_usable_token_gets_a_new_one(run_dir, content):
    path = run_dir / "http.token"
    path.write_bytes(content)
    path.chmod(0o600)
    token, written = runtime_token(path)
    assert written and path.read_text() == token and mode(path) == 0o600


def test_a_named_token_file_must_be_owner_only(tmp_path):
    path = tmp_path / "token"
    path.write_text("  s3cret\n")
    for loose in (0o644, 0o640, 0o604, 0o620):
        path.chmod(loose)
        with pytest.raises(TokenFileError, match="chmod 600") as error:
            read_token_file(path)
        assert str(path) in str(error.value)
    path.chmod(0o600)
    assert read_token_file(path) == "s3cret"
    link = tmp_path / "link"
    link.symlink_to(path)  # the user's own choice of path: followed, the target's mode checked
    assert read_token_file(link) == "s3cret"


@pytest.mark.parametrize("problem", ["empty", "missing", "directory"])
def test_a_named_token_file_without_a_token_is_an_error(tmp_path, problem):
    path = tmp_path / "token"
    if problem == "empty":
        path.write_text("\n")
        path.chmod(0o600)
    elif problem == "directory":
        path.mkdir(mode=0o700)
    with pytest.raises(TokenFileError) as error:
        read_token_file(path)
    assert str(path) in str(error.value)


def test_serve_refuses_a_symlinked_token_path_before_loading_a_model(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    target = tmp_path / "target"
    target.write_text("keep")
    (run / "http.token").symlink_to(target)
    env = dict(os.environ, WD_ENGINE_DIR=str(run), XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("WD_ENGINE_HTTP_TOKEN", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.cli",
            "serve",
            "--http-port",
            "0",
            "--model",
            str(tmp_path / "no-such-model"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "symbolic link" in done.stderr and str(run / "http.token") in done.stderr
    assert "cannot load model" not in done.stderr and target.read_text() == "keep"
    log = tmp_path / "state" / "wd-lsp" / "engine.log"
    assert mode(log) == 0o600 and mode(log.parent) == 0o700


def test_serve_keeps_its_tokens_in_the_runtime_dir_across_restarts(tmp_path, monkeypatch):
    import argparse
    import logging

    from engine.cli import _http_options, _tcp_token

    run = tmp_path / "run"
    monkeypatch.setenv("WD_ENGINE_DIR", str(run))
    for name in ("WD_ENGINE_TOKEN", "WD_ENGINE_HTTP_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    args = argparse.Namespace(
        token_file=None,
        tcp_host="127.0.0.1",
        http_token_file=None,
        http_host="127.0.0.1",
        http_port=0,
    )
    log = logging.getLogger("test")
    tcp, http = _tcp_token(args, log), _http_options(args, log).token
    assert tcp != http
    assert (run / "engine.token").read_text() == tcp and (run / "http.token").read_text() == http
    assert mode(run / "engine.token") == mode(run / "http.token") == 0o600 and mode(run) == 0o700
    assert (_tcp_token(args, log), _http_options(args, log).token) == (tcp, http)  # a restart


def test_serve_refuses_a_symlink_at_its_log_path(tmp_path):
    logs = tmp_path / "state" / "wd-lsp"
    logs.mkdir(parents=True, mode=0o700)
    target = tmp_path / "target"
    target.write_text("keep")
    (logs / "engine.log").symlink_to(target)
    env = dict(
        os.environ, WD_ENGINE_DIR=str(tmp_path / "run"), XDG_STATE_HOME=str(tmp_path / "state")
    )
    done = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(tmp_path / "none")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "cannot log" in done.stderr and "symbolic link" in done.stderr
    assert target.read_text() == "keep"
