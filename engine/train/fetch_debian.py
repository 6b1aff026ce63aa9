"""Fetch Debian binary packages that carry source code (Go, Rust, Ruby, Perl, JavaScript, C and C++
headers) and unpack their permissively licensed source files into one folder per package, which the
corpus builder reads with `--site`. Nothing is installed and nothing from the packages runs.

    python -m engine.train.fetch_debian --list engine/train/data/debian_packages.txt \\
        --out .corpus/debian

downloads the listed versions with `apt-get download` into OUT/debs, reads each package's licence
from its `usr/share/doc/<pkg>/copyright` (machine-readable DEP-5 `Files:` stanzas matched by glob,
the last match winning; free text otherwise), and writes the source files under a licence that
engine/train/licenses.py accepts, with the copyright file, to OUT/site/<pkg>/ (two packages' files
of one path cannot overwrite each other). Each folder's `debian-source.json` records the version,
every kept file's language and licence, and how many files were left out under which licence.
A -dev package whose doc folder links to its library package's reads that package's copyright
file, so the library package is listed too. Symlinks, hard links and paths that would leave the
folder are never extracted. The corpus part (`.corpus/heldout.jsonl` is the official held-out
set, as for the wheel parts):

    python -m engine.train.corpus --out .corpus --site .corpus/debian/site \\
        --heldout-from .corpus/heldout.jsonl --train-name train-debian.jsonl \\
        --manifest-out engine/train/data/manifest-debian.json \\
        --heldout-list-out engine/train/data/heldout-debian.txt \\
        --exclude-from engine/train/data/manifest.json \\
        --exclude-from engine/train/data/manifest-gpu.json \\
        --exclude-from engine/train/data/manifest-extra.json \\
        --exclude-from engine/train/data/manifest-extra2.json \\
        --exclude-from engine/train/data/manifest-extra3.json
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .corpus import DEBIAN_RECORD, LANG_BY_SUFFIX
from .licenses import expression_ok

# Where Debian installs source: a `*` is one path component (the multiarch triplet).
SOURCE_ROOTS = (
    "usr/share/gocode/src",  # golang-*-dev
    "usr/share/cargo/registry",  # librust-*-dev
    "usr/share/rubygems-integration",  # ruby-*
    "usr/lib/*/rubygems-integration",
    "usr/lib/ruby/vendor_ruby",
    "usr/lib/*/ruby/vendor_ruby",
    "usr/share/perl5",  # lib*-perl
    "usr/lib/*/perl5",
    "usr/share/nodejs",  # node-*
    "usr/lib/nodejs",
    "usr/share/javascript",
    "usr/include",  # lib*-dev
    "usr/src",
)
PACKAGE_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]+")
BATCH = 20  # packages per apt-get call: few connections, each pipelined


def read_list(path: Path) -> list[tuple[str, str]]:
    """`package=version` lines ('#' starts a comment)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("=")
            if not PACKAGE_NAME.fullmatch(name) or not version:
                raise ValueError(f"not package=version: {line!r}")
            out.append((name, version))
    return out


# --- licences ---------------------------------------------------------------------------------


def dep5_expression(synopsis: str) -> str:
    """A DEP-5 License synopsis as an SPDX-style expression for licenses.expression_ok: 'or' and
    'and' become OR / AND, a comma ends a group ('A or B, and C' is '(A OR B) AND C'), and
    'with X exception' becomes 'WITH X-exception'."""

    def group(text: str) -> str:
        text = re.sub(r"\s+with\s+(\S+)\s+exception\b", r" WITH \1-exception", text, flags=re.I)
        text = re.sub(r"\s+or\s+", " OR ", text, flags=re.I)
        return re.sub(r"\s+and\s+", " AND ", text, flags=re.I).strip()

    pieces = re.split(r",\s*(and|or)\s+", " ".join(synopsis.split()), flags=re.I)
    expr = group(pieces[0])
    for op, rest in zip(pieces[1::2], pieces[2::2]):
        expr = f"({expr}) {op.upper()} ({group(rest)})"
    return expr


# Wording that identifies a licence in a copyright file's text. A permissive licence is recognised
# by its grant; any other licence or restriction named (or none found) rejects.
PERMISSIVE_TEXT = (
    ("MIT", r"permission is hereby granted, free of charge, to any person obtaining a copy"),
    ("BSD-3-Clause", r"neither the name of .{0,300}? nor the names of"),
    ("BSD-2-Clause", r"redistribution and use in source and binary forms"),
    ("Apache-2.0", r"apache license,? version 2\.0|common-licenses/apache-2\.0"),
    (
        "ISC",
        r"permission to use, copy, modify, and(/or)? distribute this software for any purpose "
        r"with or without fee is hereby granted",
    ),
    ("Zlib", r"this software is provided 'as-is', without any express or implied warranty"),
    ("BSL-1.0", r"boost software license"),
)
OTHER_TEXT = (
    ("GPL", r"general public licen[cs]e|\b[al]?gpl\b|common-licenses/[al]?gpl"),
    ("MPL", r"mozilla public licen[cs]e"),
    ("Artistic", r"artistic licen[cs]e|same terms as perl"),
    ("BSD-4-Clause", r"advertising materials"),
    ("EPL", r"eclipse public licen[cs]e"),
    ("CDDL", r"common development and distribution licen[cs]e"),
    ("Creative Commons", r"creative commons"),
    ("OFL", r"open font licen[cs]e|font software"),
    ("public domain", r"public domain"),
    ("restriction", r"non-?commercial|commons clause|good, not evil|hippocratic"),
)


# A named licence's text is read only if it is no longer than these licences are (BSD-3-Clause
# with its copyright line is about 1,600 characters): a longer one says more than they do.
MAX_NAMED_TEXT = 2000


def text_licence(text: str) -> tuple[bool, str]:
    """(permissive?, label) of a licence text, or of a whole copyright file that is not
    machine-readable (which does not say which files it covers, so one licence of any other
    kind rejects them all)."""
    flat = " ".join(text.lower().split())
    found = {name for name, pattern in PERMISSIVE_TEXT if re.search(pattern, flat)}
    if "BSD-3-Clause" in found:
        found.discard("BSD-2-Clause")  # its wording is part of BSD-3's
    other = [name for name, pattern in OTHER_TEXT if re.search(pattern, flat)]
    if other or not found:
        return False, "text: " + ", ".join(other or ["unknown"])
    return True, " AND ".join(sorted(found))


def _glob(pattern: str) -> str:
    """A DEP-5 Files pattern as a regex: `*` matches any characters, `/` included; `?` one;
    `\\` escapes."""
    pattern = pattern.removeprefix("./")
    if pattern.endswith("/"):
        pattern += "*"  # a folder: what it holds
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 1
        else:
            out.append({"*": ".*", "?": "."}.get(c) or re.escape(c))
        i += 1
    return "".join(out)


def paragraphs(text: str) -> list[dict[str, str]]:
    """deb822 paragraphs: field names lower-cased, continuation lines joined with newlines."""
    out, current, last = [], {}, None
    for line in text.splitlines():
        if not line.strip():
            if current:
                out.append(current)
            current, last = {}, None
        elif line[0] in " \t":
            if last is not None:
                current[last] += "\n" + line.strip()
        elif line.startswith("#"):
            continue
        elif ":" in line:
            name, _, value = line.partition(":")
            last = name.strip().lower()
            current[last] = value.strip()
    if current:
        out.append(current)
    return out


@dataclass
class Copyright:
    """What a copyright file says of each file: DEP-5 stanzas, or one licence for all."""

    stanzas: list[tuple[list[str], str]] = field(default_factory=list)  # (Files, License)
    texts: dict[str, str] = field(default_factory=dict)  # licence name -> its text in the file
    default: str | None = None  # the header's License, for paths no stanza covers
    text: tuple[bool, str] | None = None  # free text: one verdict for every file
    _verdicts: dict = field(default_factory=dict, repr=False)

    @property
    def format(self) -> str:
        return "text" if self.text is not None else "dep5"

    @functools.cached_property
    def _matcher(self) -> re.Pattern:
        # One alternation, last stanza first: its first alternative that matches is the last
        # stanza that does (one regex call a path, not one a pattern: Boost has hundreds).
        return re.compile(
            "|".join(
                "(" + "|".join(_glob(g) for g in globs) + ")" for globs, _ in self.stanzas[::-1]
            ),
            re.S,
        )

    def synopsis(self, rel: str) -> str | None:
        """The licence of the last stanza that matches `rel` (a path in the source package)."""
        m = self._matcher.fullmatch(rel)
        return None if m is None else self.stanzas[len(self.stanzas) - m.lastindex][1]

    def verdict(self, synopsis: str) -> tuple[bool, str]:
        """(permissive?, label) of a License synopsis. A name licenses.py does not know (Debian
        packages spell BSD-3-Clause 'BSD-C3', the Boost licence 'BSL') is judged by the text this
        file gives for it, but only a single name: a rider or a choice is never read from prose."""
        if synopsis not in self._verdicts:
            verdict = (False, synopsis or "unknown")
            if expression_ok(dep5_expression(synopsis)):
                verdict = (True, synopsis)
            elif (
                synopsis in self.texts
                and not re.search(r"\s(with|or|and)\s|,", synopsis, re.I)
                and len(" ".join(self.texts[synopsis].split())) <= MAX_NAMED_TEXT
            ):
                ok, label = text_licence(self.texts[synopsis])
                if ok:
                    verdict = (True, f"{synopsis} (text: {label})")
            self._verdicts[synopsis] = verdict
        return self._verdicts[synopsis]

    def licence(self, path: str) -> tuple[bool, tuple[str, ...]]:
        """(permissive?, the licences found) of an installed file. Its path in the source package
        is not known (`usr/share/gocode/src/github.com/a/b/x/y.go` was `x/y.go`), so every tail
        of the path below its source root is tried, and the file is kept only if each licence
        found is permissive: a stanza meant for another folder can only reject a file, never
        admit it."""
        if self.text is not None:
            return self.text[0], (self.text[1],)
        parts = strip_root(path).split("/")
        found = {self.synopsis("/".join(parts[i:])) for i in range(len(parts))} - {None}
        verdicts = sorted(self.verdict(s) for s in (found or {self.default or ""}))
        return all(ok for ok, _ in verdicts), tuple(label for _, label in verdicts)


def all_of(licences) -> str:
    """One label for several licences that all apply: 'A AND (B or C)'."""
    licences = sorted(set(licences))
    if len(licences) == 1:
        return licences[0]
    return " AND ".join(f"({l})" if " " in l else l for l in licences)


def parse_copyright(text: str) -> Copyright:
    """DEP-5 when the file has `Files:` stanzas, free text otherwise."""
    paras = paragraphs(text)
    stanzas, texts = [], {}
    for para in paras:
        name, _, body = para.get("license", "").partition("\n")
        if body.strip():
            texts.setdefault(name.strip(), body)
        if "files" in para:
            # Whitespace separates patterns; some files use commas too.
            stanzas.append((re.split(r"[\s,]+", para["files"].strip()), name.strip()))
    if not stanzas:
        return Copyright(text=text_licence(text))
    header = paras[0] if "files" not in paras[0] else {}
    default = header.get("license", "").split("\n")[0] or None
    return Copyright(stanzas, texts, default)


# --- which files ------------------------------------------------------------------------------


def _root_length(parts: list[str]) -> int:
    """How many leading components of a path are a source root (0: not under one)."""
    for root in SOURCE_ROOTS:
        pattern = root.split("/")
        if len(parts) > len(pattern) and all(
            fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern)
        ):
            return len(pattern)
    return 0


def strip_root(path: str) -> str:
    parts = path.split("/")
    return "/".join(parts[_root_length(parts) :])


def source_language(path: str) -> str | None:
    """The language of an installed file that is source of one, else None."""
    parts = path.split("/")
    suffix = os.path.splitext(parts[-1])[1].lower()
    if not _root_length(parts) or suffix not in LANG_BY_SUFFIX or parts[-1].endswith(".min.js"):
        return None
    return LANG_BY_SUFFIX[suffix]


def member_path(name: str) -> str | None:
    """A tar member's path relative to the package root, or None when it is absolute, empty or
    climbs ('..'): such a member is never written."""
    name = name.removeprefix("./")
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return None
    return name


# --- the .deb ---------------------------------------------------------------------------------


def _ar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """The members of an ar archive (a .deb is one): name and content."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        yield name, data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)


@contextmanager
def _open_tar(deb: Path, prefix: str) -> Iterator[tarfile.TarFile]:
    """The deb's control or data tar, read as a stream. zstd, which this Python cannot read, is
    left to dpkg-deb."""
    for name, content in _ar_members(deb.read_bytes()):
        if not name.startswith(prefix):
            continue
        if name.endswith(".zst"):
            option = "--ctrl-tarfile" if prefix == "control.tar" else "--fsys-tarfile"
            content = subprocess.run(
                ["dpkg-deb", option, str(deb)], capture_output=True, check=True
            ).stdout
        with tarfile.open(fileobj=io.BytesIO(content), mode="r|*") as tar:
            yield tar
        return
    raise ValueError(f"{deb.name}: no {prefix}")


def control(deb: Path) -> dict[str, str]:
    with _open_tar(deb, "control.tar") as tar:
        for member in tar:
            if member_path(member.name) == "control" and member.isfile():
                text = tar.extractfile(member).read().decode("utf-8", "replace")
                fields = paragraphs(text)[0]
                return {k: v for k, v in fields.items() if "\n" not in v}
    raise ValueError(f"{deb.name}: no control file")


def _write_inside(root: Path, rel: str, data: bytes) -> bool:
    """Write root/rel, creating its folders, never through a symlink and never over a file;
    False (nothing written) if the path is unsafe or already taken."""
    parts = rel.split("/")
    folder = root
    for part in parts[:-1]:
        folder = folder / part
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            return False
        folder.mkdir(exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    try:
        fd = os.open(folder / parts[-1], flags, 0o644)
    except OSError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def _scan(deb: Path, package: str) -> tuple[str | None, dict[str, str], str | None]:
    """The package's copyright text, its source files (path -> language) and, where its doc
    folder is a link to another package's, that package's name."""
    text, candidates, doc_link = None, {}, None
    with _open_tar(deb, "data.tar") as tar:
        for member in tar:
            rel = member_path(member.name)
            if rel is None:
                continue
            if member.issym() and rel == f"usr/share/doc/{package}":
                doc_link = PurePosixPath(member.linkname).name
            if not member.isfile():  # symlinks, hard links, devices: never extracted
                continue
            if rel == f"usr/share/doc/{package}/copyright":
                text = tar.extractfile(member).read().decode("utf-8", "replace")
            elif (lang := source_language(rel)) is not None:
                candidates[rel] = lang
    return text, candidates, doc_link


def copyright_text(deb: Path) -> str | None:
    """A package's own copyright file, for another package whose doc folder links to its."""
    return _scan(deb, control(deb)["package"])[0]


def unpack(deb: Path, site: Path, linked: Callable[[str], str | None] = lambda name: None) -> dict:
    """Unpack one .deb's permissively licensed source files into site/<package>; returns the
    record that is also written there. A -dev package's doc folder is often a link to its
    library package's (same source, same copyright file): `linked(name)` gives that file."""
    fields = control(deb)
    package = fields["package"]
    if not PACKAGE_NAME.fullmatch(package):
        raise ValueError(f"{deb.name}: package name {package!r}")
    text, candidates, doc_link = _scan(deb, package)
    owner = package  # whose copyright file it is
    if text is None and doc_link and PACKAGE_NAME.fullmatch(doc_link):
        text, owner = linked(doc_link), doc_link
    if text is None:
        why = f" (doc folder links to {doc_link}, not listed)" if doc_link else ""
        verdicts = {rel: (False, ("no copyright file" + why,)) for rel in candidates}
        fmt = "none"
    else:
        parsed = parse_copyright(text)
        verdicts = {rel: parsed.licence(rel) for rel in candidates}
        fmt = parsed.format
    keep = {rel for rel, (ok, _) in verdicts.items() if ok}
    rejected = collections.Counter(all_of(found) for ok, found in verdicts.values() if not ok)
    # Second pass (a stream is read once): write the kept files and the copyright file.
    dest = site / package
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    written: dict[str, int] = {}  # path -> bytes
    copyright_rel = f"usr/share/doc/{owner}/copyright"
    with _open_tar(deb, "data.tar") as tar:
        for member in tar:
            rel = member_path(member.name)
            if member.isfile() and rel is not None and (rel in keep or rel == copyright_rel):
                if _write_inside(dest, rel, data := tar.extractfile(member).read()):
                    written[rel] = len(data)
    if text is not None and owner != package:
        _write_inside(dest, copyright_rel, text.encode())
    files = {
        rel: {"lang": candidates[rel], "licence": all_of(verdicts[rel][1]), "bytes": written[rel]}
        for rel in sorted(keep & written.keys())
    }
    record = {
        "package": package,
        "version": fields.get("version", ""),
        "architecture": fields.get("architecture", ""),
        "source": fields.get("source", package).split()[0],
        "copyright": copyright_rel if text is not None else None,
        "copyright_format": fmt,
        # Every licence a kept file is under: the part's terms are all of them.
        "licence": all_of(l for rel in files for l in verdicts[rel][1]) if files else "",
        "files": files,
        "rejected": dict(sorted(rejected.items())),
    }
    (dest / DEBIAN_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return record


# --- fetching ---------------------------------------------------------------------------------


def deb_file(debs: Path, name: str, version: str) -> Path | None:
    """The downloaded .deb of name=version (apt writes the epoch's ':' as '%3a')."""
    found = sorted(debs.glob(f"{name}_{version.replace(':', '%3a')}_*.deb"))
    return found[0] if found else None


def download(pins: list[tuple[str, str]], dest: Path) -> dict[str, str]:
    """apt-get download the pinned versions not yet in dest; the failures, name -> error."""
    missing = [(n, v) for n, v in pins if deb_file(dest, n, v) is None]
    if not missing:
        return {}
    done = subprocess.run(
        ["apt-get", "download", "-q", *(f"{n}={v}" for n, v in missing)],
        cwd=dest,
        capture_output=True,
        text=True,
    )
    if done.returncode == 0 or len(missing) == 1:
        errors = [l for l in done.stderr.splitlines() if l.startswith("E:")]
        return {
            n: (errors or ["not downloaded"])[-1]
            for n, v in missing
            if deb_file(dest, n, v) is None
        }
    # One bad pin fails the whole call: try each alone to name it.
    failed: dict[str, str] = {}
    for pin in missing:
        failed |= download([pin], dest)
    return failed


def summary(records: list[dict]) -> dict:
    """Per language: packages with kept files, files and bytes kept."""
    langs: dict[str, dict] = {}
    for record in records:
        for lang in {f["lang"] for f in record["files"].values()}:
            langs.setdefault(lang, {"packages": 0, "files": 0, "bytes": 0})["packages"] += 1
        for f in record["files"].values():
            langs[f["lang"]]["files"] += 1
            langs[f["lang"]]["bytes"] += f["bytes"]
    return dict(sorted(langs.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--list", type=Path, required=True, help="one package=version a line")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=4, help="apt-get calls at once")
    ap.add_argument(
        "--allow-missing", action="store_true", help="go on when a package cannot be fetched"
    )
    args = ap.parse_args(argv)
    debs, site = args.out / "debs", args.out / "site"
    debs.mkdir(parents=True, exist_ok=True)
    pins = read_list(args.list)
    batches = [pins[i : i + BATCH] for i in range(0, len(pins), BATCH)]
    with ThreadPoolExecutor(args.jobs) as pool:
        failed = {
            k: v
            for errors in pool.map(lambda b: download(b, debs), batches)
            for k, v in errors.items()
        }
    for name, error in sorted(failed.items()):
        print(f"not fetched: {name}: {error}", file=sys.stderr)
    if failed and not args.allow_missing:
        raise SystemExit(
            f"{len(failed)} packages not fetched (--allow-missing to go on without them)"
        )
    # Only the listed packages: the folders may hold others from an earlier, different list.
    listed = [(n, v, deb) for n, v in pins if (deb := deb_file(debs, n, v)) is not None]
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    by_name = {name: deb for name, _, deb in listed}

    def linked(name: str) -> str | None:  # the copyright file of a listed package
        return copyright_text(by_name[name]) if name in by_name else None

    with ThreadPoolExecutor(os.cpu_count() or 4) as pool:
        records = list(pool.map(lambda item: unpack(item[2], site, linked), listed))
    report = {"packages": [], "rejected": [], "no_source": []}
    for (name, version, _), record in zip(listed, records):
        if record["package"] != name or record["version"] != version:
            raise SystemExit(
                f"{name}={version}: the .deb is {record['package']}={record['version']}"
            )
        if record["files"]:
            report["packages"].append(name)
        elif record["rejected"]:
            report["rejected"].append({"package": name, "licences": record["rejected"]})
        else:
            report["no_source"].append(name)
    report["languages"] = summary(records)
    report["files_rejected"] = dict(
        sum((collections.Counter(r["rejected"]) for r in records), collections.Counter())
    )
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{len(listed)} of {len(pins)} packages unpacked: {len(report['packages'])} with kept "
        f"files, {len(report['rejected'])} rejected for licence, "
        f"{len(report['no_source'])} without source files"
    )
    for lang, n in report["languages"].items():
        print(f"  {lang}: {n['packages']} packages, {n['files']} files, {n['bytes'] / 1e6:.1f} MB")
    for r in report["rejected"]:
        print(f"  rejected {r['package']}: {'; '.join(r['licences'])}")


if __name__ == "__main__":
    main()
