"""Running notebook cells in a real ipykernel and saving the outputs into the .ipynb.

One kernel (started through plain jupyter_client) serves the module; its
``execute`` adapter collects iopub outputs as nbformat v4 outputs.  A fake
``execute`` is used only for orchestration edge cases, where the point is what
run_all does with a given status, not what a kernel does.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import AsyncKernelManager

from kernel_gateway.errors import GatewayError
from kernel_gateway.notebook_runs import run_all, run_cell
from kernel_gateway.notebooks import NotebookStore


class LiveKernel:
    """A python3 kernel and an ``execute`` that returns the gateway's result shape."""

    def __init__(self, loop: asyncio.AbstractEventLoop, km: AsyncKernelManager):
        self.loop, self.km = loop, km
        self.kc = km.client()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    async def execute(self, code: str, timeout: float | None) -> dict:
        outputs: list[dict] = []

        def collect(msg: dict) -> None:
            if msg["msg_type"] in ("stream", "display_data", "execute_result", "error"):
                outputs.append(nbformat.v4.output_from_msg(msg))

        reply = await self.kc.execute_interactive(code, timeout=timeout or 60, output_hook=collect, allow_stdin=False)
        content = reply["content"]
        text = "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs)
        error = f"{content['ename']}: {content['evalue']}" if content["status"] == "error" else None
        return {
            "status": content["status"],
            "execution_count": content.get("execution_count"),
            "outputs": outputs,
            "text": text,
            "error": error,
        }

    async def restart(self) -> None:
        await self.km.restart_kernel(now=True)
        await self.kc.wait_for_ready(timeout=60)

    def value(self, expression: str):
        """A JSON-able expression evaluated in the kernel (a real, history-free execute)."""
        result = self.run(self.execute(f"import json as _j; print(_j.dumps({expression}))", 30))
        assert result["status"] == "ok", result["error"]
        return json.loads(result["text"])


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    loop = asyncio.new_event_loop()
    km = AsyncKernelManager(kernel_name="python3")
    loop.run_until_complete(km.start_kernel(cwd=str(tmp_path_factory.mktemp("kernel-cwd"))))
    live = LiveKernel(loop, km)
    live.kc.start_channels()
    try:
        live.run(live.kc.wait_for_ready(timeout=60))
        yield live
    finally:
        live.kc.stop_channels()
        loop.run_until_complete(km.shutdown_kernel(now=True))
        loop.close()


@pytest.fixture
def store(tmp_path: Path) -> NotebookStore:
    return NotebookStore(tmp_path)


def make_notebook(store: NotebookStore, *cells: tuple[str, str]) -> list[str]:
    """Write work.ipynb with these (cell_type, source) cells; return their ids."""
    store.put("work.ipynb", {"cells": [{"cell_type": kind, "source": source} for kind, source in cells]})
    return [cell["id"] for cell in store.contents("work.ipynb")["cells"]]


def saved_notebook(store: NotebookStore) -> nbformat.NotebookNode:
    nb = nbformat.read(store.agent_root / "work.ipynb", as_version=nbformat.NO_CONVERT)
    nbformat.validate(nb)
    return nb


def test_run_cell_by_id_saves_outputs_and_count_into_the_file(kernel, store):
    title, setup, show = make_notebook(
        store, ("markdown", "# Demo"), ("code", "x = 21\nprint('set x')"), ("code", "x * 2")
    )
    first = kernel.run(run_cell(store, "work.ipynb", setup, kernel.execute))
    assert (first["status"], first["saved"], first["cell_id"]) == ("ok", True, setup)
    second = kernel.run(run_cell(store, "work.ipynb", show, kernel.execute))
    assert second["status"] == "ok" and second["text"] == "42"
    assert second["execution_count"] == first["execution_count"] + 1

    nb = saved_notebook(store)  # what JupyterLab opens
    assert nb.cells[1].execution_count == first["execution_count"]
    assert nb.cells[1].outputs == [{"output_type": "stream", "name": "stdout", "text": "set x\n"}]
    assert nb.cells[2].execution_count == second["execution_count"]
    assert nb.cells[2].outputs[0]["output_type"] == "execute_result"
    assert nb.cells[2].outputs[0]["data"]["text/plain"] == "42"
    assert second["etag"] == store.contents("work.ipynb")["etag"]


def test_run_cell_with_code_replaces_the_source_first(kernel, store):
    (cell,) = make_notebook(store, ("code", "old = 1"))
    result = kernel.run(run_cell(store, "work.ipynb", cell, kernel.execute, code="print('new')"))
    assert result["saved"] and result["text"] == "new\n"
    saved = saved_notebook(store).cells[0]
    assert saved.source == "print('new')"
    assert saved.outputs[0]["text"] == "new\n"


def test_run_cell_error_is_saved_as_an_error_output(kernel, store):
    (cell,) = make_notebook(store, ("code", "1 / 0"))
    result = kernel.run(run_cell(store, "work.ipynb", cell, kernel.execute))
    assert result["status"] == "error" and result["error"].startswith("ZeroDivisionError")
    output = saved_notebook(store).cells[0].outputs[0]
    assert (output["output_type"], output["ename"]) == ("error", "ZeroDivisionError")


def test_run_cell_without_saving_leaves_the_file_alone(kernel, store):
    (cell,) = make_notebook(store, ("code", "print('not saved')"))
    before = (store.agent_root / "work.ipynb").read_bytes()
    result = kernel.run(run_cell(store, "work.ipynb", cell, kernel.execute, save_outputs=False))
    assert (result["status"], result["saved"], result["text"]) == ("ok", False, "not saved\n")
    assert (store.agent_root / "work.ipynb").read_bytes() == before


def test_cell_edited_during_its_run_keeps_the_edit_and_gets_no_outputs(kernel, store):
    (cell,) = make_notebook(store, ("code", "print('original')"))

    async def analyst_edits_meanwhile(code: str, timeout: float | None) -> dict:
        result = await kernel.execute(code, timeout)
        store.replace_source("work.ipynb", cell, "print('edited in JupyterLab')")
        return result

    result = kernel.run(run_cell(store, "work.ipynb", cell, analyst_edits_meanwhile))
    assert result["status"] == "ok" and result["saved"] is False
    assert "changed since it was run" in result["reason"]
    saved = saved_notebook(store).cells[0]
    assert (saved.source, saved.outputs, saved.execution_count) == ("print('edited in JupyterLab')", [], None)


def test_run_cell_refusals_run_nothing_and_change_nothing(kernel, store):
    title, cell = make_notebook(store, ("markdown", "# t"), ("code", "ran = True"))
    path = store.agent_root / "work.ipynb"
    before = path.read_bytes()
    count = kernel.value("get_ipython().execution_count")
    for cell_id, code, status, error_code in [
        ("nope", None, 404, "unknown_cell"),
        (title, None, 400, "not_a_code_cell"),
        (cell, 42, 400, "invalid_source"),
    ]:
        with pytest.raises(GatewayError) as caught:
            kernel.run(run_cell(store, "work.ipynb", cell_id, kernel.execute, code=code))
        assert (caught.value.status, caught.value.code) == (status, error_code)
    with pytest.raises(GatewayError) as caught:
        kernel.run(run_cell(store, "../work.ipynb", cell, kernel.execute))
    assert caught.value.code == "outside_workspace"
    assert path.read_bytes() == before
    # One more than before: only the value() probe itself ran.
    assert kernel.value("get_ipython().execution_count") == count + 1
    assert kernel.value("'ran' in globals()") is False


def test_run_all_stops_at_the_first_error(kernel, store):
    ids = make_notebook(
        store,
        ("code", "a = 1"),
        ("markdown", "between"),
        ("code", "print(a + 1)"),
        ("code", "raise ValueError('boom')"),
        ("code", "never_ran = True"),
    )
    before = (store.agent_root / "work.ipynb").read_bytes()
    report = kernel.run(run_all(store, "work.ipynb", kernel.execute))
    assert report["status"] == "error"
    assert report["stopped_at"] == ids[3]
    assert [cell["cell_id"] for cell in report["cells"]] == [ids[0], ids[2], ids[3]]
    assert [cell["status"] for cell in report["cells"]] == ["ok", "ok", "error"]
    assert report["cells"][1]["text"] == "2\n"
    assert report["cells"][2]["error"] == "ValueError: boom"
    assert (report["saved"], report["reason"]) == (False, None)
    assert kernel.value("'never_ran' in globals()") is False
    assert (store.agent_root / "work.ipynb").read_bytes() == before  # not asked to save


def test_restart_run_all_saves_every_output(kernel, store):
    kernel.run(kernel.execute("leftover = 1", 30))
    ids = make_notebook(
        store,
        ("code", "print('leftover' in globals())"),
        ("code", ""),
        ("code", "y = 2"),
        ("code", "y * 3"),
    )
    report = kernel.run(run_all(store, "work.ipynb", kernel.execute, kernel.restart, save_outputs=True))
    assert (report["status"], report["stopped_at"], report["saved"], report["reason"]) == ("ok", None, True, None)
    assert [cell["status"] for cell in report["cells"]] == ["ok", "skipped", "ok", "ok"]
    assert report["cells"][0]["text"] == "False\n"  # the restart cleared the namespace
    assert [cell["execution_count"] for cell in report["cells"]] == [1, None, 2, 3]

    nb = saved_notebook(store)
    assert [cell.id for cell in nb.cells] == ids
    assert [cell.execution_count for cell in nb.cells] == [1, None, 2, 3]
    assert nb.cells[0].outputs[0]["text"] == "False\n"
    assert nb.cells[1].outputs == [] and nb.cells[2].outputs == []
    assert nb.cells[3].outputs[0]["data"]["text/plain"] == "6"


def test_run_all_saves_nothing_when_the_cells_changed_during_the_run(kernel, store):
    ids = make_notebook(store, ("code", "z = 1"), ("code", "z + 1"))
    edited = []

    async def analyst_inserts_a_cell(code: str, timeout: float | None) -> dict:
        if not edited:
            edited.append(store.insert_cell("work.ipynb", 1, "markdown", "added during the run")["id"])
        return await kernel.execute(code, timeout)

    report = kernel.run(run_all(store, "work.ipynb", analyst_inserts_a_cell, save_outputs=True))
    assert report["status"] == "ok" and report["saved"] is False
    assert "cells changed during the run" in report["reason"]
    nb = saved_notebook(store)
    assert [cell.id for cell in nb.cells] == [ids[0], edited[0], ids[1]]
    assert all(cell.get("outputs", []) == [] for cell in nb.cells)


# -- orchestration edge cases (fake execute) -------------------------------------------


def fake_execute(statuses: dict[str, str], calls: list[str]):
    async def execute(code: str, timeout: float | None) -> dict:
        calls.append(code)
        status = statuses.get(code, "ok")
        return {"status": status, "execution_count": len(calls), "outputs": [], "text": "", "error": None}

    return execute


@pytest.mark.parametrize("status", ["timeout", "died"])
def test_run_all_stops_on_timeout_or_death_and_reports_it(store, status):
    ids = make_notebook(store, ("code", "a"), ("code", "b"), ("code", "c"))
    calls: list[str] = []
    report = asyncio.run(run_all(store, "work.ipynb", fake_execute({"b": status}, calls), save_outputs=True))
    assert calls == ["a", "b"]
    assert (report["status"], report["stopped_at"], report["saved"]) == (status, ids[1], True)
    assert saved_notebook(store).cells[2].execution_count is None


def test_run_all_of_a_notebook_without_code_cells(store):
    make_notebook(store, ("markdown", "only text"))
    before = (store.agent_root / "work.ipynb").read_bytes()
    calls: list[str] = []
    report = asyncio.run(run_all(store, "work.ipynb", fake_execute({}, calls), save_outputs=True))
    assert report == {"status": "ok", "cells": [], "stopped_at": None, "saved": False, "reason": None}
    assert calls == [] and (store.agent_root / "work.ipynb").read_bytes() == before


def test_run_all_reports_a_failed_save_instead_of_raising(store):
    make_notebook(store, ("code", "a"))
    path = store.agent_root / "work.ipynb"

    async def notebook_removed_meanwhile(code: str, timeout: float | None) -> dict:
        path.unlink()
        return {"status": "ok", "execution_count": 1, "outputs": [], "text": "", "error": None}

    report = asyncio.run(run_all(store, "work.ipynb", notebook_removed_meanwhile, save_outputs=True))
    assert report["status"] == "ok" and report["saved"] is False
    assert "no notebook at work.ipynb" in report["reason"]
    assert not path.exists()
