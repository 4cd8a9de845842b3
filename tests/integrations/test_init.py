"""Importing evendp.integrations imports none of the libraries it adapts."""

from __future__ import annotations

import subprocess
import sys


def test_package_import_leaves_the_libraries_unimported() -> None:
    code = (
        "import sys, evendp.integrations; "
        "heavy = {'transformers', 'accelerate', 'lightning'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
