"""Serving: the continuous-batching engine, the OpenAI-compatible API and the CLI."""
