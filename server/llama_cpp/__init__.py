"""llama.cpp's native endpoints whose meaning maps exactly onto pagedserve's: /completion, /apply-template, /props."""
