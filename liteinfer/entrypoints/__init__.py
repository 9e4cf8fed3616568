"""User-facing front ends over `LLM` (today: the `liteinfer` command line, in `cli`).

Contract: an entry point parses what the user typed, turns it into `LLM(...)` options and `SamplingParams`,
calls `LLM.generate` / `LLM.chat`, and prints the `RequestOutput`s. It never reaches into the engine's
internals, so anything a front end can do, a Python caller of `LLM` can do too.
"""
