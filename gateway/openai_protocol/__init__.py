"""The HTTP schema: OpenAI's request bodies (``request_bodies``: what a client may send, and what it
turns into on the bus) and response bodies (``response_bodies``: responses and stream chunks).

The service messages live in ``shared.protocol``; nothing here crosses a process wall.
"""
