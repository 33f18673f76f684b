"""The OpenAI-compatible HTTP front door: turns HTTP requests into bus messages and replies back."""
