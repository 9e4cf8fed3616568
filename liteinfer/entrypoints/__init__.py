"""User-facing front ends over `LLM` and `AsyncLLM`: the `liteinfer` command line (`cli`) and the
OpenAI-compatible HTTP server (`openai`, run by `liteinfer serve`).

Contract: an entry point parses what the user typed, turns it into engine options and `SamplingParams`, calls
`LLM.generate` / `LLM.chat` or `AsyncLLM.submit`, and presents the outputs. It never reaches into the engine's
internals, so anything a front end can do, a Python caller of `LLM` / `AsyncLLM` can do too.
"""
