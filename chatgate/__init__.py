"""chatgate: a streaming chat gateway (OpenAI-compatible SSE, WebSocket sessions) in front of
the in-process paged-attention engine."""

__version__ = "0.1.0"
