"""The Jupyter Server API per agent, as plain Python: tokens, kernelspecs, kernels, sessions, contents.

Nothing here imports Tornado; ``server/jupyter_routes.py`` and
``server/jupyter_channels.py`` are the thin HTTP and websocket layers over it.
"""
