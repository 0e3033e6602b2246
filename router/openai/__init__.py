"""OpenAI-compatible HTTP API over the router backend (``router.backend``).

    app.py        the routes: completions, chat completions, models, health, metrics
    protocol.py   request parsing and validation, response and error bodies (no I/O)
    responses.py  whole JSON responses and server-sent-event streams
    server.py     uvicorn in the router's event loop (``serve_openai``)
"""

from router.openai.app import OpenAIServer, build_openai_app
from router.openai.server import OpenAIServerHandle, serve_openai

__all__ = ["OpenAIServer", "OpenAIServerHandle", "build_openai_app", "serve_openai"]
