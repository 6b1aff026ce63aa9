#!/usr/bin/env bash
# Wheels of the packages the language server needs that a GPU machine's Python 3.12 image lacks,
# into .whl/ (ignored by git) for a machine that cannot reach a package index:
#
#   bash tests/latency/gpu_wheels.sh
#   # there: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   #        && export PYTHONPATH=/tmp/site
#
# Versions are the project environment's. tree-sitter-language-pack ships ~180 grammars (20 MB);
# its wheel is cut down to the grammars wd_lsp declares (wd_lsp/languages.py), the rest of the
# package unchanged, so that the repository and the wheels travel together under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
DEST=.whl
PACKAGES=(pygls==2.1.1 lsprotocol==2025.0.0 cattrs==26.2.1 attrs==26.1.0 typing-extensions==4.16.0
          tree-sitter==0.26.1 tree-sitter-language-pack==0.13.0 tree-sitter-c-sharp==0.23.5
          tree-sitter-embedded-template==0.25.0 tree-sitter-yaml==0.7.2)

rm -rf "$DEST" && mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${PACKAGES[@]}"

"$PYTHON" - "$DEST"/tree_sitter_language_pack-*.whl <<'EOF'
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, ".")
from wd_lsp.languages import _BY_NAME  # stdlib only

keep = {lang.grammar for lang in _BY_NAME.values() if lang.grammar}
wheel = Path(sys.argv[1])
src = zipfile.ZipFile(wheel)


def wanted(name: str) -> bool:
    parts = name.split("/")
    return not (len(parts) == 3 and parts[1] == "bindings" and parts[2].split(".")[0] not in keep)


names = [n for n in src.namelist() if wanted(n)]
trimmed = wheel.with_suffix(".tmp")
with zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as out:
    for name in names:
        data = src.read(name)
        if name.endswith(".dist-info/RECORD"):  # list only the files that remain
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if wanted(line.split(b",")[0].decode()))
        out.writestr(src.getinfo(name), data)
src.close()
trimmed.replace(wheel)
print(f"{wheel.name}: kept the grammars {', '.join(sorted(keep))}")
EOF
du -sh "$DEST"
