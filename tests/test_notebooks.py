"""NotebookStore on real files: edits, ETags, atomic writes, confinement, and every refusal.

Each refusal is shown together with the file on disk being byte-identical
afterwards (and no temporary file left behind).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import nbformat
import pytest

from kernel_gateway.errors import GatewayError
from kernel_gateway.notebooks import NotebookStore, stable_cell_id


def code(source: str, **extra) -> dict:
    return {"cell_type": "code", "source": source, **extra}


def markdown(source: str) -> dict:
    return {"cell_type": "markdown", "source": source}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    agent = tmp_path / "agent"
    agent.mkdir()
    return agent


@pytest.fixture
def store(root: Path) -> NotebookStore:
    return NotebookStore(str(root))


@pytest.fixture
def notebook(store: NotebookStore, root: Path) -> Path:
    """analysis.ipynb with a markdown cell and two code cells."""
    store.put("analysis.ipynb", {"cells": [markdown("# Title"), code("x = 1"), code("print(x)")]})
    return root / "analysis.ipynb"


def ids(store: NotebookStore, path: str = "analysis.ipynb") -> list[str]:
    return [cell["id"] for cell in store.contents(path)["cells"]]


def sources(store: NotebookStore, path: str = "analysis.ipynb") -> list[str]:
    return [cell["source"] for cell in store.contents(path)["cells"]]


def on_disk(path: Path) -> nbformat.NotebookNode:
    """The notebook as Jupyter reads it, after checking it is valid nbformat."""
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    nbformat.validate(nb)
    return nb


def refused(status: int, code: str, watched: Path, call, *args, **kwargs) -> GatewayError:
    """Call, expect a GatewayError(status, code), and check ``watched`` did not change."""
    before = watched.read_bytes() if watched.exists() else None
    listing = sorted(os.listdir(watched.parent)) if watched.parent.exists() else None
    with pytest.raises(GatewayError) as caught:
        call(*args, **kwargs)
    error = caught.value
    assert (error.status, error.code) == (status, code), error.message
    assert (watched.read_bytes() if watched.exists() else None) == before
    assert (sorted(os.listdir(watched.parent)) if watched.parent.exists() else None) == listing
    return error


# -- reading and writing ------------------------------------------------------


def test_put_creates_a_valid_notebook_with_parents_written_as_jupyter_writes_it(store, root):
    created = store.put("work/deep/new.ipynb", {"cells": [code("1 + 1"), markdown(["# a\n", "b"])]})
    path = root / "work/deep/new.ipynb"
    data = path.read_bytes()
    assert created == {"etag": '"' + hashlib.sha256(data).hexdigest()[:32] + '"', "created": True}
    nb = on_disk(path)
    assert (nb.nbformat, nb.nbformat_minor) == (4, 5)
    assert [cell.source for cell in nb.cells] == ["1 + 1", "# a\nb"]
    assert all(cell.id for cell in nb.cells)
    assert data == (nbformat.writes(nb) + "\n").encode()  # indent 1, sorted keys, final newline
    assert data.startswith(b'{\n "cells": [\n  {\n')

    replaced = store.put("work/deep/new.ipynb", {"cells": [], "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}})
    assert replaced["created"] is False
    assert on_disk(path).cells == []
    assert on_disk(path).metadata.kernelspec.name == "python3"


def test_contents_lists_cells_and_outputs_only_when_asked(store, notebook):
    first = store.contents("analysis.ipynb")
    run_id = first["cells"][2]["id"]
    store.save_outputs("analysis.ipynb", run_id, "print(x)", [{"output_type": "stream", "name": "stdout", "text": "1\n"}], 3)

    plain = store.contents("analysis.ipynb")
    assert [(c["cell_type"], c["source"]) for c in plain["cells"]] == [
        ("markdown", "# Title"), ("code", "x = 1"), ("code", "print(x)"),
    ]
    assert "execution_count" not in plain["cells"][0]
    assert plain["cells"][2]["execution_count"] == 3
    assert all("outputs" not in cell for cell in plain["cells"])
    assert (plain["nbformat"], plain["nbformat_minor"], plain["path"]) == (4, 5, "analysis.ipynb")
    assert plain["etag"] == '"' + hashlib.sha256(notebook.read_bytes()).hexdigest()[:32] + '"'

    full = store.contents("analysis.ipynb", include_outputs=True)
    assert full["cells"][2]["outputs"] == [{"output_type": "stream", "name": "stdout", "text": "1\n"}]
    assert full["cells"][1]["outputs"] == []


def test_contents_output_can_be_put_back_unchanged(store, notebook):
    before = notebook.read_bytes()
    contents = store.contents("analysis.ipynb", include_outputs=True)
    assert store.put("analysis.ipynb", contents, if_match=contents["etag"])["etag"] == contents["etag"]
    assert notebook.read_bytes() == before


def test_id_less_notebook_gets_stable_ids_written_on_first_write(store, root):
    old = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("a = 1"), nbformat.v4.new_markdown_cell("text")])
    old.nbformat_minor = 4
    for cell in old.cells:
        del cell["id"]
    path = root / "old.ipynb"
    path.write_text(json.dumps(old, indent=1))
    before = path.read_bytes()

    first, second = ids(store, "old.ipynb"), ids(store, "old.ipynb")
    assert first == second == [stable_cell_id(0, "a = 1"), stable_cell_id(1, "text")]
    assert path.read_bytes() == before  # reading does not write

    store.replace_source("old.ipynb", first[1], "new text")
    nb = on_disk(path)
    assert nb.nbformat_minor == 5
    assert [cell.id for cell in nb.cells] == first
    assert nb.cells[1].source == "new text"


def test_duplicate_and_malformed_ids_on_disk_are_repaired_stably(store, root):
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "raw", "id": "same", "metadata": {}, "source": "a"},
        {"cell_type": "raw", "id": "same", "metadata": {}, "source": "b"},
        {"cell_type": "raw", "id": "bad id!", "metadata": {}, "source": "c"},
    ]}
    (root / "dup.ipynb").write_text(json.dumps(nb))
    assert ids(store, "dup.ipynb") == ["same", stable_cell_id(1, "b"), stable_cell_id(2, "c")]
    store.clear_outputs("dup.ipynb")
    assert [cell.id for cell in on_disk(root / "dup.ipynb").cells] == ids(store, "dup.ipynb")


# -- cell edits -----------------------------------------------------------------


def test_insert_cell_at_start_middle_and_end(store, notebook):
    start = store.insert_cell("analysis.ipynb", 0, "raw", "first")
    middle = store.insert_cell("analysis.ipynb", 2, "markdown", "middle")
    end = store.insert_cell("analysis.ipynb", 5, "code", "last")
    assert sources(store) == ["first", "# Title", "middle", "x = 1", "print(x)", "last"]
    nb = on_disk(notebook)
    assert [nb.cells[i].id for i in (0, 2, 5)] == [start["id"], middle["id"], end["id"]]
    assert [nb.cells[i].cell_type for i in (0, 2, 5)] == ["raw", "markdown", "code"]
    assert nb.cells[5].outputs == [] and nb.cells[5].execution_count is None
    assert end["etag"] == store.contents("analysis.ipynb")["etag"]
    assert len(set(ids(store))) == 6


def test_replace_delete_move_and_clear(store, notebook):
    title, setup, show = ids(store)
    store.save_outputs("analysis.ipynb", show, "print(x)", [{"output_type": "stream", "name": "stdout", "text": "1\n"}], 2)

    store.replace_source("analysis.ipynb", setup, "x = 2")
    store.move_cell("analysis.ipynb", title, 2)
    assert ids(store) == [setup, show, title]
    store.move_cell("analysis.ipynb", title, 0)
    assert ids(store) == [title, setup, show]
    assert sources(store) == ["# Title", "x = 2", "print(x)"]
    assert on_disk(notebook).cells[2].outputs  # editing one cell keeps other outputs

    store.clear_outputs("analysis.ipynb", [setup])
    assert on_disk(notebook).cells[2].execution_count == 2
    store.clear_outputs("analysis.ipynb")
    cleared = on_disk(notebook).cells[2]
    assert (cleared.outputs, cleared.execution_count) == ([], None)

    store.delete_cell("analysis.ipynb", title)
    assert ids(store) == [setup, show]


def test_save_outputs_writes_outputs_and_count_dropping_transient_keys(store, notebook):
    cell_id = ids(store)[2]
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": "1\n"},
        {"output_type": "display_data", "data": {"text/plain": "<fig>"}, "metadata": {}, "transient": {"display_id": "d"}},
        {"output_type": "execute_result", "data": {"text/plain": "1"}, "metadata": {}, "execution_count": 7},
    ]
    store.save_outputs("analysis.ipynb", cell_id, "print(x)", outputs, 7)
    cell = on_disk(notebook).cells[2]
    assert cell.execution_count == 7
    assert [o.output_type for o in cell.outputs] == ["stream", "display_data", "execute_result"]
    assert "transient" not in cell.outputs[1]


def test_unchanged_edit_does_not_rewrite_the_file(store, notebook):
    before = os.stat(notebook).st_ino
    etag = store.clear_outputs("analysis.ipynb")["etag"]
    assert etag == store.contents("analysis.ipynb")["etag"]
    assert os.stat(notebook).st_ino == before


def test_write_keeps_the_file_mode(store, notebook):
    os.chmod(notebook, 0o640)
    store.replace_source("analysis.ipynb", ids(store)[1], "x = 3")
    assert notebook.stat().st_mode & 0o777 == 0o640


# -- ETags and concurrency --------------------------------------------------------------


def test_matching_etag_is_accepted_in_any_spelling(store, notebook):
    etag = store.contents("analysis.ipynb")["etag"]
    etag = store.replace_source("analysis.ipynb", ids(store)[1], "x = 2", if_match=etag)["etag"]
    etag = store.replace_source("analysis.ipynb", ids(store)[1], "x = 3", if_match=etag.strip('"'))["etag"]
    store.replace_source("analysis.ipynb", ids(store)[1], "x = 4", if_match="W/" + etag)
    store.replace_source("analysis.ipynb", ids(store)[1], "x = 5", if_match="*")
    assert sources(store)[1] == "x = 5"


def test_stale_etag_is_refused_after_a_change_on_disk(store, notebook):
    seen = store.contents("analysis.ipynb")["etag"]
    jupyterlab = on_disk(notebook)
    jupyterlab.cells[1].source = "x = 'from JupyterLab'"
    nbformat.write(jupyterlab, notebook)

    cell_id = ids(store)[1]
    error = refused(409, "etag_mismatch", notebook, store.replace_source, "analysis.ipynb", cell_id, "y", if_match=seen)
    assert "read the notebook again" in error.hint
    for call, args in [
        (store.insert_cell, (0, "code", "z")),
        (store.delete_cell, (cell_id,)),
        (store.move_cell, (cell_id, 0)),
        (store.clear_outputs, ()),
        (store.put, ({"cells": []},)),
    ]:
        refused(409, "etag_mismatch", notebook, call, "analysis.ipynb", *args, if_match=seen)


def test_if_match_on_a_missing_notebook_creates_nothing(store, root):
    refused(404, "notebook_not_found", root / "new.ipynb", store.put, "new.ipynb", {"cells": []}, if_match="*")
    refused(404, "notebook_not_found", root / "new.ipynb", store.put, "new.ipynb", {"cells": []}, if_match='"abc"')
    refused(404, "notebook_not_found", root / "dir" / "new.ipynb", store.put, "dir/new.ipynb", {"cells": []}, if_match="*")
    refused(400, "invalid_source", root / "dir" / "new.ipynb", store.put, "dir/new.ipynb", {"cells": [code(None)]})
    assert os.listdir(root) == []


def test_change_on_disk_during_an_edit_is_refused_not_merged(store, notebook):
    """JupyterLab saves between our read and our rename: our write is dropped."""
    jupyterlab = on_disk(notebook)
    jupyterlab.cells[0].source = "# Saved by JupyterLab"
    jupyterlab_bytes = nbformat.writes(jupyterlab).encode()

    def edit_while_jupyterlab_saves(nb):
        notebook.write_bytes(jupyterlab_bytes)
        nb.cells.pop()

    with pytest.raises(GatewayError) as caught:
        store._edit("analysis.ipynb", None, edit_while_jupyterlab_saves)
    assert (caught.value.status, caught.value.code) == (409, "etag_mismatch")
    assert notebook.read_bytes() == jupyterlab_bytes
    assert os.listdir(notebook.parent) == ["analysis.ipynb"]


def test_concurrent_edits_in_one_process_are_all_kept(store, notebook):
    def insert(n: int) -> None:
        store.insert_cell("analysis.ipynb", 0, "code", f"cell_{n} = {n}")

    threads = [threading.Thread(target=insert, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(sources(store)[:20]) == sorted(f"cell_{n} = {n}" for n in range(20))
    assert len(on_disk(notebook).cells) == 23


# -- refusals: the clear error, and nothing changed ------------------------------------


def test_unknown_cell_id(store, notebook):
    for call, args in [
        (store.replace_source, ("nope", "x")),
        (store.delete_cell, ("nope",)),
        (store.move_cell, ("nope", 0)),
        (store.clear_outputs, (["nope"],)),
        (store.save_outputs, ("nope", "x", [], 1)),
    ]:
        error = refused(404, "unknown_cell", notebook, call, "analysis.ipynb", *args)
        assert "'nope'" in error.message


def test_bad_indexes_name_the_valid_range(store, notebook):
    cell_id = ids(store)[0]
    for index in (-1, 4):
        error = refused(400, "invalid_index", notebook, store.insert_cell, "analysis.ipynb", index, "code", "x")
        assert "0..3" in error.message
    error = refused(400, "invalid_index", notebook, store.move_cell, "analysis.ipynb", cell_id, 3)
    assert "0..2" in error.message
    for index in ("1", 1.0, True, None):
        refused(400, "invalid_index", notebook, store.insert_cell, "analysis.ipynb", index, "code", "x")
        refused(400, "invalid_index", notebook, store.move_cell, "analysis.ipynb", cell_id, index)


def test_wrong_cell_type_and_non_string_source(store, notebook):
    refused(400, "invalid_cell_type", notebook, store.insert_cell, "analysis.ipynb", 0, "heading", "x")
    cell_id = ids(store)[1]
    for source in (None, 42, ["x = 1"], b"x"):
        refused(400, "invalid_source", notebook, store.insert_cell, "analysis.ipynb", 0, "code", source)
        refused(400, "invalid_source", notebook, store.replace_source, "analysis.ipynb", cell_id, source)
    refused(400, "invalid_cell_ids", notebook, store.clear_outputs, "analysis.ipynb", "all")
    refused(400, "invalid_cell_ids", notebook, store.clear_outputs, "analysis.ipynb", [1])


def test_outputs_that_are_not_nbformat_are_refused(store, notebook):
    cell_id = ids(store)[2]
    for outputs in ([{"output_type": "html"}], ["text"], {"output_type": "stream"}):
        refused(400, "invalid_outputs", notebook, store.save_outputs, "analysis.ipynb", cell_id, "print(x)", outputs, 1)
    refused(400, "invalid_outputs", notebook, store.save_outputs, "analysis.ipynb", cell_id, "print(x)", [], "1")
    refused(400, "not_a_code_cell", notebook, store.save_outputs, "analysis.ipynb", ids(store)[0], "# Title", [], 1)
    stream_without_name = [{"output_type": "stream", "text": "x"}]
    refused(422, "invalid_notebook", notebook, store.save_outputs, "analysis.ipynb", cell_id, "print(x)", stream_without_name, 1)


def test_save_outputs_for_a_changed_source_is_refused(store, notebook):
    cell_id = ids(store)[2]
    error = refused(409, "cell_changed", notebook, store.save_outputs, "analysis.ipynb", cell_id, "print(y)", [], 1)
    assert cell_id in error.message


def test_paths_outside_the_tree_are_refused(store, root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), victim)
    (root / "escape").symlink_to(outside)
    (root / "rel-escape").symlink_to("../outside")
    (root / "link.ipynb").symlink_to(victim)

    for path in ("../outside/victim.ipynb", str(victim), "escape/victim.ipynb", "rel-escape/victim.ipynb",
                 "link.ipynb", "sub/../../outside/victim.ipynb"):
        refused(403, "outside_workspace", victim, store.contents, path)
        error = refused(403, "outside_workspace", victim, store.put, path, {"cells": []})
        assert "outside the agent's workspace" in error.message
        refused(403, "outside_workspace", victim, store.insert_cell, path, 0, "code", "x")
    refused(403, "outside_workspace", outside / "new.ipynb", store.put, "escape/new.ipynb", {"cells": []})
    assert sorted(os.listdir(outside)) == ["victim.ipynb"]


def test_absolute_path_inside_the_tree_is_accepted(store, notebook, root):
    assert store.contents(str(root / "analysis.ipynb"))["cells"][0]["source"] == "# Title"


def test_files_that_are_not_notebooks(store, root):
    text = root / "notes.txt"
    text.write_text("not a notebook")
    refused(415, "not_a_notebook", text, store.contents, "notes.txt")
    refused(415, "not_a_notebook", text, store.put, "notes.txt", {"cells": []})
    (root / "folder.ipynb").mkdir()
    refused(415, "not_a_notebook", root / "folder.ipynb" / "x", store.contents, "folder.ipynb")
    refused(415, "not_a_notebook", root / "folder.ipynb" / "x", store.put, "folder.ipynb", {"cells": []})
    refused(400, "invalid_path", root / "x", store.contents, "")


def test_invalid_json_or_non_notebook_json_on_disk(store, root):
    broken = root / "broken.ipynb"
    for content in (b'{"cells": [', b"\xff\xfe", b'{"a": 1}', b'{"nbformat": 3, "worksheets": []}', b"[]",
                    b'{"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [{"cell_type": "code", "source": 5}]}'):
        broken.write_bytes(content)
        error = refused(422, "invalid_notebook", broken, store.contents, "broken.ipynb")
        assert "broken.ipynb is not a valid notebook" in error.message
        refused(422, "invalid_notebook", broken, store.insert_cell, "broken.ipynb", 0, "code", "x")
        refused(422, "invalid_notebook", broken, store.clear_outputs, "broken.ipynb")
    # PUT may replace a broken file: that is how it gets fixed.
    store.put("broken.ipynb", {"cells": [code("fixed")]})
    assert on_disk(broken).cells[0].source == "fixed"


def test_an_edit_that_would_leave_an_invalid_notebook_writes_nothing(store, root):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0]["unexpected"] = True  # readable, but not valid nbformat
    path = root / "odd.ipynb"
    path.write_text(json.dumps(nb))
    assert store.contents("odd.ipynb")["cells"][0]["source"] == "x"
    error = refused(422, "invalid_notebook", path, store.replace_source, "odd.ipynb", ids(store, "odd.ipynb")[0], "y")
    assert "unexpected" in error.message


def test_put_of_an_invalid_notebook_is_refused(store, notebook):
    for body, code_ in [
        ([], "invalid_notebook"),
        ({"cells": "none"}, "invalid_notebook"),
        ({"cells": [], "nbformat": 3}, "invalid_notebook"),
        ({"cells": [], "metadata": []}, "invalid_notebook"),
        ({"cells": [{"cell_type": "heading", "source": "x"}]}, "invalid_cell_type"),
        ({"cells": [{"cell_type": "code", "source": 1}]}, "invalid_source"),
        ({"cells": [{"cell_type": "code", "source": "x", "bogus": 1}]}, "invalid_notebook"),
        ({"cells": [{"cell_type": "code", "source": "x", "id": "has space"}]}, "invalid_cell_id"),
        ({"cells": [{"cell_type": "raw", "source": "", "id": "a"}, {"cell_type": "raw", "source": "", "id": "a"}]},
         "invalid_cell_id"),
    ]:
        refused(400, code_, notebook, store.put, "analysis.ipynb", body)


def test_missing_notebook(store, root):
    for call, args in [
        (store.contents, ()),
        (store.insert_cell, (0, "code", "x")),
        (store.clear_outputs, ()),
    ]:
        refused(404, "notebook_not_found", root / "missing.ipynb", call, "missing.ipynb", *args)
        refused(404, "notebook_not_found", root / "no-dir" / "missing.ipynb", call, "no-dir/missing.ipynb", *args)
    assert not (root / "no-dir").exists()
