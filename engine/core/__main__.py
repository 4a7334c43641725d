"""`python -m pagedserve.engine.core FD`: an engine core process (started by ProcessCore, not by hand)."""

import sys

from pagedserve.engine.core.process import serve_child

serve_child(int(sys.argv[1]))
