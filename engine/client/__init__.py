"""The engine's clients in the caller's process: AsyncEngine for the server, LLM for offline use. Both validate
each request once and talk to the engine core (engine/core/) through its commands and messages."""
