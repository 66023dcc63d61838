"""JupyterLab inside the ``lab`` sandbox: ``python -m kernel_gateway.lab.server [LabApp options]``.

The host side (:mod:`.command`) starts this as the agent's uid with no
network; it writes the browser token as the first line of stdin, so the
secret is never in an argv or an environment that ``ps`` shows on the host.
Before JupyterLab starts, every tornado client of the process is made to
reach the gateway through the agent's socket (:mod:`.resolver`).
"""

from __future__ import annotations

import logging
import os
import sys

from . import resolver


class _UntrustedNotebook(logging.Filter):
    """Drop jupyter_server's "Notebook X is not trusted", logged on every load and save of a notebook.

    A notebook the agent wrote is never signed by this Lab's notary, so it is
    untrusted by design: Lab shows its HTML and JavaScript outputs sanitized,
    and the analyst's browser runs no script the agent put there.  That is
    what the README says; a warning per load of each notebook says nothing more.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Notebook %s is not trusted"


def upstream_workarounds() -> None:
    """Three messages of JupyterLab's own packages that are no fault of the user, each fixed at its source."""
    # The kernelspec logo comes from the gateway, not a file: jupyter_server's resource handler (a
    # StaticFileHandler) still computes an etag from a file of that name, and logs "Could not open
    # static file 'logo-svg.svg'" as an error while serving it.  No file: no etag.
    from jupyter_server.kernelspecs.handlers import KernelSpecResourceHandler

    KernelSpecResourceHandler.compute_etag = lambda self: None
    # jupyter_server_ydoc stops its collaboration websocket server at shutdown even when no browser
    # ever opened a document, so it never started: "WebsocketServer not running" as a traceback.
    try:
        from jupyter_server_ydoc.websocketserver import JupyterWebsocketServer
    except ImportError:  # no jupyter-collaboration: nothing to fix
        pass
    else:
        clean = JupyterWebsocketServer.clean

        async def clean_if_started(self) -> None:
            started = getattr(self, "started", None)
            if started is None or started.is_set():
                await clean(self)

        JupyterWebsocketServer.clean = clean_if_started
    logging.getLogger("ServerApp").addFilter(_UntrustedNotebook())


def main(argv: list[str] | None = None) -> None:
    token = sys.stdin.readline().strip()
    if not token:
        sys.exit("kernel_gateway.lab.server: no token on stdin")
    os.environ["JUPYTER_TOKEN"] = token  # jupyter_server's IdentityProvider reads it
    resolver.install()
    upstream_workarounds()
    from jupyterlab.labapp import LabApp

    LabApp.launch_instance(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
