"""/v1/completions."""
