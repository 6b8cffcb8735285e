"""OpenAI-compatible HTTP server (`phaselab serve`, docs/server.md).

    app.py           routes, lifecycle, drain on SIGTERM
    edge.py          the edge middleware: arrival stamp, API key, body size, admission at arrival
    options.py       ServerConfig: the HTTP layer's options
    serving.py       OpenAI request -> engine requests (parse, tokenize, check, n fan-out)
    responses.py     engine deltas -> JSON / SSE; delivery stamps
    engine_thread.py the engine loop on its own thread, fed through thread-safe queues
    openai_protocol.py pydantic request/response bodies
    api_errors.py    OpenAI-shaped errors
"""
