"""The browser playground: a single page served from package data (`static/`), no build step.

It talks to the same public routes every client uses (/v1/models, /v1/chat/completions,
/stats, /health); the Python side only serves files with strict headers (`resource`).
"""
