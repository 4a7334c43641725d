"""`python -m pagedserve.engine`: prepares the embedded default model (reads its GGUF file's config, tokenizer and
tensor index once, a few MB beside the file's own cache) and prints its folder."""

import logging

from pagedserve.engine.worker import embedded_gguf_path, gguf_model_dir

logging.basicConfig(level=logging.INFO, format="%(message)s")
print(gguf_model_dir(embedded_gguf_path()))
