"""The eval's task sampling and its confidence interval."""

import random

import pytest

from engine.train.fim_tasks import make_tasks
from engine.train.metrics import clustered_interval, wilson_interval

DOCS = [
    (
        f"doc{d}",
        "".join(
            f"{'    ' * (i % 3)}value_{d}_{i} = compute({i}, {d})\n" + ("\n" if i % 4 == 0 else "")
            for i in range(20 + d)
        ),
    )
    for d in range(6)
]


@pytest.mark.parametrize("kind", ["single", "multi"])
def test_more_tasks_per_file_keep_the_first_and_take_distinct_lines(kind):
    one = make_tasks(DOCS, kind, seed=5)
    four = make_tasks(DOCS, kind, seed=5, per_file=4)
    assert len(one) == len(DOCS) and len(four) == 4 * len(DOCS)
    assert four[::4] == one  # the first task of each file does not depend on per_file
    for d, (doc_id, text) in enumerate(DOCS):
        tasks = four[4 * d : 4 * d + 4]
        assert [t.doc_id for t in tasks] == [doc_id, f"{doc_id}#1", f"{doc_id}#2", f"{doc_id}#3"]
        starts = {
            len(t.prefix) for t in tasks
        }  # short files: nothing trimmed, so this is the position
        assert len(starts) == 4
        for t in tasks:
            assert t.prefix + t.middle + t.suffix == text and t.middle.strip()


def test_context_budgets_trim_at_line_boundaries_and_keep_the_tasks():
    long_docs = [(doc_id, text * 40) for doc_id, text in DOCS]
    short = make_tasks(long_docs, "single", seed=3, per_file=3, prefix_chars=300, suffix_chars=200)
    wide = make_tasks(long_docs, "single", seed=3, per_file=3, prefix_chars=5000, suffix_chars=3000)
    assert [(t.doc_id, t.middle) for t in short] == [
        (t.doc_id, t.middle) for t in wide
    ]  # same lines
    for s, w in zip(short, wide):
        assert len(s.prefix) <= 300 and len(s.suffix) <= 200
        assert w.prefix.endswith(s.prefix) and w.suffix.startswith(s.suffix)
        assert (
            s.prefix == "" or w.prefix[len(w.prefix) - len(s.prefix) - 1] == "\n"
        )  # cut at a line start
        assert s.suffix == w.suffix or s.suffix.endswith("\n")  # cut after a line's end
    assert sum(len(w.prefix) > 300 for w in wide) > len(wide) // 2


def test_a_file_gives_at_most_its_non_empty_lines():
    tasks = make_tasks([("tiny", "a = 1\n\nb = 2\n")], "single", per_file=5)
    assert sorted(t.middle for t in tasks) == ["a = 1", "b = 2"]


def test_wilson_interval_known_values_and_shape():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 2000)
        hits = rng.randint(0, n)
        low, high = wilson_interval(hits, n)
        assert 0.0 <= low <= hits / n <= high <= 1.0
        wide = wilson_interval(hits, n)
        narrow = wilson_interval(4 * hits, 4 * n)
        assert narrow[1] - narrow[0] < wide[1] - wide[0]


def test_clustered_interval_counts_files_not_tasks():
    # Files that are all hit or all missed: five tasks a file carry one file's worth of evidence.
    files = 40
    hits = [5 if i % 4 == 0 else 0 for i in range(files)]
    low, high = clustered_interval(hits, [5] * files)
    q = 10 / 40
    assert (low, high) == pytest.approx(wilson_interval(q * (files - 1), files - 1), abs=1e-9)
    naive = wilson_interval(sum(hits), 5 * files)
    assert high - low > 2 * (naive[1] - naive[0])
    # Independent-looking files: about Wilson on all the tasks, never narrower.
    rng = random.Random(1)
    hits = [sum(rng.random() < 0.2 for _ in range(5)) for _ in range(400)]
    c, w = clustered_interval(hits, [5] * 400), wilson_interval(sum(hits), 2000)
    assert c[1] - c[0] >= w[1] - w[0] - 1e-12
    assert c == pytest.approx(w, abs=0.01)
    assert clustered_interval([0, 0], [3, 2]) == wilson_interval(0, 5)
