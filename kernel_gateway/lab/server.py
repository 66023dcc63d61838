"""JupyterLab inside the ``lab`` sandbox: ``python -m kernel_gateway.lab.server [LabApp options]``.

The host side (:mod:`.command`) starts this as the agent's uid with no
network; it writes the browser token as the first line of stdin, so the
secret is never in an argv or an environment that ``ps`` shows on the host.
Before JupyterLab starts, every tornado client of the process is made to
reach the gateway through the agent's socket (:mod:`.resolver`).
"""

from __future__ import annotations

import os
import sys

from . import resolver


def main(argv: list[str] | None = None) -> None:
    token = sys.stdin.readline().strip()
    if not token:
        sys.exit("kernel_gateway.lab.server: no token on stdin")
    os.environ["JUPYTER_TOKEN"] = token  # jupyter_server's IdentityProvider reads it
    resolver.install()
    from jupyterlab.labapp import LabApp

    LabApp.launch_instance(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
