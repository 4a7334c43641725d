"""The engine core: the step loop (LLMEngine), the commands and messages it serves, and the thread or process it
runs in. It drives the scheduler (engine/scheduling/) and reaches the model only through engine/worker/'s face."""
