"""The command line that runs one of pagedserve's modules in a child Python process."""

from __future__ import annotations

import sys

# -P (Python 3.11+) keeps the working directory off the child's import path: started inside a checkout, whose root
# is the package, its folders (kernels/, server/, ...) would shadow installed packages of the same names.
_SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


def module_command(module: str, *args: str) -> list[str]:
    """`python -m module args` with this interpreter, its working directory off the import path."""
    return [sys.executable, *_SAFE_PATH, "-m", module, *args]
