import json
import math

import pytest

from engine.train.compare import compare, load_details, main, mcnemar_exact


def test_mcnemar_exact_matches_the_binomial_tail():
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(5, 5) == 1.0  # balanced: no evidence either way
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)  # 2 * P(X <= 0), X ~ Bin(6, 1/2)
    assert mcnemar_exact(33, 43) == mcnemar_exact(43, 33)
    by_hand = 2 * sum(math.comb(76, i) for i in range(34)) / 2**76
    assert mcnemar_exact(33, 43) == pytest.approx(by_hand)
    assert 0.29 < by_hand < 0.31


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compare_counts_discordant_tasks_and_scores(tmp_path, capsys):
    def row(task, middle, pred):
        return {
            "kind": "single",
            "order": "spm",
            "task": task,
            "middle": middle,
            "pred": pred,
            "exact": pred.rstrip() == middle.rstrip(),
        }

    old = [
        row("a", "x = 1", "x = 1"),
        row("b", "y = 2", "y = 3"),
        row("c", "z", ""),
        row("d", "q", "q"),
    ]
    new = [
        row("a", "x = 1", "x = 1"),
        row("b", "y = 2", "y = 2"),
        row("c", "z", "z"),
        row("e", "w", "w"),
    ]
    _write(tmp_path / "old.jsonl", old)
    _write(tmp_path / "new.jsonl", new)
    result = compare(load_details(tmp_path / "old.jsonl"), load_details(tmp_path / "new.jsonl"))
    assert result["tasks"] == 3 and result["only_in_one_file"] == 2  # d and e are not shared
    assert (result["both_exact"], result["only_old_exact"], result["only_new_exact"]) == (1, 0, 2)
    assert result["old"]["exact_match"] == round(1 / 3, 4) and result["new"]["exact_match"] == 1.0
    assert result["old"]["empty"] == 1 and result["new"]["empty"] == 0
    assert result["mcnemar_p"] == 0.5
    main([str(tmp_path / "old.jsonl"), str(tmp_path / "new.jsonl")])
    assert json.loads(capsys.readouterr().out)["only_new_exact"] == 2


def test_compare_refuses_files_without_shared_tasks(tmp_path):
    _write(
        tmp_path / "a.jsonl",
        [{"kind": "single", "order": "spm", "task": "a", "middle": "", "pred": "", "exact": True}],
    )
    _write(
        tmp_path / "b.jsonl",
        [{"kind": "single", "order": "spm", "task": "b", "middle": "", "pred": "", "exact": True}],
    )
    with pytest.raises(SystemExit):
        compare(load_details(tmp_path / "a.jsonl"), load_details(tmp_path / "b.jsonl"))


def test_compare_tests_each_language_on_its_own(tmp_path):
    """A retrain that wins in one language and loses in another: the pooled counts cancel, the
    per-language tests show both."""

    def row(task, lang, exact):
        pred = "x" if exact else "y"
        return {
            "kind": "single",
            "order": "spm",
            "task": task,
            "lang": lang,
            "middle": "x",
            "pred": pred,
            "exact": exact,
        }

    old = [row(f"py{i}", "python", False) for i in range(8)]
    old += [row(f"go{i}", "go", True) for i in range(8)]
    new = [row(f"py{i}", "python", True) for i in range(8)]
    new += [row(f"go{i}", "go", False) for i in range(8)]
    _write(tmp_path / "old.jsonl", old)
    _write(tmp_path / "new.jsonl", new)
    result = compare(load_details(tmp_path / "old.jsonl"), load_details(tmp_path / "new.jsonl"))
    assert result["mcnemar_p"] == 1.0 and result["tasks"] == 16
    python, go = result["languages"]["python"], result["languages"]["go"]
    assert (python["only_new_exact"], python["only_old_exact"]) == (8, 0)
    assert (go["only_new_exact"], go["only_old_exact"]) == (0, 8)
    assert python["mcnemar_p"] == go["mcnemar_p"] == round(mcnemar_exact(0, 8), 4) < 0.01
    assert python["new"]["exact_match"] == 1.0 and go["new"]["exact_match"] == 0.0


def test_compare_of_one_language_has_no_split(tmp_path):
    rows = [
        {
            "kind": "single",
            "order": "spm",
            "task": "a",
            "lang": "python",
            "middle": "x",
            "pred": "x",
            "exact": True,
        }
    ]
    _write(tmp_path / "a.jsonl", rows)
    assert "languages" not in compare(
        load_details(tmp_path / "a.jsonl"), load_details(tmp_path / "a.jsonl")
    )
