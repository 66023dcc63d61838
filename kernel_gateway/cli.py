"""The ``kernel-gateway`` command: serve, token, lab, doctor, install-kernelspec."""

from __future__ import annotations

import json
import os
import sys

import logging

from traitlets import Enum, TraitError, Unicode, default
from traitlets.config import Application

from . import __version__
from .settings import Gateway

USAGE = """usage: kernel-gateway COMMAND [options]

commands:
  serve                 run the gateway in the foreground
                        (--root DIR --state-dir DIR --socket PATH --config FILE,
                        --log-level LEVEL, --log-format text|json,
                        any --Gateway.<option>=VALUE; `serve --help-all` lists them)
                        (--jupyter-port PORT: the Jupyter API on 127.0.0.1, default 8890,
                        0 = a free port; --no-jupyter turns it off)
  token AGENT           mint a Jupyter API token for AGENT; print the agent's base URL and the token
                        (--socket PATH or --state-dir DIR of the running gateway)
  lab AGENT             run JupyterLab for AGENT in a sandbox: its files, its live kernels
                        (--port PORT on 127.0.0.1, default 8888, 0 = a free port;
                        --socket PATH or --state-dir DIR of the running gateway; the `lab` extra)
  doctor                check that sandboxed kernels can run on this machine
  install-kernelspec    install the sandboxed Python kernel for JupyterLab / jupyter_client
                        (--user, --prefix DIR, --name NAME)
  --version             print the version
"""


class ServeApp(Application):
    """Run the sandboxed live-kernel gateway."""

    name = "kernel-gateway serve"
    description = "Run the sandboxed live-kernel gateway on a Unix socket."
    version = __version__
    classes = [Gateway]
    config_file = Unicode("", config=True, help="A config file (.py or .json) to load.")
    log_style = Enum(  # (log_format is taken: the Application's own format string)
        ["text", "json"], "text", config=True, help="The operator's log on stderr: plain text, or JSON lines."
    )

    @default("log_level")
    def _default_log_level(self) -> int:
        return logging.INFO  # one line per request and per kernel event
    aliases = {
        "root": "Gateway.root",
        "state-dir": "Gateway.state_dir",
        "socket": "Gateway.socket",
        "bwrap": "Gateway.bwrap",
        "config": "ServeApp.config_file",
        "log-level": "Application.log_level",
        "log-format": "ServeApp.log_style",
        "jupyter-port": "Gateway.jupyter_port",
    }
    flags = {
        "demo": ({"Gateway": {"demo_agent": "demo"}}, "Create the agent 'demo' at start."),
        "no-jupyter": ({"Gateway": {"jupyter": False}}, "Do not serve the Jupyter API on a TCP port."),
    }

    def start(self) -> None:
        from . import logs
        from .server.app import serve

        if self.config_file:
            path = os.path.abspath(self.config_file)
            if not os.path.isfile(path):
                self.exit(f"kernel-gateway: no config file {path}")
            self.load_config_file(os.path.basename(path), path=os.path.dirname(path))
            # Flags win over the file, as in every Jupyter application.
            self.update_config(self.cli_config)
        logs.configure(self.log_level, self.log_style)
        self.exit(serve(Gateway(parent=self)))


def install_kernelspec(argv: list[str]) -> int:
    import argparse
    import tempfile

    from jupyter_client.kernelspec import KernelSpecManager

    from .kernels import copy_logos
    from .provisioner import kernelspec_dict

    parser = argparse.ArgumentParser(prog="kernel-gateway install-kernelspec")
    parser.add_argument("--user", action="store_true", help="install for this user only")
    parser.add_argument("--prefix", help="install under this prefix (e.g. a virtualenv)")
    parser.add_argument("--name", default="python3-sandboxed", help="kernelspec name")
    parser.add_argument("--agent-root", default="", help="the tree kernels may write (default: their cwd)")
    args = parser.parse_args(argv)
    config = {"agent_root": os.path.abspath(args.agent_root)} if args.agent_root else {}
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "kernel.json"), "w") as f:
            json.dump(kernelspec_dict(config=config), f, indent=1)
        copy_logos(tmp)
        where = KernelSpecManager().install_kernel_spec(
            tmp, kernel_name=args.name, user=args.user, prefix=args.prefix
        )
    print(f"installed kernelspec {args.name!r} in {where}")
    return 0


def token(argv: list[str]) -> int:
    """Mint a token over the control socket of the running gateway."""
    import argparse

    from .client import UnixHTTPConnection

    parser = argparse.ArgumentParser(prog="kernel-gateway token", description="Mint a Jupyter API token.")
    parser.add_argument("agent")
    parser.add_argument("--socket", help="the control socket (default: <state-dir>/control.sock)")
    parser.add_argument("--state-dir", default="var/state", help="the gateway's state directory")
    args = parser.parse_args(argv)
    socket_path = args.socket or os.path.join(args.state_dir, "control.sock")
    try:
        conn = UnixHTTPConnection(socket_path, timeout=30)
        conn.request("POST", f"/v1/agents/{args.agent}/tokens", body=b"{}")
        response = conn.getresponse()
        body = json.loads(response.read() or b"{}")
    except (OSError, ValueError) as e:
        print(f"kernel-gateway token: no gateway answers on {socket_path}: {e}", file=sys.stderr)
        return 1
    if response.status != 201:
        error = body.get("error", {})
        print(f"kernel-gateway token: {error.get('message', response.status)}", file=sys.stderr)
        if error.get("hint"):
            print(f"  {error['hint']}", file=sys.stderr)
        return 1
    print(f"url:   {body['url'] or '(the Jupyter API is off: serve without --no-jupyter)'}")
    print(f"token: {body['token']}")
    print(f"id:    {body['id']}")
    if body["url"]:
        print(f"open:  {body['url']}api/kernels?token={body['token']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("--version", "version"):
        print(__version__)
        return 0
    if command == "serve":
        try:
            ServeApp.launch_instance(rest)
        except TraitError as e:
            print(f"kernel-gateway serve: bad option: {e}", file=sys.stderr)
            return 2
        return 0
    if command == "token":
        return token(rest)
    if command == "lab":
        from .lab.command import main as lab_main

        return lab_main(rest)
    if command == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(rest)
    if command == "install-kernelspec":
        return install_kernelspec(rest)
    print(f"kernel-gateway: unknown command {command!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
