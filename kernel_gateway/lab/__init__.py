"""``kernel-gateway lab AGENT``: a real JupyterLab paired with one agent's live kernels.

Two halves, on either side of a sandbox wall:

- host side (:mod:`.command`, :mod:`.forwarder`): asks the running gateway
  for the agent, starts JupyterLab in the ``lab`` sandbox profile as the
  agent's host uid, and exposes its Unix socket on ``127.0.0.1:PORT``;
- inside the sandbox (:mod:`.server`, :mod:`.resolver`, :mod:`.managers`):
  JupyterLab in gateway mode, reaching the gateway only through the agent's
  own socket, with a session manager that pairs a notebook with the agent's
  kernel for that notebook.

This package imports nothing heavy at the top: the sandbox side imports
jupyter_server, the host side only what it needs to launch.
"""
