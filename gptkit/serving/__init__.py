"""Serving a model to many users at once: engine.py (continuous batching over the KV cache; token ids in,
token ids out) and routes.py (the OpenAI-compatible HTTP API over it; text, JSON and server-sent events).
The engine knows nothing of HTTP; the routes know nothing of tensors. serve.py runs them."""
