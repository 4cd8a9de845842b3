"""``python <this folder> ARGS``: torchrun via :mod:`._quiet`, imported as a top-level module
(the folder, not evendp, is on ``sys.path``)."""

import sys

from _quiet import main  # type: ignore[import-not-found]

sys.exit(main(sys.argv[1:]))
