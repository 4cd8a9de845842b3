"""``python <this folder> ARGS``: torchrun, quiet when a signal ends it (:mod:`._quiet`).

Run from its path, with nothing of evendp on ``sys.path``: the folder itself is, so
``_quiet`` (which loads ``_nodes`` beside it) imports as a top-level module.
"""

import sys

from _quiet import main  # type: ignore[import-not-found]

sys.exit(main(sys.argv[1:]))
