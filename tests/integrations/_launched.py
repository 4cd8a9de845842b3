"""The one ``evendp launch`` the integration tests share (2 gloo ranks, ``--batch-sizes 1,3``).

Usage: evendp launch --nproc 2 --batch-sizes 1,3 tests/integrations/_launched.py OUT_DIR HANG_S
One gloo group for everything (the frameworks find it started): the Lightning checks of
_lightning_script.py (the first with loaders built before the group, as Lightning's
transformer.py builds them in main()), then the four ports of examples/ (_ports_script.py).
"""

from __future__ import annotations

import faulthandler
import sys
from pathlib import Path

import evendp
from tests.integrations import _lightning_script, _ports_script

if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)  # a hang: stacks, exit 1
    out = Path(sys.argv[1])
    # Lightning's transformer.py builds its loaders in main(), before any process group.
    loaders = _lightning_script.transformer_loaders()
    evendp.init_distributed("gloo")
    _lightning_script.main_transformer(out, loaders)
    _lightning_script.main(out)
    for port in _ports_script.PORTS:
        _ports_script.run(port, out)
    evendp.finish_distributed()
