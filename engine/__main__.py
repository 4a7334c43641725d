"""`python -m engine`: prepares the embedded default model (converts its GGUF once, saves its quantized
blocks) and prints its folder."""

import logging

from pagedserve.engine.worker import embedded_gguf_path, materialize_gguf, save_blocks_once

logging.basicConfig(level=logging.INFO, format="%(message)s")
model_dir = materialize_gguf(embedded_gguf_path())
save_blocks_once(model_dir)
print(model_dir)
