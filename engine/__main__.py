"""`python -m engine`: prepares the embedded default model (converts its GGUF once) and prints its folder."""

import logging

from pagedserve.engine.loader import embedded_gguf_path, materialize_gguf

logging.basicConfig(level=logging.INFO, format="%(message)s")
print(materialize_gguf(embedded_gguf_path()))
