"""/tokenize, /detokenize and /tokenizer_info: vLLM's and llama.cpp's forms."""
