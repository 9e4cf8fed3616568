"""The OpenAI-compatible HTTP server (`liteinfer serve`): FastAPI + uvicorn over one `AsyncLLM`.

Contract: `server.build_app(llm, model_name, api_key, tool_call_parser)` is the ASGI app; its lifespan runs `llm`'s
engine loop. `protocol` holds the wire format as pydantic models, `metrics` the Prometheus metrics, `tool_parsers`
how each model family writes tool calls (for tool_choice "auto"). A request is validated
whole before anything is queued; every client error comes back in OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`) with a 4xx status, overload as 503, and no failure of one
request takes the server down. A client that disconnects aborts its requests.
"""
