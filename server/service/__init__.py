"""The service's own endpoints: models, probes, version, tokenize, metrics, cache reset."""
