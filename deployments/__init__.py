"""Thin Ray Serve layer: the gateway, the engine pools and the app builder (see app.py)."""
