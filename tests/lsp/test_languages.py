"""Language detection from languageId and extension."""

import pytest

from wd_lsp.languages import PLAIN_TEXT, detect_language, get_parser


@pytest.mark.parametrize(
    "language_id, path, name",
    [
        ("python", "", "python"),
        ("", "/a/b.py", "python"),
        ("javascript", "x", "javascript"),
        ("javascriptreact", "", "javascript"),
        ("", "app.mjs", "javascript"),
        ("typescript", "", "typescript"),
        ("typescriptreact", "", "tsx"),
        ("", "C.TSX", "tsx"),
        ("go", "", "go"),
        ("", "main.rs", "rust"),
        ("c", "", "c"),
        ("", "x.h", "c"),
        ("cpp", "x.h", "cpp"),  # the client's languageId wins over the extension
        ("", "x.hpp", "cpp"),
        ("java", "", "java"),
        ("", "A.java", "java"),
        ("markdown", "README.md", "plaintext"),
        ("", "", "plaintext"),
        ("somethingnew", "a.py", "python"),  # unknown id falls back to the extension
    ],
)
def test_detect(language_id, path, name):
    assert detect_language(language_id, path).name == name


def test_plain_text_has_no_parser():
    assert get_parser(PLAIN_TEXT) is None
    assert not PLAIN_TEXT.has_parser


@pytest.mark.parametrize(
    "name", ["python", "javascript", "typescript", "tsx", "go", "rust", "c", "cpp", "java"]
)
def test_every_language_parses(name):
    lang = detect_language(name if name != "tsx" else "typescriptreact")
    tree = get_parser(lang).parse(b"x")
    assert tree.root_node is not None
