"""Running notebook cells in a live kernel and saving what they produced.

These are the orchestration cores of the ``execute`` and ``run-all`` notebook
routes.  They know notebooks (through a :class:`NotebookStore`) but not HTTP
and not how sessions work: the caller passes ``execute``, an
``async (code, timeout) -> result`` that runs code in the session's kernel and
returns the gateway's execute result (``status`` ok | error | timeout | died,
``execution_count``, ``outputs`` as nbformat v4 output dicts, ``text``,
``error``), and for run-all an optional ``restart``.

Saving never overwrites a notebook that changed meanwhile: a cell's outputs
are saved only if its source is still the code that ran, and run-all saves
only if the notebook's cells (ids and sources) are as they were at the start.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Awaitable, Callable

from kernel_gateway.errors import GatewayError, bad_request
from kernel_gateway.notebooks import NotebookStore, unknown_cell

NOTEBOOK_SESSION = "notebook:"  # the prefix of a notebook's own session id
SESSION_ID_MAX = 128  # as kernel_gateway.workspace.check_session_id allows
HASH_CHARS = 16


def notebook_session_id(path: str) -> str:
    """The notebook's own session id, one per notebook path, never shared by two paths.

    ``notebook:<path>`` when it fits; a longer one keeps its start and ends in
    ``#`` and a hash of the whole path, so two long paths with a common
    prefix never land on one kernel.
    """
    session = f"{NOTEBOOK_SESSION}{path}"
    if len(session) <= SESSION_ID_MAX:
        return session
    digest = hashlib.sha256(path.encode("utf-8", "surrogatepass")).hexdigest()[:HASH_CHARS]
    return f"{session[: SESSION_ID_MAX - HASH_CHARS - 1]}#{digest}"


Execute = Callable[[str, "float | None"], Awaitable[dict]]
Restart = Callable[[], Awaitable[None]]
# Runs the store's disk work off the loop: the routes pass the agent's share of the workers.
OffLoop = Callable[..., Awaitable[Any]]


async def run_cell(
    store: NotebookStore,
    path: str,
    cell_id: str,
    execute: Execute,
    *,
    code: str | None = None,
    save_outputs: bool = True,
    timeout: float | None = None,
    off_loop: OffLoop = asyncio.to_thread,
) -> dict:
    """Run one code cell by id; save its outputs and execution count into it.

    With ``code``, the cell's source is replaced by it first, and that is what
    runs.  Returns the execute result plus ``cell_id``, ``saved``, ``etag``
    (the notebook's ETag after the last write made here) and ``reason`` (why
    the outputs were not saved, when saving was asked for and failed).
    """
    if code is not None and not isinstance(code, str):
        raise bad_request(f"code must be a string, not {type(code).__name__}", code="invalid_source")
    notebook = await off_loop(store.contents, path)
    cell = _code_cell(notebook, cell_id, path)
    etag = notebook["etag"]
    source = cell["source"]
    if code is not None:
        etag = (await off_loop(store.replace_source, path, cell_id, code))["etag"]
        source = code

    result = await execute(source, timeout)

    saved, reason = False, None
    if save_outputs:
        try:
            etag = (
                await off_loop(
                    store.save_outputs,
                    path,
                    cell_id,
                    source,
                    result.get("outputs", []),
                    result.get("execution_count"),
                )
            )["etag"]
            saved = True
        except GatewayError as error:
            # The code has run; its result matters more than the failed save.
            reason = error.message
    return {**result, "cell_id": cell_id, "saved": saved, "etag": etag, "reason": reason}


async def run_all(
    store: NotebookStore,
    path: str,
    execute: Execute,
    restart: Restart | None = None,
    *,
    save_outputs: bool = False,
    timeout: float | None = None,
    off_loop: OffLoop = asyncio.to_thread,
) -> dict:
    """Run the notebook's code cells top to bottom, stopping at the first that is not ok.

    With ``restart``, it is awaited first (restart-run-all).  Empty cells are
    not sent to the kernel (reported as ``skipped``, saved with no outputs, as
    JupyterLab does).  With ``save_outputs``, all outputs are saved in one
    write at the end, unless the notebook's cells changed during the run.
    """
    notebook = await off_loop(store.contents, path)
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    if restart is not None:
        await restart()

    reports: list[dict] = []
    updates: list[dict] = []
    status, stopped_at = "ok", None
    for cell in code_cells:
        if not cell["source"].strip():
            result: dict[str, Any] = {"status": "skipped", "execution_count": None, "outputs": []}
        else:
            result = await execute(cell["source"], timeout)
        reports.append(
            {
                "cell_id": cell["id"],
                "status": result.get("status"),
                "execution_count": result.get("execution_count"),
                "text": result.get("text", ""),
                "error": result.get("error"),
                "artifacts": result.get("artifacts", []),
            }
        )
        updates.append(
            {
                "cell_id": cell["id"],
                "source": cell["source"],
                "outputs": result.get("outputs", []),
                "execution_count": result.get("execution_count"),
            }
        )
        if result.get("status") not in ("ok", "skipped"):
            status, stopped_at = result.get("status"), cell["id"]
            break

    saved, reason = False, None
    if save_outputs and updates:
        saved, reason = await _save_run(store, path, notebook, updates, off_loop)
    return {"status": status, "cells": reports, "stopped_at": stopped_at, "saved": saved, "reason": reason}


async def _save_run(store: NotebookStore, path: str, before: dict, updates: list[dict],
                    off_loop: "OffLoop") -> tuple[bool, str | None]:
    """Save a run's outputs if the notebook's cells are still those that ran."""
    try:
        now = await off_loop(store.contents, path)
        if _cell_sources(now) != _cell_sources(before):
            return False, (
                "the notebook's cells changed during the run (added, removed, moved or edited); "
                "outputs were not saved"
            )
        # If-Match: a change landing between this check and the write is refused too.
        await off_loop(store.save_many_outputs, path, updates, now["etag"])
        return True, None
    except GatewayError as error:
        return False, f"outputs were not saved: {error.message}"


def _cell_sources(notebook: dict) -> list[tuple[str, str, str]]:
    return [(cell["id"], cell["cell_type"], cell["source"]) for cell in notebook["cells"]]


def _code_cell(notebook: dict, cell_id: str, path: str) -> dict:
    for cell in notebook["cells"]:
        if cell["id"] == cell_id:
            if cell["cell_type"] != "code":
                raise bad_request(
                    f"cell {cell_id} is a {cell['cell_type']} cell; only code cells run",
                    code="not_a_code_cell",
                )
            return cell
    raise unknown_cell(path, cell_id)
