"""`python -m wd_lsp.bench`: the same as `wd-lsp bench`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
