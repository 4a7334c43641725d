"""Structured output in the step: grammars compiled from a request's StructuredOutput, batched token masks,
and jump-forward for tokens a constraint forces."""
