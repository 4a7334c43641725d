"""Speculative decoding's proposers: cheap guesses of a sequence's next tokens, verified by the target model."""
