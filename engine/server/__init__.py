"""The OpenAI-compatible HTTP server: FastAPI app, async engine loop, traffic clusters, admission, metrics.

Layers point one way: app/admin (HTTP) -> async_engine (one thread drives the engine) -> LLMEngine.
`metrics` is the only module that imports prometheus_client.
"""
