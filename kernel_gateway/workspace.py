"""Agent keys, session ids and the on-disk layout of an agent's workspace.

::

    <root>/<agent-key>/
    ├── SOUL.md  MISSION.md  DESIGN.md
    ├── user-files/
    ├── installed-skills/
    ├── sessions/<base64url-session-id>/     # cwd of that session's kernel
    └── jobs/<job-id>/

The agent sees these paths as they are: there is no path translation.
Everything below ``<agent-key>/`` is the agent's to change (it can replace
``sessions`` with a symlink, say), so the gateway creates directories there
only through :func:`make_dirs_nofollow`, which follows no symlink.
"""

from __future__ import annotations

import base64
import os
import re

from .errors import GatewayError, bad_request
from .fs import PathOutsideRoot, make_dirs_nofollow, open_nofollow, search_denied

AGENT_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
DOCUMENTS = ("SOUL.md", "MISSION.md", "DESIGN.md")
DIRECTORIES = ("user-files", "installed-skills", "sessions", "jobs")


def check_agent_key(agent: object) -> str:
    if not isinstance(agent, str) or not AGENT_KEY.fullmatch(agent):
        raise bad_request(
            f"invalid agent key {agent!r}",
            "1-64 characters of A-Z a-z 0-9 _ . -, not starting with '.' or '-'",
            code="invalid_agent",
        )
    return agent


def check_session_id(session: object) -> str:
    if (
        not isinstance(session, str)
        or not 1 <= len(session) <= 128
        or not session.isprintable()
    ):
        raise bad_request(
            f"invalid session id {session!r}",
            "1-128 printable characters",
            code="invalid_session",
        )
    return session


def session_dirname(session: str) -> str:
    """base64url of the UTF-8 id, no padding: any printable id becomes a safe name."""
    return base64.urlsafe_b64encode(session.encode()).decode().rstrip("=")


def agent_root(root: str, agent: str) -> str:
    return os.path.join(root, agent)


def session_dir(root: str, agent: str, session: str) -> str:
    return os.path.join(root, agent, "sessions", session_dirname(session))


def create_agent_tree(root: str, agent: str) -> bool:
    """Lay out the agent's tree; True if it was new.  Existing files are never touched."""
    top = agent_root(root, agent)
    created = not os.path.isdir(top)  # <root>/<agent> itself is the gateway's, not the agent's
    os.makedirs(top, exist_ok=True)
    for name in DIRECTORIES:
        make_dirs_in_agent_tree(top, name)
    for name in DOCUMENTS:
        try:
            # O_EXCL: never overwrite what the agent or an operator wrote (nor follow a symlink there).
            os.close(open_nofollow(top, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, keep_ours=True))
        except FileExistsError:
            pass
    return created


def make_dirs_in_agent_tree(top: str, path: str) -> None:
    """Create ``path`` (inside the agent root ``top``) following no symlink; a clear 4xx otherwise."""
    try:
        make_dirs_nofollow(top, path)
    except PathOutsideRoot as e:
        raise GatewayError(
            409, "symlink_in_workspace",
            f"cannot create {path!r} in the agent's tree: {e}",
            "the gateway follows no symlink where it creates directories; make it a real directory",
        ) from None
    except (FileExistsError, NotADirectoryError):
        raise GatewayError(
            409, "not_a_directory", f"cannot create {path!r} in the agent's tree: a part of it is a file",
            "remove or rename that file",
        ) from None


def require_enterable(root: str, agent: str, folder: str) -> None:
    """Refuse (403) a kernel's working directory that the agent's own uid cannot enter.

    The kernel runs as that uid: in a folder the agent made unreachable (``chmod 000``, on
    the folder or one above it) it dies while starting, which is the agent's doing, not a
    gateway fault.
    """
    try:
        denied = search_denied(agent_root(root, agent), folder)
    except (PathOutsideRoot, OSError):
        return  # not beneath the root, or gone: the sandbox resolves it as the agent
    if denied is not None:
        raise GatewayError(
            403, "folder_not_accessible",
            f"the agent cannot enter {denied!r} (its mode lacks the search permission), so no kernel can start there",
            f"give it back (chmod u+x {denied}), or start the kernel in another folder",
        )


def make_session_dir(root: str, agent: str, session: str) -> str:
    """Create the session's directory, never through a symlink; return its path."""
    make_dirs_in_agent_tree(agent_root(root, agent), os.path.join("sessions", session_dirname(session)))
    return session_dir(root, agent, session)
