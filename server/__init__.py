"""The OpenAI-compatible server launcher (vLLM's own app with the retro plugin active)."""
