"""The corpus builder's near-copy filter and partial (GPU machine) build, and the packer's
exclusion of what the GPU machine builds itself. Synthetic sources in tmp dirs, no network."""

import json
import tarfile
from pathlib import Path

import pytest

from engine.train import corpus, pack
from engine.train.corpus import Source, content_key, is_heldout, near_heldout_filter


def _code(tag: str, n: int = 30) -> str:
    return "".join(
        f"    result_{tag}_{i} = compute_{tag}(argument_{i}, other_{i})\n" for i in range(n)
    )


def test_near_copy_is_dropped_unrelated_and_short_line_files_kept():
    held = "def f():\n" + _code("held")
    is_near = near_heldout_filter([held])
    lines = held.split("\n")
    edited = "\n".join(l + "  # changed" if i % 5 == 0 else l for i, l in enumerate(lines))
    assert is_near(held)
    assert is_near(edited)  # a few lines edited: still a copy
    assert not is_near("def g():\n" + _code("other"))  # unrelated
    assert not is_near("x = 1\n" * 50)  # no significant lines: kept
    half = "\n".join(lines[:11] + [l.replace("held", "new") for l in lines[11:21]])
    assert not is_near(half)  # exactly half shared: kept


def test_pack_exclusion_names_are_pep503_normalized():
    listed = {pack.normalize(n) for n in ("pyyaml", "typing-extensions", "Jinja2")}
    assert pack.built_there("python-stdlib:os.py", listed)
    assert pack.built_there("pypi:PyYAML:yaml/__init__.py", listed)
    assert pack.built_there("pypi:typing_extensions:typing_extensions.py", listed)
    assert pack.built_there("pypi:jinja2:jinja2/ext.py", listed)
    assert not pack.built_there("pypi:pydantic:pydantic/main.py", listed)
    assert not pack.built_there("npm:lodash:map.js", listed)
    assert pack.normalize("Foo.Bar__baz") == "foo-bar-baz"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_pack_leaves_out_what_the_gpu_machine_builds(tmp_path):
    ids = [
        "python-stdlib:os.py",
        "pypi:PyYAML:yaml/a.py",
        "pypi:typing_extensions:t.py",
        "pypi:pydantic:p.py",
        "npm:lodash:map.js",
    ]
    _write(
        tmp_path / "c/train.jsonl",
        "".join(json.dumps({"id": i, "lang": "python", "text": "x"}) + "\n" for i in ids),
    )
    _write(
        tmp_path / "c/heldout.jsonl",
        json.dumps({"id": "npm:a:b.js", "lang": "javascript", "text": "y"}) + "\n",
    )
    listed = _write(tmp_path / "pk.txt", "# image packages\npyyaml\ntyping-extensions\n")
    pack.main(
        [
            "--corpus",
            str(tmp_path / "c"),
            "--out",
            str(tmp_path / "p.tar.xz"),
            "--exclude-gpu-machine",
            "--package-list",
            str(listed),
        ]
    )
    with tarfile.open(tmp_path / "p.tar.xz") as tar:
        train = [
            json.loads(l)["id"] for l in tar.extractfile("train.jsonl").read().decode().splitlines()
        ]
        held = tar.extractfile("heldout.jsonl").read()
    assert train == ["pypi:pydantic:p.py", "npm:lodash:map.js"]
    assert held == (tmp_path / "c/heldout.jsonl").read_bytes()


def test_the_listed_gpu_packages_parse():
    names = pack.read_package_list()
    assert {"torch", "numpy", "pyyaml", "typing-extensions"} <= names and len(names) > 150
    assert all(n == pack.normalize(n) for n in names)


def _heldout_text() -> str:
    """A file whose content hash falls in the held-out split."""
    for i in range(10_000):
        text = f"def held_{i}():\n" + _code(f"h{i}")
        if is_heldout(content_key(text)):
            return text
    raise AssertionError("no held-out text found")


def test_partial_build_filters_against_official_heldout_and_leaves_it_alone(tmp_path, monkeypatch):
    official_text = "def official():\n" + _code("official")
    near_copy = official_text.replace("argument_3,", "argument_three,")
    own_heldout = _heldout_text()
    root = tmp_path / "site"
    files = {
        "pkg/near.py": near_copy,
        "pkg/plain.py": "def plain():\n" + _code("plain"),
        "pkg/short.py": "x = 1\n" * 60,
        "pkg/held.py": own_heldout,
    }
    for rel, text in files.items():
        _write(root / rel, text)
    monkeypatch.setattr(
        corpus,
        "stdlib_source",
        lambda: Source("python-stdlib", "cpython-stdlib", "3", "PSF-2.0", root, []),
    )
    monkeypatch.setattr(
        corpus,
        "pypi_sources",
        lambda rejected: [Source("pypi", "pkg", "1", "MIT", root, sorted(files))],
    )
    data_dir = tmp_path / "data"
    monkeypatch.setattr(corpus, "DATA_DIR", data_dir)
    records = [
        _write(data_dir / "manifest.json", "{}\n"),
        _write(data_dir / "heldout.txt", "official\n"),
    ]
    out = tmp_path / "corpus"
    official = _write(
        out / "heldout.jsonl",
        json.dumps({"id": "pypi:x:o.py", "lang": "python", "text": official_text}) + "\n",
    )
    before = [p.read_bytes() for p in records + [official]]

    corpus.main(
        [
            "--out",
            str(out),
            "--heldout-from",
            str(official),
            "--no-npm",
            "--train-name",
            "train-gpu.jsonl",
            "--manifest-out",
            str(tmp_path / "m.json"),
            "--heldout-list-out",
            str(tmp_path / "h.txt"),
        ]
    )

    assert [p.read_bytes() for p in records + [official]] == before

    def read(name):
        return [json.loads(l)["id"] for l in (out / name).read_text().splitlines()]

    assert read("train-gpu.jsonl") == ["pypi:pkg:pkg/plain.py", "pypi:pkg:pkg/short.py"]
    assert read("heldout-gpu.jsonl") == ["pypi:pkg:pkg/held.py"]
    assert json.loads((tmp_path / "m.json").read_text())["totals"]["near_heldout"] == 1
    assert (tmp_path / "h.txt").read_text().split()[-1] == "pypi:pkg:pkg/held.py"
    # The default train name would make its held-out file an official heldout.jsonl: refused.
    with pytest.raises(ValueError):
        corpus.build(out, tmp_path / "npm", heldout_from=official, npm=False)
    assert official.read_bytes() == before[-1]


def test_own_heldout_files_filter_train_copies_and_sources_from_pins_packages(
    tmp_path, monkeypatch
):
    own_heldout = _heldout_text()
    root = tmp_path / "site"
    _write(root / "a/held.py", own_heldout)
    _write(root / "a/copy.py", own_heldout.replace("argument_1,", "argument_one,"))
    _write(root / "b/new.py", "def new():\n" + _code("new"))
    monkeypatch.setattr(
        corpus,
        "stdlib_source",
        lambda: Source("python-stdlib", "cpython-stdlib", "3", "PSF-2.0", root, []),
    )
    monkeypatch.setattr(
        corpus,
        "pypi_sources",
        lambda rejected: [
            Source("pypi", "a", "1", "MIT", root, ["a/copy.py", "a/held.py"]),
            Source("pypi", "b", "1", "MIT", root, ["b/new.py"]),
        ],
    )
    pinned = _write(
        tmp_path / "old.json",
        json.dumps({"sources": [{"kind": "pypi", "name": "a"}], "rejected_for_licence": []}),
    )
    manifest = corpus.build(
        tmp_path / "out",
        tmp_path / "npm",
        manifest_out=tmp_path / "m.json",
        heldout_list_out=tmp_path / "h.txt",
        sources_from=pinned,
    )
    assert (tmp_path / "out/train.jsonl").read_text() == ""  # the copy is dropped, b not read
    assert [s["name"] for s in manifest["sources"]] == ["a"]
    assert manifest["totals"]["near_heldout"] == 1 and manifest["totals"]["heldout_files"] == 1


def test_a_bigger_file_holding_a_heldout_file_is_dropped_but_shared_boilerplate_is_not():
    header = "".join(
        f"# Licensed under the project's licence, clause number {i} of the text\n" for i in range(6)
    )
    held_a, held_b = header + _code("alpha"), header + _code("beta")
    is_near = near_heldout_filter([held_a, held_b])
    bundle = (
        _code("one") + held_a + _code("two") + _code("three")
    )  # holds all of held_a, mostly other code
    assert is_near(bundle)
    assert not is_near(header + _code("gamma") + _code("delta"))  # only the shared header


def _wheel(
    path: Path,
    name: str,
    licence: str,
    files: dict[str, str],
    extra: dict[str, bytes] | None = None,
) -> Path:
    """A minimal wheel: the files, METADATA and a RECORD that lists them (what importlib reads)."""
    import zipfile

    info = f"{name}-1.0.dist-info"
    record = "".join(f"{rel},,\n" for rel in files) + f"{info}/METADATA,,\n{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for rel, text in files.items():
            z.writestr(rel, text)
        for rel, data in (extra or {}).items():
            z.writestr(rel, data)
        z.writestr(
            f"{info}/METADATA",
            f"Metadata-Version: 2.4\nName: {name}\nVersion: 1.0\nLicense-Expression: {licence}\n",
        )
        z.writestr(f"{info}/RECORD", record)
    return path


def test_unpack_keeps_python_and_metadata_only_and_stays_inside(tmp_path):
    from engine.train.fetch_wheels import read_list, unpack

    wheel = _wheel(
        tmp_path / "w.whl",
        "pkga",
        "MIT",
        {"pkga/mod.py": "x = 1\n"},
        {"pkga/_speed.so": b"\x7fELF", "pkga/data.json": b"{}", "../escape.py": b"y = 2\n"},
    )
    site = tmp_path / "site"
    assert unpack(wheel, site) == 4  # mod.py, escape.py (kept inside), METADATA, RECORD
    assert (site / "pkga/mod.py").read_text() == "x = 1\n"
    assert not (site / "pkga/_speed.so").exists() and not (site / "pkga/data.json").exists()
    assert not (tmp_path / "escape.py").exists() and (site / "escape.py").exists()
    listed = _write(tmp_path / "list.txt", "# pinned\nDjango==5.2.19\n\n  flask==3.1.3\n")
    assert read_list(listed) == ["Django==5.2.19", "flask==3.1.3"]


def test_fetch_unpacks_only_listed_wheels_each_in_its_own_folder(tmp_path, monkeypatch):
    from engine.train import fetch_wheels

    out = tmp_path / "extra"
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    # Two wheels ship the same path; a third is a stale wheel from an earlier, wider list.
    _wheel(wheels / "aaa-1.0-py3-none-any.whl", "aaa", "MIT", {"tests/conftest.py": "# aaa's\n"})
    _wheel(
        wheels / "zzz-1.0-py3-none-any.whl",
        "zzz",
        "GPL-3.0-only",
        {"tests/conftest.py": "# zzz's\n"},
    )
    _wheel(wheels / "old-1.0-py3-none-any.whl", "old", "MIT", {"old/a.py": "x = 1\n"})
    _write(out / "site/stale/leftover.py", "y = 2\n")
    listed = _write(tmp_path / "list.txt", "aaa==1.0\nZzz==1.0\n")
    monkeypatch.setattr(fetch_wheels, "download", lambda requirement, dest: None)  # already fetched
    fetch_wheels.main(["--list", str(listed), "--out", str(out)])
    assert sorted(p.name for p in (out / "site").iterdir()) == [
        "aaa-1.0-py3-none-any",
        "zzz-1.0-py3-none-any",
    ]
    assert (out / "site/aaa-1.0-py3-none-any/tests/conftest.py").read_text() == "# aaa's\n"
    sources = corpus.pypi_sources(rejected := [], out / "site")
    assert [(s.name, s.files) for s in sources] == [("aaa", ["tests/conftest.py"])]
    assert [r["name"] for r in rejected] == ["zzz"]
    assert (sources[0].root / "tests/conftest.py").read_text() == "# aaa's\n"
    # A wheel that cannot be fetched stops the command unless told to go on.
    monkeypatch.setattr(
        fetch_wheels, "download", lambda requirement, dest: "no matching distribution"
    )
    with pytest.raises(SystemExit):
        fetch_wheels.main(["--list", str(listed), "--out", str(out)])
    fetch_wheels.main(["--list", str(listed), "--out", str(out), "--allow-missing"])


def test_site_build_reads_only_that_folder_and_honours_skip_and_other_parts(tmp_path):
    from engine.train.fetch_wheels import unpack

    site = tmp_path / "site"
    wheels = {
        "good": ("MIT", "good/core.py"),
        "copyleft": ("GPL-3.0-only", "copyleft/x.py"),
        "Big_Pkg": ("BSD-3-Clause", "big_pkg/y.py"),
        "other-part": ("MIT", "other_part/z.py"),
        "namesake": ("MIT", "namesake/w.py"),
    }
    for name, (licence, rel) in wheels.items():
        unpack(
            _wheel(
                tmp_path / f"{name}.whl", name, licence, {rel: f"def {rel[:3]}():\n" + _code(name)}
            ),
            site / name,
        )
    official = _write(
        tmp_path / "out/heldout.jsonl",
        json.dumps({"id": "pypi:x:o.py", "lang": "python", "text": "def o():\n" + _code("o")})
        + "\n",
    )
    # Another part's manifest kept Other_Part (an npm package of the same name as a PyPI one is
    # another package), and a machine's package list names Listed_Pkg.
    other = _write(
        tmp_path / "other.json",
        json.dumps(
            {
                "sources": [
                    {"kind": "pypi", "name": "Other_Part"},
                    {"kind": "npm", "name": "namesake"},
                ]
            }
        ),
    )
    listed = _write(tmp_path / "machine.txt", "# a machine's packages\nlisted.pkg\n")
    unpack(
        _wheel(
            tmp_path / "listed.whl",
            "Listed_Pkg",
            "MIT",
            {"listed_pkg/v.py": "def lis():\n" + _code("lst")},
        ),
        site / "listed",
    )
    manifest = corpus.build(
        tmp_path / "out",
        tmp_path / "npm",
        heldout_from=official,
        train_name="train-extra.jsonl",
        site_dir=site,
        exclude_from=[other, listed],
        skip=["big-pkg"],
        manifest_out=tmp_path / "m.json",
    )
    train = [
        json.loads(l)["id"] for l in (tmp_path / "out/train-extra.jsonl").read_text().splitlines()
    ]
    assert train == ["pypi:good:good/core.py", "pypi:namesake:namesake/w.py"]  # no stdlib, no venv
    assert [s["name"] for s in manifest["sources"]] == ["good", "namesake"]
    assert [r["name"] for r in manifest["rejected_for_licence"]] == ["copyleft"]
    assert manifest["skipped"] == ["big-pkg"]


def test_pack_splits_one_train_file_over_several_archives_in_order(tmp_path):
    sizes = [5000] + [50 + i for i in range(40)]  # one big first file must not leave a part empty
    lines = [
        json.dumps({"id": f"pypi:p:{i}.py", "lang": "python", "text": "x" * n}) + "\n"
        for i, n in enumerate(sizes)
    ]
    _write(tmp_path / "c/train-extra.jsonl", "".join(lines))
    _write(
        tmp_path / "c/heldout.jsonl", json.dumps({"id": "h", "lang": "python", "text": "y"}) + "\n"
    )
    pack.main(
        [
            "--corpus",
            str(tmp_path / "c"),
            "--out",
            str(tmp_path / "e.tar.xz"),
            "--train-name",
            "train-extra.jsonl",
            "--parts",
            "3",
        ]
    )
    got = []
    for k in (1, 2, 3):
        with tarfile.open(tmp_path / f"e.part{k}.tar.xz") as tar:
            members = tar.getnames()
            part = (
                tar.extractfile(f"train-extra-{k}.jsonl").read().decode().splitlines(keepends=True)
            )
        assert members == [f"train-extra-{k}.jsonl"] + (["heldout.jsonl"] if k == 1 else [])
        assert part
        got += part
    assert got == lines
    assert pack.split_bytes(["a"], 3) == [["a"]] and pack.split_bytes([], 2) == [[]]
    with pytest.raises(SystemExit):
        pack.main(
            ["--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "f.tar.xz"), "--parts", "0"]
        )
    with pytest.raises(SystemExit):  # the trainer would not read it
        pack.main(
            [
                "--corpus",
                str(tmp_path / "c"),
                "--out",
                str(tmp_path / "f.tar.xz"),
                "--train-name",
                "extra.jsonl",
            ]
        )


@pytest.mark.parametrize("part", ["extra", "extra2", "extra4", "extra5", "extra6"])
def test_a_fetched_part_is_pinned_and_shares_no_package_with_the_other_parts(part):
    from engine.train.fetch_wheels import read_list, requirement_key

    data = Path(corpus.__file__).parent / "data"
    fetched = json.loads((data / f"manifest-{part}.json").read_text())
    pinned = {requirement_key(r) for r in read_list(data / f"{part}_packages.txt")}
    kept = {requirement_key(f"{s['name']}=={s['version']}") for s in fetched["sources"]}
    rejected = {corpus.normalize(s["name"]) for s in fetched.get("rejected_for_licence", [])}
    # Every pin is kept, or named where the licence check turned it away.
    assert kept <= pinned
    assert {corpus.normalize(p.split("==")[0]) for p in pinned - kept} <= rejected
    names = {corpus.normalize(s["name"]) for s in fetched["sources"]}
    parts = {"manifest.json", "manifest-gpu.json"} | {p.name for p in data.glob("manifest-extra*")}
    for other in sorted(parts - {f"manifest-{part}.json"}):
        others = {
            corpus.normalize(s["name"])
            for s in json.loads((data / other).read_text())["sources"]
            if s["kind"] == "pypi"
        }
        assert not others & names, other
    assert not pack.read_package_list() & names  # nor what the GPU machine builds itself


def _gpu_session(tmp_path: Path, *args: str, **env: str):
    """Run gpu_session.sh in tmp_path (its checkout) with python and nvidia-smi stubbed: the
    stub records its arguments, and as the trainer prints one step and exits."""
    import subprocess

    bin_dir = tmp_path / "bin"
    _write(bin_dir / "nvidia-smi", "#!/bin/sh\necho stub-gpu\n").chmod(0o755)
    stub = env.pop(
        "PYTHON_STUB",
        '#!/bin/sh\necho "$@" >> "$STUB_LOG"\n'
        'case "$*" in *engine.train.train*) echo step=1 ;; esac\n',
    )
    _write(bin_dir / "python3", stub).chmod(0o755)
    script = Path(__file__).parents[2] / "engine/train/gpu_session.sh"
    base = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STAGE_DIR": str(tmp_path / "stage"),
        "OUT": str(tmp_path / "o"),
        "RUN_DIR": str(tmp_path / "run"),
        "STUB_LOG": str(tmp_path / "stub.log"),
    }
    (tmp_path / "o").mkdir(exist_ok=True)
    return subprocess.run(
        ["bash", str(script), *args],
        cwd=tmp_path,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_gpu_session_stages_parts_and_start_trains_on_exactly_them(tmp_path):
    two = "".join(
        json.dumps({"id": f"pypi:p:{i}.py", "lang": "python", "text": "x" * 80}) + "\n"
        for i in range(2)
    )
    _write(tmp_path / "c/train-extra.jsonl", two)
    _write(
        tmp_path / "c/train.jsonl",
        json.dumps({"id": "npm:a:b.js", "lang": "javascript", "text": "z"}) + "\n",
    )
    _write(
        tmp_path / "c/heldout.jsonl", json.dumps({"id": "h", "lang": "python", "text": "y"}) + "\n"
    )
    pack.main(
        [
            "--corpus",
            str(tmp_path / "c"),
            "--out",
            str(tmp_path / "e.tar.xz"),
            "--train-name",
            "train-extra.jsonl",
            "--parts",
            "2",
            "--no-heldout",
        ]
    )
    pack.main(["--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "p.tar.xz")])
    for name in ("manifest-extra.json", "manifest-extra2.json"):  # the fetched parts' records
        _write(tmp_path / "engine/train/data" / name, '{"sources": []}\n')
    _write(tmp_path / "stage/train-old.jsonl", "{}\n")  # from an earlier staging
    _write(tmp_path / ".corpus/train-stale.jsonl", "{}\n")  # from an earlier run
    done = _gpu_session(
        tmp_path,
        "stage",
        "--clear",
        str(tmp_path / "e.part1.tar.xz"),
        str(tmp_path / "e.part2.tar.xz"),
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "stage").iterdir()) == [
        "train-extra-1.jsonl",
        "train-extra-2.jsonl",
    ]
    done = _gpu_session(
        tmp_path, "start", str(tmp_path / "p.tar.xz"), "100", "--lr", "1e-3", CALL_S="1"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in (tmp_path / ".corpus").glob("*.jsonl")) == [
        "heldout.jsonl",
        "train-extra-1.jsonl",
        "train-extra-2.jsonl",
        "train.jsonl",
    ]
    calls = (tmp_path / "stub.log").read_text().splitlines()
    assert calls[0].endswith(
        "--exclude-from engine/train/data/manifest-extra.json "
        "--exclude-from engine/train/data/manifest-extra2.json"
    )  # the corpus build
    assert calls[1].startswith("-m engine.train.train") and calls[1].endswith(
        "--budget-s 100 --lr 1e-3"
    )


def test_npm_packages_are_read_with_the_recorded_suffixes(tmp_path):
    """The committed manifest's npm part read .py files too (one package ships a Python port):
    reading fewer suffixes would rebuild that part one file short."""
    pkg = tmp_path / "node_modules" / "flat"
    _write(pkg / "package.json", json.dumps({"name": "flat", "version": "1.0.0", "license": "ISC"}))
    for rel in ("index.js", "types.d.ts", "python/flat.py", "x.min.js", "README.md", "x.json"):
        _write(pkg / rel, "x = 1\n")
    _write(pkg / "node_modules/dep/index.js", "x = 1\n")
    (source,) = corpus.npm_sources(tmp_path, [])
    assert source.files == ["index.js", "python/flat.py", "types.d.ts"]


def test_gpu_session_resumes_from_weights_that_travelled_in_pieces(tmp_path):
    """A checkpoint too big for one transfer: its folder travels without model.safetensors, the
    weights as split pieces staged over several calls, joined in order for the trainer."""
    _packed_corpus(tmp_path)
    weights = bytes(range(256)) * 40
    for i, piece in enumerate((weights[:4000], weights[4000:9000], weights[9000:])):
        _write(tmp_path / f"pieces/model.safetensors.part{i:02d}", "").write_bytes(piece)
    ckpt = tmp_path / "ckpt"
    _write(ckpt / "config.json", '{"hidden_size": 8}\n')
    _write(ckpt / "training_state.json", '{"step": 3}\n')
    for call in (
        ["--clear", "pieces/model.safetensors.part00"],
        ["pieces/model.safetensors.part01", "pieces/model.safetensors.part02"],
    ):
        done = _gpu_session(tmp_path, "stage", *call)
        assert done.returncode == 0, done.stderr
    done = _gpu_session(tmp_path, "start", "p.tar.xz", "100", CALL_S="1", RESUME=str(ckpt))
    assert done.returncode == 0, done.stdout + done.stderr
    joined = tmp_path / "run/resume"
    assert (joined / "model.safetensors").read_bytes() == weights
    assert (joined / "training_state.json").read_text() == '{"step": 3}\n'
    assert (tmp_path / "run/model/config.json").read_text() == '{"hidden_size": 8}\n'
    train_call = (tmp_path / "stub.log").read_text().splitlines()[1]
    assert f"--resume {joined} " in train_call


def test_gpu_session_resumes_a_folder_with_weights_of_its_own_as_it_is(tmp_path):
    """Pieces left staged from another run are never joined over a checkpoint's own shards."""
    _packed_corpus(tmp_path)
    _write(tmp_path / "model.safetensors.part00", "someone else's weights")
    ckpt = tmp_path / "ckpt"
    _write(ckpt / "config.json", "{}\n")
    _write(ckpt / "model-00001-of-00001.safetensors", "shard")
    assert _gpu_session(tmp_path, "stage", "--clear", "model.safetensors.part00").returncode == 0
    done = _gpu_session(tmp_path, "start", "p.tar.xz", "100", CALL_S="1", RESUME=str(ckpt))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"--resume {ckpt} " in (tmp_path / "stub.log").read_text().splitlines()[1]
    assert not (tmp_path / "run/resume").exists()
    refused = _gpu_session(tmp_path, "stage", "notes.txt")
    assert refused.returncode == 1 and "neither a corpus part" in refused.stdout


def test_gpu_session_starts_again_with_the_fallback_args_when_no_step_comes(tmp_path):
    _packed_corpus(tmp_path)
    # A trainer that fails before its first step with the grouped form, and trains with dense.
    trainer = (
        '#!/bin/sh\necho "$@" >> "$STUB_LOG"\n'
        'case "$*" in *"--moe dense"*) echo step=1 ;; *engine.train.train*) exit 1 ;; esac\n'
    )
    done = _gpu_session(
        tmp_path,
        "start",
        "p.tar.xz",
        "100",
        "--moe",
        "grouped",
        CALL_S="1",
        FALLBACK="--moe dense",
        PYTHON_STUB=trainer,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "falling back to --moe dense" in done.stdout
    first, second = (tmp_path / "stub.log").read_text().splitlines()[1:3]
    assert first.endswith("--moe grouped") and second.endswith("--moe grouped --moe dense")


def _packed_corpus(tmp_path: Path) -> None:
    """A one-file corpus packed as p.tar.xz in the checkout, with the tokenizer files a model
    folder is made from."""
    for name, doc_id in (("train", "a"), ("heldout", "h")):
        line = json.dumps({"id": doc_id, "lang": "python", "text": doc_id * 3}) + "\n"
        _write(tmp_path / f"c/{name}.jsonl", line)
    pack.main(["--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "p.tar.xz")])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        _write(tmp_path / "engine/models/wd-coder-small" / name, "{}")
