"""``python -m inference.serve``: an OpenAI-compatible HTTP server over the engine.

One module per job: ``config`` (the command line), ``engine`` (the served algorithm and what it needs),
``text`` (token ids to streamed text, stop strings), ``limits`` (what one request may ask), ``scheduler`` (the bounded queue and the worker thread that
runs the engine), ``metrics`` (Prometheus), ``schemas`` (request bodies, response and error JSON), ``app`` (the
FastAPI routes) and ``server`` (uvicorn, in this process or from the command line).
"""
