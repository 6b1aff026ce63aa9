"""The eval over several held-out parts and languages: today's tasks kept exactly, the files drawn
per language, each language's task rules, and the per-language report."""

import hashlib
import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch

from engine.train import eval as evaluation
from engine.train import heldout
from engine.train.fim_tasks import FimTask, make_tasks, starts_task
from engine.train.metrics import clustered_mean_interval, t_quantile

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / "engine" / "models" / "wd-coder-tiny"

# Task digests of the original part's first Python files (seed 0, the default context), taken
# before the eval read more than one part: the tasks every earlier number was measured on.
PINNED = {
    # the default eval: 100 files, one task each
    ("single", 100, 1): "8034470e34c97e0835c9c6f9f27ed49ded5bc46ca2426166cdd07f13188b66de",
    ("multi", 100, 1): "42748c6daf5a67ca06a2c4b2449847de82125f6f139e74837be0e927d49bab9c",
    # --files 300 --tasks-per-file 5: BENCHMARKS' 1,057 single-line tasks
    ("single", 300, 5): "18692046999d9857a6f7eee788923d5b677afcbd10029b37328a2261b869c334",
}


def digest(rows) -> str:
    """rows: (doc_id, kind, prefix, middle, suffix, file) per task, in order."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(list(row)).encode())
    return h.hexdigest()


def task_rows(tasks: list[FimTask]):
    return [(t.doc_id, t.kind, t.prefix, t.middle, t.suffix, t.file) for t in tasks]


def original_python_complete() -> bool:
    """Whether the original part's Python files all read back with their listed content."""
    listed = heldout.entries("python")
    return len(listed) > 0 and len(heldout.load("python", corpus=ROOT / ".corpus")) == len(listed)


class Recorder:
    """A backend that answers every task with `answer(prefix, suffix, kind)` and records them."""

    answer = staticmethod(lambda prefix, suffix, kind: "")
    seen: list = []

    def __init__(self, *args, **kwargs):
        pass

    def fim(self, prefix, suffix, order, kind):
        Recorder.seen.append((kind, order, prefix, suffix))
        return Recorder.answer(prefix, suffix, kind)


@pytest.fixture
def recorder(monkeypatch):
    Recorder.seen = []
    Recorder.answer = staticmethod(lambda prefix, suffix, kind: "")
    monkeypatch.setattr(evaluation, "EngineBackend", Recorder)
    return Recorder


def run_main(tmp_path, *args) -> tuple[dict, list[dict]]:
    out, details = tmp_path / "eval.json", tmp_path / "details.jsonl"
    evaluation.main(
        [
            "--model",
            str(tmp_path / "model"),
            "--bpb-tokens",
            "0",
            "--json",
            str(out),
            "--details",
            str(details),
            *args,
        ]
    )
    rows = [json.loads(line) for line in details.read_text().splitlines()]
    return json.loads(out.read_text()), rows


# ---- today's tasks, pinned -------------------------------------------------------------------


@pytest.mark.skipif(
    not original_python_complete(), reason="the original held-out part is not built here"
)
def test_the_default_eval_asks_the_pinned_tasks(tmp_path, recorder, monkeypatch):
    monkeypatch.chdir(ROOT)  # the eval reads .corpus/ where it runs, as from the command line
    result, details = run_main(tmp_path, "--orders", "spm")
    assert result["heldout"] == ["heldout"] and result["files"] == 100
    assert result["files_per_language"] == {"python": 100}
    for kind in ("single", "multi"):
        asked = [(p, s) for k, _, p, s in recorder.seen if k == kind]
        rows = [d for d in details if d["kind"] == kind]
        assert len(rows) == len(asked) == 100
        got = [
            (d["task"], kind, p, d["middle"], s, d["task"].split("#")[0])
            for d, (p, s) in zip(rows, asked)
        ]
        assert digest(got) == PINNED[(kind, 100, 1)]
        assert {d["lang"] for d in rows} == {"python"}


@pytest.mark.skipif(
    not original_python_complete(), reason="the original held-out part is not built here"
)
def test_python_tasks_stay_the_same_whatever_parts_are_given():
    corpus = ROOT / ".corpus"
    for parts, languages in [
        (None, None),
        (["heldout"], ["python"]),
        ([str(corpus / "heldout.jsonl")], ["python"]),
        (["heldout", "heldout-debian"], ["python"]),
        (["heldout-debian", "heldout"], ["all"]),
    ]:
        if parts and "heldout-debian" in parts and not (corpus / "heldout-debian.jsonl").exists():
            continue
        docs = evaluation.select_docs(parts, languages, 300, False, corpus)
        python = [d for d in docs if heldout.language(d[0]) == "python"]
        assert len(python) == 212  # the part has 212 Python files: all of them
        first = python[:100]
        for kind in ("single", "multi"):
            assert digest(task_rows(make_tasks(first, kind))) == PINNED[(kind, 100, 1)]
        assert digest(task_rows(make_tasks(python, "single", 0, 5))) == PINNED[("single", 300, 5)]


# ---- parts and languages, on small made-up parts ---------------------------------------------

FILES = {
    "heldout": {
        "pypi:pkg:pkg/a.py": "def a():\n    return 1\n",
        "pypi:pkg:pkg/b.py": "def b():\n    return (\n        2\n    )\n",
        "pypi:pkg:pkg/c.py": "c = 3\n",
        "npm:mod:index.js": "function f() {\n  return 1;\n}\n",
        "npm:mod:same.js": "const same = 1;\n",
    },
    "heldout-extra": {
        "debian:golang-x-dev:usr/share/gocode/src/x/x.go": "package x\n\nfunc X() int {\n"
        "\treturn 1\n}\n",
        "debian:golang-x-dev:usr/share/gocode/src/x/y.go": "package x\n\nvar Y = 2\n",
        "debian:ruby-x:usr/lib/ruby/vendor_ruby/x.rb": "module X\n  def x\n    1\n  end\nend\n",
        "debian:node-mod:usr/share/nodejs/mod/other.js": "module.exports = {\n  a: 1,\n};\n",
        "debian:node-mod:usr/share/nodejs/mod/same.js": "const same = 1;\n",  # in both parts
    },
}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """The two made-up parts, listed in engine/train/data's way and built into tmp/.corpus."""
    data, corpus = tmp_path / "data", tmp_path / ".corpus"
    data.mkdir()
    corpus.mkdir()
    for name, files in FILES.items():
        rows = sorted(f"{sha(t)} {heldout.language(i)} {i}" for i, t in files.items())
        (data / f"{name}.txt").write_text("\n".join(rows) + "\n")
        with open(corpus / f"{name}.jsonl", "w") as f:
            for doc_id, text in files.items():
                f.write(json.dumps({"id": doc_id, "lang": heldout.language(doc_id), "text": text}))
                f.write("\n")
    monkeypatch.setattr(heldout, "DATA_DIR", data)
    monkeypatch.setattr(heldout, "HELDOUT_LIST", data / "heldout.txt")
    return corpus


def test_a_part_is_named_by_its_built_file_or_its_name(parts):
    by_file = heldout.part(parts / "heldout-extra.jsonl")
    assert by_file == heldout.part("heldout-extra", parts)
    assert by_file.listing == heldout.DATA_DIR / "heldout-extra.txt"
    with pytest.raises(ValueError, match="no held-out list"):
        heldout.part("heldout-none", parts)


def test_files_merge_in_hash_order_with_a_cap_per_language(parts):
    both = [heldout.part("heldout", parts), heldout.part("heldout-extra", parts)]
    docs = heldout.load_parts(both, corpus=parts)
    ids = [doc_id for doc_id, _ in docs]
    every = {**FILES["heldout"], **FILES["heldout-extra"]}
    assert ids == sorted(ids, key=lambda i: sha(every[i]))  # one fixed order over the parts
    assert "npm:mod:same.js" in ids  # the same content in two parts: once, from the first
    assert "debian:node-mod:usr/share/nodejs/mod/same.js" not in ids
    assert len(ids) == len(every) - 1
    # The order of the parts only says which part a file listed twice comes from.
    swapped = [doc_id for doc_id, _ in heldout.load_parts(both[::-1], corpus=parts)]
    assert swapped == [
        "debian:node-mod:usr/share/nodejs/mod/same.js" if i == "npm:mod:same.js" else i for i in ids
    ]
    capped = heldout.load_parts(both, corpus=parts, per_language=1)
    langs = [heldout.language(doc_id) for doc_id, _ in capped]
    assert sorted(langs) == ["go", "javascript", "python", "ruby"]
    assert capped == [d for d in docs if d in capped]  # the first of each language
    go = heldout.load_parts(both, {"go"}, corpus=parts)
    assert [heldout.language(doc_id) for doc_id, _ in go] == ["go", "go"]
    # The original part alone: the files load() has always given.
    for limit in (None, 1, 2):
        alone = heldout.load_parts(both[:1], {"python"}, corpus=parts, per_language=limit)
        assert alone == heldout.load("python", corpus=parts, limit=limit)


def test_changed_files_are_skipped_unless_allowed(parts):
    built = parts / "heldout-extra.jsonl"
    rows = [json.loads(line) for line in built.read_text().splitlines()]
    rows[0]["text"] += "// changed\n"
    built.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = [heldout.part("heldout-extra", parts)]
    assert rows[0]["id"] not in dict(heldout.load_parts(extra, corpus=parts))
    assert rows[0]["id"] in dict(heldout.load_parts(extra, corpus=parts, allow_changed=True))


def test_debian_files_read_from_the_unpacked_packages_without_a_built_part(parts):
    (parts / "heldout-extra.jsonl").unlink()
    doc_id = "debian:ruby-x:usr/lib/ruby/vendor_ruby/x.rb"
    path = parts / "debian" / "site" / "ruby-x" / "usr/lib/ruby/vendor_ruby/x.rb"
    path.parent.mkdir(parents=True)
    path.write_text(FILES["heldout-extra"][doc_id])
    docs = heldout.load_parts([heldout.part("heldout-extra", parts)], corpus=parts)
    assert docs == [(doc_id, FILES["heldout-extra"][doc_id])]


def test_the_report_is_per_language_and_over_all(tmp_path, parts, recorder, monkeypatch):
    monkeypatch.chdir(tmp_path)  # .corpus here is the made-up one
    # Right on every Go task (its own middle, looked up by prompt) and on nothing else.
    go_tasks = {
        (t.prefix, t.suffix): t.middle
        for t in make_tasks(
            [(i, x) for i, x in FILES["heldout-extra"].items() if i.endswith(".go")], "single"
        )
    }
    recorder.answer = staticmethod(
        lambda prefix, suffix, kind: go_tasks.get((prefix, suffix), "nothing")
    )
    result, details = run_main(
        tmp_path,
        "--heldout",
        str(parts / "heldout.jsonl"),
        "--heldout",
        "heldout-extra",
        "--kinds",
        "single",
        "--orders",
        "spm",
    )
    assert result["heldout"] == ["heldout", "heldout-extra"]
    assert result["files_per_language"] == {"go": 2, "javascript": 3, "python": 3, "ruby": 1}
    row = result["single_spm"]
    assert row["tasks"] == 9 and row["exact_match"] == round(2 / 9, 4)
    low, high = row["exact_match_ci95"]
    assert low < 2 / 9 < high
    langs = row["languages"]
    assert list(langs) == ["go", "javascript", "python", "ruby"]
    assert langs["go"]["exact_match"] == 1.0 and langs["go"]["edit_similarity"] == 1.0
    for lang in ("javascript", "python", "ruby"):
        assert langs[lang]["exact_match"] == 0.0
    for lang, r in langs.items():
        assert r["files"] == r["tasks"] == result["files_per_language"][lang]
        low, high = r["edit_similarity_ci95"]
        assert low <= r["edit_similarity"] <= high
    es = [r["edit_similarity"] * r["tasks"] for r in langs.values()]
    assert row["edit_similarity"] == pytest.approx(sum(es) / 9, abs=1e-3)
    assert {d["lang"] for d in details} == set(langs)
    assert all(d["exact"] == (d["lang"] == "go") for d in details)

    # --languages keeps those languages' tasks, and the same tasks.
    only, only_details = run_main(
        tmp_path,
        "--heldout",
        "heldout",
        "--heldout",
        "heldout-extra",
        "--languages",
        "go,ruby",
        "--kinds",
        "single",
        "--orders",
        "spm",
    )
    assert list(only["single_spm"]["languages"]) == ["go", "ruby"]
    assert only["single_spm"]["languages"]["go"] == langs["go"]
    keep = {(d["task"], d["middle"]) for d in details if d["lang"] in ("go", "ruby")}
    assert {(d["task"], d["middle"]) for d in only_details} == keep

    # --files caps each language.
    capped, _ = run_main(
        tmp_path, "--heldout", "heldout", "--heldout", "heldout-extra", "--files", "1"
    )
    assert capped["files_per_language"] == {"go": 1, "javascript": 1, "python": 1, "ruby": 1}
    assert capped["multi_psm"]["tasks"] == 4


def test_the_cpu_decode_weights_reach_the_engine_and_the_report(
    tmp_path, parts, recorder, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    built = []
    monkeypatch.setattr(recorder, "__init__", lambda self, *args: built.append(args), raising=False)
    common = ["--heldout", str(parts / "heldout.jsonl"), "--kinds", "single", "--orders", "spm"]
    result, _ = run_main(tmp_path, *common, "--cpu-decode-weights", "fp32")
    assert built[-1][-2:] == ("fp32", False) and result["cpu_decode_weights"] == "fp32"
    assert "cpu_decode_guard" not in result
    result, _ = run_main(tmp_path, *common, "--cpu-decode-guard")
    assert built[-1][-2:] == ("auto", True) and result["cpu_decode_guard"] is True
    result, _ = run_main(tmp_path, *common)  # the engine's own choice, as before: not reported
    assert built[-1][-2:] == ("auto", False) and "cpu_decode_weights" not in result


def test_the_printed_table_has_a_line_per_language_and_all(
    tmp_path, parts, recorder, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    run_main(
        tmp_path,
        "--heldout",
        "heldout",
        "--heldout",
        "heldout-extra",
        "--kinds",
        "single",
        "--orders",
        "spm",
    )
    out = capsys.readouterr().out
    head = out[: out.index("{")]
    lines = [line.split()[0] for line in head.splitlines()[2:] if line.strip()]
    assert lines == ["go", "javascript", "python", "ruby", "all"]


def test_unknown_or_absent_languages_are_refused(parts, monkeypatch):
    with pytest.raises(SystemExit, match="unknown language klingon"):
        evaluation.select_docs(["heldout"], ["klingon"], 10, False, parts)
    with pytest.raises(SystemExit, match="no held-out files in rust"):
        evaluation.select_docs(["heldout"], ["python", "rust"], 10, False, parts)
    with pytest.raises(SystemExit, match="no held-out list"):
        evaluation.select_docs(["heldout-none"], None, 10, False, parts)
    # Without --heldout: the original part's Python files.
    default = evaluation.select_docs(None, None, 10, False, parts)
    assert {heldout.language(doc_id) for doc_id, _ in default} == {"python"}


def test_bits_per_byte_per_language_add_up_to_the_whole(parts):
    from engine.train.data import load_tokenizer

    tok = load_tokenizer(TOKENIZER_DIR / "tokenizer.json")
    vocab = tok.get_vocab_size()

    class Uniform:
        def encode(self, text):
            return tok.encode(text, add_special_tokens=False).ids

        def logits(self, ids):
            return torch.zeros(len(ids), vocab)

    docs = heldout.load_parts(
        [heldout.part("heldout", parts), heldout.part("heldout-extra", parts)], corpus=parts
    )
    whole, per_lang = evaluation.bits_per_byte(Uniform(), docs, TOKENIZER_DIR, 64)
    assert sorted(per_lang) == ["go", "javascript", "python", "ruby"]
    assert min(per_lang.values()) <= whole <= max(per_lang.values())
    # Uniform guesses: log2(vocab) bits a token, so bits per byte is tokens over bytes.
    assert all(v > 0 for v in per_lang.values()) and whole > math.log2(vocab) / 8


def test_every_listed_file_has_its_listed_language():
    for listing in sorted(heldout.DATA_DIR.glob("heldout*.txt")):
        for _, lang, doc_id in heldout.entries(listing=listing):
            assert heldout.language(doc_id) == lang, (listing.name, doc_id)


# ---- where a task starts, per language -------------------------------------------------------

GO = """package main

import (
\t"fmt"
)

// Sum adds the numbers.
func Sum(xs []int) int {
\ttotal := 0
\tfor _, x := range xs {
\t\ttotal += x
\t}
\treturn total
}

func main() {
\tfmt.Println(Sum([]int{1, 2}))
}
"""

RUST = """/// Adds the numbers.
pub fn sum(xs: &[i32]) -> i32 {
    let mut total = 0;
    for x in xs {
        total += x;
    }
    total
}

#[cfg(test)]
mod tests {
    #[test]
    fn adds() {
        assert_eq!(super::sum(&[1, 2]), 3);
    }
}
"""

RUBY = """module Shapes
  class Square
    def initialize(side)
      @side = side
    end

    def area
      @side * @side
    end
  end
end
"""

C = """/*
 * Sums the numbers.
 */
#include <stddef.h>

int sum(const int *xs, size_t n)
{
    int total = 0;
    for (size_t i = 0; i < n; i++) {
        total += xs[i];
    }
    return total;
}
"""

SNIPPETS = {"x.go": GO, "x.rs": RUST, "x.rb": RUBY, "x.c": C}
CLOSERS = {"{", "}", ")", "*/", "/*", "end", "});", "};"}  # and openers alone


@pytest.mark.parametrize("name", SNIPPETS)
@pytest.mark.parametrize("kind", ["single", "multi"])
def test_tasks_start_at_code_not_at_a_closing_line(name, kind):
    text = SNIPPETS[name]
    lines = text.split("\n")
    code_lines = [i for i, line in enumerate(lines) if line.strip() not in CLOSERS | {""}]
    tasks = []
    for seed in range(40):
        tasks += make_tasks([(f"pkg:{name}", text)], kind, seed=seed, per_file=len(lines))
    firsts = set()
    for t in tasks:
        assert t.lang == heldout.language(name)
        assert t.prefix + t.middle + t.suffix == text
        assert t.prefix == "" or t.prefix.endswith(("\n", " ", "\t"))
        assert not t.middle[:1].isspace()  # its indentation stays in the prefix, tabs as spaces
        assert t.middle.split("\n")[0].strip() not in CLOSERS
        if kind == "single":
            assert "\n" not in t.middle and t.suffix[:1] in ("\n", "")
        else:
            assert t.middle.split("\n")[-1].strip()  # never ends on a blank line
        firsts.add(t.prefix.count("\n"))
    assert firsts == set(code_lines)  # every other line is a place a task can start


def test_each_language_keeps_its_own_lines():
    assert starts_task("\t}", "go") is False
    assert starts_task("    });", "javascript") is False
    assert starts_task("  end", "ruby") is False
    assert starts_task("  end)", "ruby") is False
    assert starts_task("  end_time = now", "ruby") is True
    assert starts_task("  end", "rust") is True  # a name elsewhere
    assert starts_task(" */", "c") is False
    assert starts_task(" * Sums the numbers.", "c") is True
    assert starts_task("#endif", "c") is True
    # Python and text of no known language: any non-empty line, as every earlier number.
    for lang in ("python", ""):
        assert starts_task("    )", lang) is True
        assert starts_task('    """', lang) is True
        assert starts_task("   ", lang) is False


def test_python_tasks_still_start_at_closing_lines():
    text = "x = f(\n    1,\n)\ny = [\n    2,\n]\n"
    middles = {t.middle for s in range(20) for t in make_tasks([("a.py", text)], "single", s, 6)}
    assert middles == {"x = f(", "1,", ")", "y = [", "2,", "]"}


# ---- the interval of a mean ------------------------------------------------------------------


def test_t_quantiles_known_values():
    for df, t in [(1, 12.7062), (2, 4.3027), (9, 2.2622), (29, 2.0452), (10_000, 1.9602)]:
        assert t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)


def test_mean_interval_is_the_textbook_one_with_one_task_per_file():
    rng = random.Random(3)
    scores = [rng.random() ** 2 for _ in range(200)]
    low, high = clustered_mean_interval(scores, [1] * 200)
    mean, sd = statistics.fmean(scores), statistics.stdev(scores)
    half = t_quantile(0.975, 199) * sd / math.sqrt(200)
    assert (low, high) == pytest.approx((mean - half, mean + half), abs=1e-12)
    assert clustered_mean_interval([0.5], [3]) == (0.0, 1.0)
    assert clustered_mean_interval([1.0, 1.0], [1, 1]) == (1.0, 1.0)


def test_mean_interval_counts_files_not_tasks():
    # Files whose five tasks score alike carry one file's worth of evidence.
    rng = random.Random(4)
    per_file = [rng.random() for _ in range(40)]
    clustered = clustered_mean_interval([5 * s for s in per_file], [5] * 40)
    alone = clustered_mean_interval(per_file, [1] * 40)
    assert clustered == pytest.approx(alone, rel=1e-9)
    naive = clustered_mean_interval([s for s in per_file for _ in range(5)], [1] * 200)
    assert clustered[1] - clustered[0] > 2 * (naive[1] - naive[0])
