"""engine.train.task_groups: a task's group by what its context shows, and exact match by group."""

from engine.train.task_groups import GROUPS, context_group, exact_by_group


def test_a_line_built_from_words_in_view_is_closed():
    prefix = "def area(width, height):\n    "
    assert context_group(prefix, "return width * height", "\n") == GROUPS[0]
    # Keywords, builtins and self count as known; numbers must be in view like names.
    assert (
        context_group(
            "class A:\n    def f(self, items):\n        ", "return len(self.items) + 1", ""
        )
        == GROUPS[1]
    )
    assert context_group("x = 1\n", "return len(x) + 1", "") == GROUPS[0]


def test_distinct_new_words_are_counted_up_to_two():
    assert context_group("a = 1\n", "b = a + b", "") == GROUPS[1]  # b twice is one new word
    assert context_group("a = 1\n", "b = c", "") == GROUPS[2]
    assert (
        context_group("", "b = c + d", "\nprint(d)\n") == GROUPS[2]
    )  # d is in the suffix, b and c are not


def test_comment_and_docstring_lines_are_their_own_group():
    for middle in ("# see below", '"""Return the sum."""', "'''x'''"):
        assert context_group("", middle, "") == GROUPS[3]


def test_exact_match_by_group_counts_only_answered_tasks():
    groups = {"a": GROUPS[0], "b": GROUPS[0], "c": GROUPS[2], "d": GROUPS[3]}
    got = exact_by_group(groups, {"a": True, "b": False, "c": True, "z": True})
    assert got == {GROUPS[0]: (1, 2), GROUPS[1]: (0, 0), GROUPS[2]: (1, 1), GROUPS[3]: (0, 0)}
