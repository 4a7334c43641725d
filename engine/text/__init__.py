"""Text <-> tokens: the prompt tokenizer and its chat template, tool-calling templates, incremental detokenizing."""
