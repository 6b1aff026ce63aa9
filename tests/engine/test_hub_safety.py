"""What the hub (or a mirror) sends never names a path outside the cache, and a pull removes only
what it made: revisions, sha256 names, a checksum mismatch beside a planted link."""

import os
from types import SimpleNamespace

import pytest

from engine.hub.names import parse_repo_ref
from engine.hub.pull import _remove_snapshot_file
from engine.hub.resume import ResumeError, blob_path, partial_path


@pytest.mark.parametrize(
    "text", ["Org/x@../../etc", "Org/x@/etc/passwd", "Org/x@a\\b", "Org/x@refs/../../y"]
)
def test_a_revision_that_leaves_refs_is_refused(text):
    with pytest.raises(ValueError, match="not a Hugging Face repo id"):
        parse_repo_ref(text)


def test_ordinary_revisions_are_taken():
    assert parse_repo_ref("Org/x@refs/pr/1").revision == "refs/pr/1"
    assert parse_repo_ref("Org/x@0123abcd").revision == "0123abcd"


@pytest.mark.parametrize("sha", ["../../x", "a" * 63, "A" * 64, "/abs", ""])
def test_a_sha256_that_is_not_one_is_refused(tmp_path, sha):
    entry = SimpleNamespace(path="model.safetensors", lfs=SimpleNamespace(sha256=sha))
    for name in (blob_path, partial_path):
        with pytest.raises(ResumeError, match="not a sha256"):
            name(tmp_path, entry)


def test_a_mismatching_file_linked_outside_the_blob_store_keeps_its_target(tmp_path):
    storage = tmp_path / "models--Org--x"
    (storage / "blobs").mkdir(parents=True)
    snapshot = storage / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    outside = tmp_path / "precious.txt"
    outside.write_text("not ours")
    link = snapshot / "config.json"
    link.symlink_to(os.path.relpath(outside, snapshot))
    _remove_snapshot_file(link, storage)
    assert not link.is_symlink() and outside.read_text() == "not ours"


def test_a_mismatching_blob_of_the_store_goes_with_its_link(tmp_path):
    storage = tmp_path / "models--Org--x"
    blob = storage / "blobs" / ("b" * 40)
    blob.parent.mkdir(parents=True)
    blob.write_text("bad")
    snapshot = storage / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    link = snapshot / "config.json"
    link.symlink_to(os.path.relpath(blob, snapshot))
    _remove_snapshot_file(link, storage)
    assert not link.exists() and not blob.exists()
