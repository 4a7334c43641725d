"""Load generator for any OpenAI-compatible server: the same as `pagedserve bench serve`, with the same flags.

    python -m benchmarks.serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8

(The serving overhead of one streaming client, measured against engine steps, is benchmarks/serve_overhead.py.)
"""

from __future__ import annotations

import sys

from pagedserve.server.benchmark.command import main

if __name__ == "__main__":
    sys.exit(main())
