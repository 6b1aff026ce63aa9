"""The Debian source fetcher: copyright parsing (DEP-5 and free text), which files are kept, safe
extraction of tiny .debs built here, and the corpus builder reading the result. No network."""

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from engine.train import corpus, fetch_debian
from engine.train.fetch_debian import (
    dep5_expression,
    member_path,
    parse_copyright,
    source_language,
    text_licence,
    unpack,
)

MIT_TEXT = """\
 Permission is hereby granted, free of charge, to any person obtaining a copy
 of this software and associated documentation files (the "Software"), to deal
 in the Software without restriction, subject to the following conditions:
 .
 The above copyright notice and this permission notice shall be included in
 all copies or substantial portions of the Software.
"""
BSD3_TEXT = """\
 Redistribution and use in source and binary forms, with or without
 modification, are permitted provided that the following conditions are met:
 .
 Neither the name of Google Inc. nor the names of its contributors may be
 used to endorse or promote products derived from this software.
"""
GO = "usr/share/gocode/src/github.com/acme/widget"


def _code(tag: str, n: int = 30) -> str:
    return "".join(
        f"    result_{tag}_{i} := compute_{tag}(argument_{i}, other_{i})\n" for i in range(n)
    )


# --- copyright files ---------------------------------------------------------------------------


def test_dep5_stanzas_are_matched_by_glob_and_the_last_match_wins():
    text = f"""\
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: widget

Files: *
Copyright: 2020 Acme
License: Expat

Files: vendor/*
 third_party/*.go
Copyright: 2019 Someone
License: GPL-2+

Files: vendor/github.com/ok/*
Copyright: 2018 Ok
License: MIT or Apache-2.0

Files: ./src/byteorder.go, src/a?.go
Copyright: 2017 Fuchsia
License: BSD-3-clause

Files: debian/*
License: GPL-2+

License: Expat
{MIT_TEXT}"""
    c = parse_copyright(text)
    assert c.format == "dep5"
    assert c.synopsis("main.go") == "Expat"
    assert c.synopsis("vendor/github.com/x/y.go") == "GPL-2+"
    assert c.synopsis("third_party/deep/z.go") == "GPL-2+"  # `*` matches `/` too
    assert c.synopsis("third_party/notes.txt") == "Expat"
    assert c.synopsis("vendor/github.com/ok/ok.go") == "MIT or Apache-2.0"  # later, more specific
    assert c.synopsis("src/byteorder.go") == "BSD-3-clause"  # comma-separated, './' dropped
    assert c.synopsis("src/ab.go") == "BSD-3-clause" and c.synopsis("src/abc.go") == "Expat"
    assert c.licence(f"{GO}/main.go") == (True, ("Expat",))
    # Shorter tails of that path match only `*`: both licences are recorded, both permissive.
    ok_go = c.licence(f"{GO}/vendor/github.com/ok/ok.go")
    assert ok_go == (True, ("Expat", "MIT or Apache-2.0"))
    ok, found = c.licence(f"{GO}/vendor/github.com/x/y.go")
    assert not ok and "GPL-2+" in found
    # The path in the source is not known: a stanza that matches any tail of the installed
    # path counts, so a copyleft stanza can only reject, never admit.
    ok, found = c.licence(f"{GO}/pkg/vendor/lib.go")
    assert not ok and set(found) == {"Expat", "GPL-2+"}


def test_a_glob_escape_and_hundreds_of_stanzas():
    stanzas = "".join(f"Files: dir{i}/*\nLicense: MIT\n\n" for i in range(400))
    c = parse_copyright(
        "Files: *\nLicense: GPL-3+\n\n" + stanzas + "Files: a\\*b.go\nLicense: ISC\n"
    )
    assert c.synopsis("dir399/x.go") == "MIT" and c.synopsis("other.go") == "GPL-3+"
    assert c.synopsis("a*b.go") == "ISC" and c.synopsis("axb.go") == "GPL-3+"


@pytest.mark.parametrize(
    "synopsis,ok",
    [
        ("MIT", True),
        ("Expat", True),
        ("BSD-3-clause", True),
        ("MIT or Apache-2.0", True),
        ("Apache-2.0 or Expat or ISC", True),
        ("Unlicense or MIT", True),
        ("GPL-2+", False),
        ("LGPL-2.1+ or MPL-2.0", False),
        ("MPL-2.0", False),
        ("Artistic or GPL-1+", False),
        ("GPL-2+ or MIT", True),
        ("MIT and GPL-2+", False),
        ("GPL-2+ or Artistic-2.0, and BSD-3-clause", False),
        ("MIT or GPL-2+, and BSD-3-clause", True),
        ("Apache-2.0 with LLVM exception", True),
        ("GPL-2+ with OpenSSL exception", False),
        ("MIT with non-commercial rider", False),
        ("public-domain", False),
        ("", False),
    ],
)
def test_dep5_licence_expressions(synopsis, ok):
    c = parse_copyright(f"Files: *\nLicense: {synopsis}\n")
    assert c.licence(f"{GO}/a.go")[0] is ok


def test_dep5_expression_groups_at_commas():
    assert dep5_expression("A or B, and C") == "(A OR B) AND (C)"
    assert dep5_expression("A and B or C") == "A AND B OR C"  # AND binds tighter, as in SPDX
    assert dep5_expression("X  with  Foo exception") == "X WITH Foo-exception"


def test_an_unknown_licence_name_is_judged_by_its_text_only_when_it_is_plain():
    text = f"""\
Files: *
License: BSD-C3
{BSD3_TEXT}
Files: fonts/*
License: OFL-ish

Files: ex/*
License: Expat with embedded exception

Files: long/*
License: Long-MIT

License: OFL-ish
{MIT_TEXT} .
 The Font Software may be bundled with any software.

License: Expat with embedded exception
{MIT_TEXT}
License: Long-MIT
{MIT_TEXT} .
 {"And a great deal more that a reader would have to weigh. " * 40}
"""
    c = parse_copyright(text)
    assert c.licence(f"{GO}/a.go") == (True, ("BSD-C3 (text: BSD-3-Clause)",))
    ok, found = c.licence(f"{GO}/fonts/f.go")
    assert not ok and "OFL-ish" in found  # its text names another licence
    assert not c.licence(f"{GO}/ex/e.go")[0]  # a rider is never read from prose
    assert not c.licence(f"{GO}/long/l.go")[0]  # more text than a permissive licence has


def test_free_text_copyright_files_are_one_verdict_for_all_files():
    mit = parse_copyright(
        "This package was debianized by someone.\n\nCopyright 2020 X\n" + MIT_TEXT
    )
    assert mit.format == "text" and mit.licence(f"{GO}/a.go") == (True, ("MIT",))
    both = parse_copyright(
        MIT_TEXT + "\nThe Debian packaging is licensed under the GNU General Public License,\n"
        "see /usr/share/common-licenses/GPL-2.\n"
    )
    assert both.licence(f"{GO}/a.go") == (False, ("text: GPL",))
    assert text_licence("Copyright 2020 Someone. All rights reserved.") == (False, "text: unknown")
    assert text_licence(BSD3_TEXT) == (True, "BSD-3-Clause")
    assert text_licence("licensed under the same terms as Perl itself")[0] is False


# --- which files -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,lang",
    [
        (f"{GO}/widget.go", "go"),
        ("usr/share/cargo/registry/serde-1.0.152/src/lib.rs", "rust"),
        ("usr/share/rubygems-integration/all/gems/rack-2.2/lib/rack.rb", "ruby"),
        ("usr/lib/x86_64-linux-gnu/rubygems-integration/3.1.0/gems/n-1/lib/n.rb", "ruby"),
        ("usr/share/perl5/Try/Tiny.pm", "perl"),
        ("usr/lib/x86_64-linux-gnu/perl5/5.36/JSON/XS.pm", "perl"),
        ("usr/share/nodejs/leaflet/dist/leaflet-src.js", "javascript"),
        ("usr/share/nodejs/@types/leaflet/index.d.ts", "typescript"),
        ("usr/include/zlib.h", "c"),
        ("usr/include/fmt/format.hpp", "cpp"),
        ("usr/src/googletest/src/gtest.cc", "cpp"),
        ("usr/share/nodejs/leaflet/dist/leaflet.min.js", None),  # minified
        ("usr/share/nodejs/leaflet/package.json", None),  # not source
        ("usr/share/doc/golang-x-dev/examples/main.go", None),  # not a source root
        ("usr/bin/json_xs.pl", None),
        ("usr/include", None),
    ],
)
def test_file_selection_by_language_and_path(path, lang):
    assert source_language(path) == lang


def test_every_language_of_the_language_server_is_read_under_its_name():
    from wd_lsp.languages import LANGUAGES

    for language in LANGUAGES:
        for ext in language.extensions:
            assert corpus.LANG_BY_SUFFIX[ext] == language.name, ext
    assert corpus.LANG_BY_SUFFIX[".rb"] == "ruby" and corpus.LANG_BY_SUFFIX[".pm"] == "perl"
    # The npm part is read with the suffixes it was built with (.py too: the recorded manifest's
    # npm part holds one package's Python port).
    assert corpus.NPM_SUFFIXES == {".py", ".js", ".mjs", ".cjs", ".ts", ".mts", ".cts"}


def test_member_paths_that_leave_the_package_are_refused():
    assert member_path("./usr/include/a.h") == "usr/include/a.h"
    assert member_path("/etc/passwd") is None
    assert member_path("./usr/../../etc/passwd") is None
    assert member_path("usr//include/a.h") is None
    assert member_path("./") is None


# --- tiny .debs --------------------------------------------------------------------------------


def _ar(members: dict[str, bytes]) -> bytes:
    out = b"!<arch>\n"
    for name, data in members.items():
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n"
        out += header.encode() + data + (b"\n" if len(data) % 2 else b"")
    return out


def _tar_xz(entries: list[tuple[str, object]]) -> bytes:
    """entries: (name, bytes) for a file, (name, ("symlink" | "hardlink", target)), or
    (name, None) for a folder."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, content in entries:
            info = tarfile.TarInfo(name)
            if content is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(content, tuple):
                info.type = tarfile.SYMTYPE if content[0] == "symlink" else tarfile.LNKTYPE
                info.linkname = content[1]
                tar.addfile(info)
            else:
                info.size = len(content)
                tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def _deb(folder: Path, package: str, entries: list, version: str = "1.0-1") -> Path:
    control = f"Package: {package}\nVersion: {version}\nArchitecture: all\nSource: src-{package}\n"
    control += "Description: a test\n long description\n"
    deb = folder / f"{package}_{version.replace(':', '%3a')}_all.deb"
    deb.parent.mkdir(parents=True, exist_ok=True)
    deb.write_bytes(
        _ar(
            {
                "debian-binary": b"2.0\n",
                "control.tar.xz": _tar_xz([("./control", control.encode())]),
                "data.tar.xz": _tar_xz(entries),
            }
        )
    )
    return deb


def _dep5(*stanzas: tuple[str, str]) -> bytes:
    return "\n".join(f"Files: {files}\nLicense: {lic}\n" for files, lic in stanzas).encode()


def _all_paths(root: Path) -> list[Path]:
    return [Path(d) / n for d, dirs, files in os.walk(root) for n in dirs + files]


def test_unpack_keeps_permissive_source_and_never_writes_outside_or_through_a_symlink(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.go").write_text("untouched\n")
    entries = [
        ("./", None),
        ("./usr/share/doc/golang-acme-dev/", None),
        (
            "./usr/share/doc/golang-acme-dev/copyright",
            _dep5(("*", "Expat"), ("internal/gpl/*", "GPL-2+")),
        ),
        (f"./{GO}/widget.go", _code("w").encode()),
        (f"./{GO}/internal/gpl/copyleft.go", _code("g").encode()),
        (f"./{GO}/README.md", b"# not source\n"),
        # A symlinked folder, then a file "in" it: the link is not extracted, so the file lands
        # in a real folder inside the package's own.
        (f"./{GO}/escape", ("symlink", str(outside))),
        (f"./{GO}/escape/victim.go", b"package evil\n" * 30),
        (f"./{GO}/passwd.go", ("symlink", "/etc/passwd")),
        (f"./{GO}/hard.go", ("hardlink", f"./{GO}/widget.go")),
        ("../../outside/climb.go", b"package evil\n"),
        ("/abs/usr/share/gocode/src/abs.go", b"package evil\n"),
    ]
    deb = _deb(tmp_path / "debs", "golang-acme-dev", entries)
    site = tmp_path / "out/site"
    record = unpack(deb, site)

    assert (outside / "victim.go").read_text() == "untouched\n"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.go"]
    dest = (site / "golang-acme-dev").resolve()
    for path in _all_paths(site):
        assert not path.is_symlink(), path
        assert path.resolve().is_relative_to(dest), path
    assert sorted(record["files"]) == [f"{GO}/escape/victim.go", f"{GO}/widget.go"]
    assert record["files"][f"{GO}/widget.go"] == {
        "lang": "go",
        "licence": "Expat",
        "bytes": len(_code("w").encode()),
    }
    assert record["rejected"] == {"Expat AND GPL-2+": 1}  # `*` matches its shorter tails
    assert record["licence"] == "Expat" and record["version"] == "1.0-1"
    assert record["source"] == "src-golang-acme-dev" and record["copyright_format"] == "dep5"
    assert (dest / "usr/share/doc/golang-acme-dev/copyright").is_file()
    assert not (dest / GO / "internal/gpl/copyleft.go").exists()
    assert not (dest / GO / "README.md").exists()
    on_disk = json.loads((dest / corpus.DEBIAN_RECORD).read_text())
    assert on_disk == record


def test_writing_refuses_a_symlinked_folder_or_file_already_there(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a/link").symlink_to(outside)
    (root / "f.go").symlink_to(outside / "target.go")
    assert not fetch_debian._write_inside(root, "a/link/x.go", b"x")
    assert not fetch_debian._write_inside(root, "f.go", b"x")
    assert list(outside.iterdir()) == []
    assert fetch_debian._write_inside(root, "a/b/c.go", b"x")
    assert not fetch_debian._write_inside(root, "a/b/c.go", b"y")  # never over a file
    assert (root / "a/b/c.go").read_bytes() == b"x"


def test_a_doc_folder_linking_to_another_package_reads_that_package_s_copyright(tmp_path):
    entries = [
        ("./usr/share/doc/libacme-dev", ("symlink", "libacme1")),
        ("./usr/include/acme.h", b"int acme(void);\n" * 20),
    ]
    deb = _deb(tmp_path / "debs", "libacme-dev", entries)
    alone = unpack(deb, tmp_path / "site")
    assert alone["files"] == {}
    assert alone["rejected"] == {"no copyright file (doc folder links to libacme1, not listed)": 1}
    lib = _deb(
        tmp_path / "debs",
        "libacme1",
        [("./usr/share/doc/libacme1/copyright", _dep5(("*", "Zlib")))],
    )
    record = unpack(deb, tmp_path / "site", {"libacme1": fetch_debian.copyright_text(lib)}.get)
    assert list(record["files"]) == ["usr/include/acme.h"]
    assert record["files"]["usr/include/acme.h"]["lang"] == "c"
    assert record["copyright"] == "usr/share/doc/libacme1/copyright"
    assert (
        (tmp_path / "site/libacme-dev/usr/share/doc/libacme1/copyright")
        .read_text()
        .startswith("Files: *")
    )


# --- fetching and the corpus part --------------------------------------------------------------


def test_read_list_and_a_failed_pin_is_named(tmp_path, monkeypatch):
    listed = tmp_path / "list.txt"
    listed.write_text("# pinned\nnode-acme=1:2.0-1  # comment\n\nlibacme-dev=1.0-1\n")
    assert fetch_debian.read_list(listed) == [("node-acme", "1:2.0-1"), ("libacme-dev", "1.0-1")]
    listed.write_text("node-acme\n")
    with pytest.raises(ValueError):
        fetch_debian.read_list(listed)
    # A stub apt-get: fails a call that names the bad pin, else writes each .deb.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(
        "#!/bin/sh\nshift; shift\n"
        'case "$*" in *bad=*) echo "E: Version 9 for bad was not found" >&2; exit 100;; esac\n'
        'for pin in "$@"; do n=${pin%%=*}; v=${pin#*=}; touch "${n}_${v}_all.deb"; done\n'
    )
    (bin_dir / "apt-get").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    debs = tmp_path / "debs"
    debs.mkdir()
    failed = fetch_debian.download([("good", "1.0"), ("bad", "9"), ("other", "2.0")], debs)
    assert list(failed) == ["bad"] and "not found" in failed["bad"]
    assert sorted(p.name for p in debs.iterdir()) == ["good_1.0_all.deb", "other_2.0_all.deb"]
    assert fetch_debian.download([("good", "1.0")], debs) == {}  # already there: no call


def test_the_corpus_builder_reads_the_unpacked_packages_as_a_part(tmp_path, monkeypatch):
    out = tmp_path / "debian"
    debs = out / "debs"
    modules = "usr/share/nodejs"
    _deb(
        debs,
        "golang-acme-dev",
        [
            ("./usr/share/doc/golang-acme-dev/copyright", _dep5(("*", "MIT or Apache-2.0"))),
            (f"./{GO}/widget.go", ("package widget\n" + _code("w")).encode()),
            (f"./{GO}/widget_test.go", ("package widget\n" + _code("t")).encode()),
        ],
    )
    _deb(
        debs,
        "node-acme",
        [
            ("./usr/share/doc/node-acme/copyright", _dep5(("*", "Expat"))),
            (f"./{modules}/acme/index.js", ("// acme\n" + _code("a")).encode()),
            (f"./{modules}/debug/src/index.js", ("// debug\n" + _code("d")).encode()),
            (f"./{modules}/@types/acme/index.d.ts", ("// t\n" + _code("ts")).encode()),
        ],
        version="1:2.0-1",
    )
    _deb(
        debs,
        "libcopyleft-perl",
        [
            ("./usr/share/doc/libcopyleft-perl/copyright", _dep5(("*", "Artistic or GPL-1+"))),
            ("./usr/share/perl5/Copyleft.pm", ("package Copyleft;\n" + _code("p")).encode()),
        ],
    )
    listed = tmp_path / "list.txt"
    listed.write_text("golang-acme-dev=1.0-1\nnode-acme=1:2.0-1\nlibcopyleft-perl=1.0-1\n")
    monkeypatch.setattr(fetch_debian, "download", lambda pins, dest: {})  # already fetched
    (out / "site/stale").mkdir(parents=True)  # from an earlier list: removed
    fetch_debian.main(["--list", str(listed), "--out", str(out)])
    assert sorted(p.name for p in (out / "site").iterdir()) == [
        "golang-acme-dev",
        "libcopyleft-perl",
        "node-acme",
    ]
    report = json.loads((out / "report.json").read_text())
    assert report["rejected"] == [
        {"package": "libcopyleft-perl", "licences": {"Artistic or GPL-1+": 1}}
    ]
    assert report["languages"]["go"]["files"] == 2

    official = tmp_path / "c/heldout.jsonl"
    official.parent.mkdir()
    official.write_text(json.dumps({"id": "pypi:x:o.py", "lang": "python", "text": "x"}) + "\n")
    npm_part = tmp_path / "manifest.json"  # another part holds the npm module `debug`
    npm_part.write_text(json.dumps({"sources": [{"kind": "npm", "name": "debug"}]}))
    manifest = corpus.build(
        tmp_path / "c",
        tmp_path / "npm",
        heldout_from=official,
        train_name="train-debian.jsonl",
        site_dir=out / "site",
        exclude_from=[npm_part],
        manifest_out=tmp_path / "m.json",
        heldout_list_out=tmp_path / "h.txt",
    )
    rows = [
        json.loads(line)
        for name in ("train-debian.jsonl", "heldout-debian.jsonl")
        for line in (tmp_path / "c" / name).read_text().splitlines()
    ]
    assert sorted((r["id"], r["lang"]) for r in rows) == [
        (f"debian:golang-acme-dev:{GO}/widget.go", "go"),
        (f"debian:golang-acme-dev:{GO}/widget_test.go", "go"),
        (f"debian:node-acme:{modules}/@types/acme/index.d.ts", "typescript"),
        (f"debian:node-acme:{modules}/acme/index.js", "javascript"),
    ]
    sources = {s["name"]: s for s in manifest["sources"]}
    assert sources["golang-acme-dev"]["version"] == "1.0-1"
    assert sources["golang-acme-dev"]["licence"] == "MIT or Apache-2.0"
    assert sources["golang-acme-dev"]["languages"] == {"go": 2}
    assert sources["node-acme"]["languages"] == {"javascript": 1, "typescript": 1}
    assert sources["node-acme"]["files_in_other_parts"] == 1
    assert manifest["rejected_for_licence"] == [
        {"kind": "debian", "name": "libcopyleft-perl", "licence": "Artistic or GPL-1+"}
    ]
    assert sum(v["train_files"] + v["heldout_files"] for v in manifest["languages"].values()) == 4


def test_a_deb_whose_version_is_not_the_pinned_one_stops_the_fetch(tmp_path, monkeypatch):
    out = tmp_path / "debian"
    deb = _deb(out / "debs", "node-acme", [("./usr/share/doc/node-acme/copyright", b"MIT\n")])
    deb.rename(out / "debs/node-acme_1.0-2_all.deb")  # named for the pin, holding another version
    listed = tmp_path / "list.txt"
    listed.write_text("node-acme=1.0-2\n")
    monkeypatch.setattr(fetch_debian, "download", lambda pins, dest: {})
    with pytest.raises(SystemExit):
        fetch_debian.main(["--list", str(listed), "--out", str(out)])


@pytest.mark.parametrize("part, pinned", [("debian", (150, 320)), ("debian2", (1000, 1400))])
def test_a_committed_debian_part_is_pinned(part, pinned):
    data = Path(corpus.__file__).parent / "data"
    pins = dict(fetch_debian.read_list(data / f"{part}_packages.txt"))
    assert pinned[0] <= len(pins) <= pinned[1]
    manifest = json.loads((data / f"manifest-{part}.json").read_text())
    for source in manifest["sources"]:
        assert source["kind"] == "debian" and pins[source["name"]] == source["version"]
    named = {s["name"] for s in manifest["sources"] + manifest["rejected_for_licence"]}
    # The rest are library packages listed only for the copyright file a -dev package links to.
    assert all(not n.endswith(("-dev", "-perl")) for n in set(pins) - named)
    assert {"go", "rust", "ruby", "javascript", "c", "cpp"} <= set(manifest["languages"])
