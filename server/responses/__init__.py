"""/v1/responses."""
