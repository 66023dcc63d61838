"""Reading and editing an agent's ``.ipynb`` files, safely.

:class:`NotebookStore` is the core behind the notebook routes.  It reads and
writes nbformat 4.5 notebooks (cells addressed by id) inside one agent's tree,
and it never leaves a notebook half-written or silently merged:

- Every path is confined to the agent root (``..``, absolute paths elsewhere
  and symlinks that lead out are refused) and must name an ``.ipynb`` file.
- A notebook without cell ids (nbformat < 4.5) gets stable ids on load,
  derived from each cell's index and source, so two loads agree; the upgraded
  notebook reaches disk with the first write.
- Every write is validated with nbformat, then written the way Jupyter writes
  it (indent 1, trailing newline) to a temporary file in the same directory,
  fsynced and renamed over the old file.
- The ETag is a quoted hash of the file's bytes.  A write that carries the
  ETag its client last saw is refused with 409 when the file changed since;
  and every write re-checks the file right before the rename, so a change
  made on disk meanwhile (by JupyterLab, say) is refused, never merged.
- Edits of one notebook within this process are serialised by a per-path
  lock, so two concurrent edits cannot lose each other.

Every failure raises :class:`GatewayError` and leaves the file as it was.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import re
import stat
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

import nbformat
from nbformat.v4.rwbase import rejoin_lines

from kernel_gateway.errors import GatewayError, bad_request, conflict, not_found
from kernel_gateway import fs
from kernel_gateway.fs import (
    FileTooLarge,
    PathOutsideRoot,
    agent_owner,
    mkdirs_in_root,
    open_in_root,
    resolve_in_root,
    write_atomically_at,
)

CELL_TYPES = ("code", "markdown", "raw")
# Larger files are refused before they are read: the gateway holds a notebook in memory.
MAX_NOTEBOOK_BYTES = 100 << 20
NOTEBOOK_SUFFIX = ".ipynb"

# The keys nbformat's schema allows on each stored output; anything else a
# kernel sends along (``transient``, ...) would make the notebook invalid.
_OUTPUT_KEYS = {
    "stream": ("output_type", "name", "text"),
    "display_data": ("output_type", "data", "metadata"),
    "execute_result": ("output_type", "data", "metadata", "execution_count"),
    "error": ("output_type", "ename", "evalue", "traceback"),
}
_CELL_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

# One lock per resolved notebook path, shared by every store in the process.
_path_locks: dict[str, threading.Lock] = {}
_path_locks_guard = threading.Lock()


def _lock_for(path: Path) -> threading.Lock:
    with _path_locks_guard:
        return _path_locks.setdefault(str(path), threading.Lock())


def etag_of(data: bytes) -> str:
    """The ETag of a notebook file: a quoted hash of its bytes."""
    return '"' + hashlib.sha256(data).hexdigest()[:32] + '"'


def _normalise_etag(value: str) -> str:
    # Accept the ETag as sent back by clients that drop the quotes or mark it weak.
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    return '"' + value.strip('"') + '"'


def unknown_cell(path: str, cell_id: Any) -> GatewayError:
    return not_found(
        f"no cell with id {cell_id!r} in {path}",
        "list the cell ids with GET on the notebook",
        code="unknown_cell",
    )


def stable_cell_id(index: int, source: str) -> str:
    """The id given to an id-less cell: the same for the same index and source."""
    return hashlib.sha256(f"{index}\n{source}".encode()).hexdigest()[:12]


def notebook_output(output: dict) -> dict:
    """``output`` reduced to the keys nbformat stores for its output type."""
    if not isinstance(output, dict) or output.get("output_type") not in _OUTPUT_KEYS:
        raise bad_request(
            f"not an nbformat output: {str(output)[:200]}",
            "outputs are dicts with output_type stream, display_data, execute_result or error",
            code="invalid_outputs",
        )
    return {key: output[key] for key in _OUTPUT_KEYS[output["output_type"]] if key in output}


def _source_text(source: Any) -> str | None:
    """A cell source as one string (nbformat allows a list of lines), or None if it is not text."""
    if isinstance(source, list) and all(isinstance(line, str) for line in source):
        return "".join(source)
    return source if isinstance(source, str) else None


def _check_source(source: Any) -> str:
    if not isinstance(source, str):
        raise bad_request(
            f"source must be a string, not {type(source).__name__}", code="invalid_source"
        )
    return source


def _check_index(name: str, value: Any, highest: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(
            f"{name} must be an integer, not {type(value).__name__}", code="invalid_index"
        )
    if not 0 <= value <= highest:
        raise bad_request(
            f"{name} {value} is out of range: valid values are 0..{highest}",
            meaning,
            code="invalid_index",
        )
    return value


class NotebookStore:
    """The notebooks of one agent: read, edit, and save outputs into them."""

    def __init__(self, agent_root: str | os.PathLike, protected=None):
        self.agent_root = Path(agent_root)
        # protected(physical path) -> why the agent may not write there (the Agent Library), or None;
        # judged on the directory fd a write goes through, not on the path asked for.
        self.protected = protected

    # -- reading -----------------------------------------------------------

    def contents(self, path: str, include_outputs: bool = False) -> dict:
        """The notebook's cells, metadata and ETag."""
        with self._open(path) as file:
            data = self._existing_bytes(path, file)
        nb = self._parse(path, data)
        cells = []
        for cell in nb.cells:
            item = {"id": cell.id, "cell_type": cell.cell_type, "source": cell.source}
            if cell.cell_type == "code":
                item["execution_count"] = cell.get("execution_count")
                if include_outputs:
                    item["outputs"] = cell.get("outputs", [])
            cells.append(item)
        return {
            "path": path,
            "cells": cells,
            "metadata": nb.metadata,
            "nbformat": nb.nbformat,
            "nbformat_minor": nb.nbformat_minor,
            "etag": etag_of(data),
        }

    # -- whole-notebook writes ------------------------------------------------

    def put(self, path: str, notebook: dict, if_match: str | None = None) -> dict:
        """Create or replace the notebook with ``notebook``; returns ``{"etag", "created"}``.

        ``notebook`` is an nbformat 4 notebook; cells may omit ``id`` (stable
        ids are given), ``metadata``, ``outputs`` and ``execution_count``, so
        the dict ``contents`` returns can be sent back as it is.
        """
        nb = self._notebook_from_request(notebook)
        self._validate(nb, status=400)
        # With If-Match the notebook must exist, so there are no directories to create.
        with self._open(path, create_parents=if_match is None) as file, file.lock:
            old = self._read(path, file)
            if if_match is not None:
                if old is None:
                    raise not_found(
                        f"no notebook at {path}, but If-Match requires an existing one",
                        "send no If-Match to create it",
                        code="notebook_not_found",
                    )
                self._check_if_match(path, old, if_match)
            etag = self._replace(path, file, old, self._serialise(nb))
        return {"etag": etag, "created": old is None}

    # -- cell edits ---------------------------------------------------------

    def insert_cell(
        self, path: str, index: int, cell_type: str, source: str, if_match: str | None = None
    ) -> dict:
        """Insert a new cell before ``index`` (``len(cells)`` appends); returns ``{"id", "etag"}``."""
        if cell_type not in CELL_TYPES:
            raise bad_request(
                f"cell_type must be one of {', '.join(CELL_TYPES)}, not {cell_type!r}",
                code="invalid_cell_type",
            )
        _check_source(source)
        new_id = {}

        def insert(nb: nbformat.NotebookNode) -> None:
            _check_index("index", index, len(nb.cells), "index may equal the number of cells to append")
            used = {cell.id for cell in nb.cells}
            cell_id = uuid.uuid4().hex[:8]
            while cell_id in used:
                cell_id = uuid.uuid4().hex[:8]
            maker = {
                "code": nbformat.v4.new_code_cell,
                "markdown": nbformat.v4.new_markdown_cell,
                "raw": nbformat.v4.new_raw_cell,
            }[cell_type]
            nb.cells.insert(index, maker(source=source, id=cell_id))
            new_id["id"] = cell_id

        etag = self._edit(path, if_match, insert)
        return {"id": new_id["id"], "etag": etag}

    def replace_source(self, path: str, cell_id: str, source: str, if_match: str | None = None) -> dict:
        """Set the source of one cell; its outputs stay until cleared or re-run."""
        _check_source(source)

        def replace(nb: nbformat.NotebookNode) -> None:
            self._cell(path, nb, cell_id).source = source

        return {"etag": self._edit(path, if_match, replace)}

    def delete_cell(self, path: str, cell_id: str, if_match: str | None = None) -> dict:
        def delete(nb: nbformat.NotebookNode) -> None:
            nb.cells.remove(self._cell(path, nb, cell_id))

        return {"etag": self._edit(path, if_match, delete)}

    def move_cell(self, path: str, cell_id: str, to_index: int, if_match: str | None = None) -> dict:
        """Move one cell so that it ends up at ``to_index``."""

        def move(nb: nbformat.NotebookNode) -> None:
            cell = self._cell(path, nb, cell_id)
            _check_index("to_index", to_index, len(nb.cells) - 1, "to_index is the cell's new position")
            nb.cells.remove(cell)
            nb.cells.insert(to_index, cell)

        return {"etag": self._edit(path, if_match, move)}

    def clear_outputs(self, path: str, cell_ids: list[str] | None = None, if_match: str | None = None) -> dict:
        """Clear outputs and execution counts of the given code cells, or of all of them."""
        if cell_ids is not None and (
            not isinstance(cell_ids, list) or not all(isinstance(i, str) for i in cell_ids)
        ):
            raise bad_request("cell_ids must be a list of cell id strings", code="invalid_cell_ids")

        def clear(nb: nbformat.NotebookNode) -> None:
            cells = nb.cells if cell_ids is None else [self._cell(path, nb, i) for i in cell_ids]
            for cell in cells:
                if cell.cell_type == "code":
                    cell.outputs = []
                    cell.execution_count = None

        return {"etag": self._edit(path, if_match, clear)}

    def save_outputs(
        self,
        path: str,
        cell_id: str,
        source: str,
        outputs: list[dict],
        execution_count: int | None,
        if_match: str | None = None,
    ) -> dict:
        """Write the outputs of a run of ``source`` into the cell ``cell_id``.

        Refused with 409 ``cell_changed`` when the cell's source on disk is no
        longer ``source``: those outputs belong to code the cell no longer holds.
        """
        update = {"cell_id": cell_id, "source": source, "outputs": outputs, "execution_count": execution_count}
        return self.save_many_outputs(path, [update], if_match)

    def save_many_outputs(self, path: str, updates: list[dict], if_match: str | None = None) -> dict:
        """Like :meth:`save_outputs` for several cells at once, in one write.

        Each update is ``{"cell_id", "source", "outputs", "execution_count"}``.
        """
        prepared = []
        for update in updates:
            count = update["execution_count"]
            if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
                raise bad_request("execution_count must be an integer or null", code="invalid_outputs")
            if not isinstance(update["outputs"], list):
                raise bad_request("outputs must be a list", code="invalid_outputs")
            outputs = [notebook_output(output) for output in update["outputs"]]
            prepared.append((update["cell_id"], update["source"], outputs, count))

        def save(nb: nbformat.NotebookNode) -> None:
            for cell_id, source, outputs, count in prepared:
                cell = self._cell(path, nb, cell_id)
                if cell.cell_type != "code":
                    raise bad_request(f"cell {cell_id} is a {cell.cell_type} cell, not code", code="not_a_code_cell")
                if cell.source != source:
                    raise conflict(
                        f"cell {cell_id} of {path} changed since it was run; its outputs were not saved",
                        "run the cell again to get outputs for its current source",
                        code="cell_changed",
                    )
                cell.outputs = [nbformat.from_dict(output) for output in outputs]
                cell.execution_count = count

        return {"etag": self._edit(path, if_match, save)}

    # -- the machinery ------------------------------------------------------

    def _edit(self, path: str, if_match: str | None, change: Callable[[nbformat.NotebookNode], None]) -> str:
        """Read, ``change``, validate and atomically write the notebook; return the new ETag."""
        with self._open(path) as file, file.lock:
            old = self._existing_bytes(path, file)
            if if_match is not None:
                self._check_if_match(path, old, if_match)
            nb = self._parse(path, old)
            change(nb)
            self._validate(nb, status=422)
            new = self._serialise(nb)
            if new == old:
                return etag_of(old)
            return self._replace(path, file, old, new)

    def _open(self, path: str, create_parents: bool = False) -> "_NotebookFile":
        """The notebook's directory, held open beneath the agent root."""
        if not isinstance(path, str) or not path:
            raise bad_request("a notebook path is required", code="invalid_path")
        if not path.endswith(NOTEBOOK_SUFFIX):
            raise self._not_a_notebook(path, f"its name does not end in {NOTEBOOK_SUFFIX}")
        try:
            target = resolve_in_root(self.agent_root, path)
            if create_parents:
                if self.protected is not None and self.protected(str(target)):
                    # Early, so no folder is made there either; the write itself checks again on its fd.
                    raise GatewayError(403, "read_only_path", f"{self.protected(str(target))}: the agent "
                                       "cannot change it", "the operator sets it through the Agent Library")
                mkdirs_in_root(self.agent_root, target.parent)
            flags = os.O_PATH | os.O_DIRECTORY
            directory = open_in_root(self.agent_root, target.parent, flags)
            return _NotebookFile(target, directory, agent_owner(self.agent_root), self.protected)
        except PathOutsideRoot:
            raise GatewayError(
                403,
                "outside_workspace",
                f"{path} is outside the agent's workspace",
                f"use a path inside {self.agent_root}",
            ) from None
        except (FileNotFoundError, NotADirectoryError):
            raise not_found(f"no notebook at {path}", "create it with PUT", code="notebook_not_found") from None
        except ValueError as error:
            raise bad_request(f"invalid path {path!r}: {error}", code="invalid_path") from None
        except OSError as error:
            raise bad_request(f"invalid path {path!r}: {error.strerror}", code="invalid_path") from None

    def _read(self, path: str, file: "_NotebookFile") -> bytes | None:
        """The notebook file's bytes, or None if there is no such file yet."""
        try:
            return file.read()
        except IsADirectoryError:
            raise self._not_a_notebook(path, "it is not a regular file") from None
        except FileTooLarge as error:
            raise GatewayError(
                413, "too_large", f"{path} is {error.size} bytes, over the {error.cap}-byte limit for notebooks",
                "clear its outputs with the command tool (jupyter nbconvert --clear-output)",
            ) from None
        except OSError as error:
            if error.errno == errno.ELOOP:  # a symlink appeared since the path was resolved
                raise GatewayError(403, "outside_workspace", f"{path} became a symlink; refused") from None
            if error.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):  # a socket or a device
                raise self._not_a_notebook(path, "it is not a regular file") from None
            raise GatewayError(403, "permission_denied", f"cannot open {path}: {error.strerror}") from None

    def _existing_bytes(self, path: str, file: "_NotebookFile") -> bytes:
        data = self._read(path, file)
        if data is None:
            raise not_found(f"no notebook at {path}", "create it with PUT", code="notebook_not_found")
        return data

    def _not_a_notebook(self, path: str, why: str) -> GatewayError:
        return GatewayError(415, "not_a_notebook", f"{path} is not a notebook: {why}")

    def _invalid_on_disk(self, path: str, why: str) -> GatewayError:
        return GatewayError(
            422,
            "invalid_notebook",
            f"{path} is not a valid notebook: {why}",
            "fix the file, or replace it with PUT",
        )

    def _parse(self, path: str, data: bytes) -> nbformat.NotebookNode:
        """The notebook in ``data``, with stable ids for cells that lack a usable one."""
        try:
            raw = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._invalid_on_disk(path, f"invalid JSON ({error})") from None
        if (
            not isinstance(raw, dict)
            or raw.get("nbformat") != 4
            or not isinstance(raw.get("nbformat_minor", 0), int)
            or not isinstance(raw.get("cells"), list)
        ):
            raise self._invalid_on_disk(path, "not an nbformat 4 notebook (nbformat 4, a cells list)")
        for cell in raw["cells"]:
            if not isinstance(cell, dict) or cell.get("cell_type") not in CELL_TYPES:
                raise self._invalid_on_disk(path, "a cell without a valid cell_type")
            if _source_text(cell.get("source", "")) is None:
                raise self._invalid_on_disk(path, "a cell source that is not text")
        # Stored multi-line strings are lists of lines; work with plain strings.
        nb = rejoin_lines(nbformat.from_dict(raw))
        self._give_stable_ids(nb)
        return nb

    def _give_stable_ids(self, nb: nbformat.NotebookNode) -> None:
        # Missing, malformed or duplicate ids are replaced; good ids are kept.
        nb.nbformat_minor = max(nb.get("nbformat_minor", 0), 5)
        used: set[str] = set()
        for index, cell in enumerate(nb.cells):
            cell.source = _source_text(cell.get("source", ""))
            cell_id = cell.get("id")
            if not isinstance(cell_id, str) or not _CELL_ID.fullmatch(cell_id) or cell_id in used:
                cell_id = stable_cell_id(index, cell.source)
                if cell_id in used:
                    cell_id = f"{cell_id}-{index}"
                cell.id = cell_id
            used.add(cell_id)

    def _notebook_from_request(self, notebook: Any) -> nbformat.NotebookNode:
        if not isinstance(notebook, dict):
            raise bad_request("the notebook must be a JSON object", code="invalid_notebook")
        if notebook.get("nbformat", 4) != 4:
            raise bad_request("only nbformat 4 notebooks are supported", code="invalid_notebook")
        cells = notebook.get("cells")
        if not isinstance(cells, list):
            raise bad_request("the notebook needs a cells list", code="invalid_notebook")
        metadata = notebook.get("metadata", {})
        if not isinstance(metadata, dict):
            raise bad_request("metadata must be an object", code="invalid_notebook")
        nb = nbformat.v4.new_notebook(metadata=copy.deepcopy(metadata), cells=[])
        nb.nbformat_minor = 5
        for position, cell in enumerate(cells):
            nb.cells.append(self._cell_from_request(position, cell))
        given = [cell.id for cell in nb.cells if "id" in cell]
        if len(given) != len(set(given)):
            raise bad_request("cell ids must be unique", code="invalid_cell_id")
        self._give_stable_ids(nb)
        return nb

    def _cell_from_request(self, position: int, cell: Any) -> nbformat.NotebookNode:
        if not isinstance(cell, dict):
            raise bad_request(f"cell {position} must be an object", code="invalid_notebook")
        if cell.get("cell_type") not in CELL_TYPES:
            raise bad_request(
                f"cell {position}: cell_type must be one of {', '.join(CELL_TYPES)}",
                code="invalid_cell_type",
            )
        source = _source_text(cell.get("source", ""))
        if source is None:
            raise bad_request(f"cell {position}: source must be a string", code="invalid_source")
        stored = {"metadata": {}, **copy.deepcopy(cell), "source": source}
        if stored["cell_type"] == "code":
            stored.setdefault("outputs", [])
            stored.setdefault("execution_count", None)
        if stored.get("id") is None:
            stored.pop("id", None)  # a stable id is given later
        elif not isinstance(stored["id"], str) or not _CELL_ID.fullmatch(stored["id"]):
            raise bad_request(
                f"cell {position}: id must be 1-64 letters, digits, '-' or '_'", code="invalid_cell_id"
            )
        return nbformat.from_dict(stored)

    def _validate(self, nb: nbformat.NotebookNode, status: int) -> None:
        try:
            nbformat.validate(nb)
        except nbformat.ValidationError as error:
            raise GatewayError(
                status,
                "invalid_notebook",
                f"the result would not be a valid notebook: {error.message}",
                "nothing was written",
            ) from None

    def _serialise(self, nb: nbformat.NotebookNode) -> bytes:
        # The same bytes Jupyter writes: nbformat's JSON (indent 1) and a final newline.
        text = nbformat.writes(nb, version=nbformat.NO_CONVERT)
        return (text if text.endswith("\n") else text + "\n").encode("utf-8")

    def _check_if_match(self, path: str, current: bytes, if_match: str) -> None:
        if if_match.strip() == "*":
            return
        if _normalise_etag(if_match) != etag_of(current):
            raise conflict(
                f"{path} changed since ETag {if_match} (now {etag_of(current)})",
                "read the notebook again and re-apply the change",
                code="etag_mismatch",
            )

    def _replace(self, path: str, file: "_NotebookFile", old: bytes | None, new: bytes) -> str:
        """Atomically put ``new`` in place, unless the file is no longer ``old``; return the new ETag."""
        # Re-checked right before the rename: a save from elsewhere (JupyterLab)
        # since we read the file is refused, never overwritten.
        if not file.replace(old, new):
            raise conflict(
                f"{path} was changed on disk while this edit was being made; nothing was written",
                "read the notebook again and re-apply the change",
                code="etag_mismatch",
            )
        return etag_of(new)

    def _cell(self, path: str, nb: nbformat.NotebookNode, cell_id: Any) -> nbformat.NotebookNode:
        for cell in nb.cells:
            if cell.id == cell_id:
                return cell
        raise unknown_cell(path, cell_id)


class _NotebookFile:
    """One notebook file, reached through an open fd of its directory.

    Every operation is relative to that fd and refuses a final symlink, so a
    directory swapped for a symlink after the path was checked cannot redirect
    a read or a write outside the agent's tree.
    """

    def __init__(self, target: Path, dir_fd: int, owner: tuple[int, int] | None = None, protected=None):
        self.name = target.name
        self.dir_fd = dir_fd
        self.owner = owner
        self.protected = protected
        self.lock = _lock_for(target)

    def __enter__(self) -> "_NotebookFile":
        return self

    def __exit__(self, *exc_info: object) -> None:
        os.close(self.dir_fd)

    def read(self) -> bytes | None:
        # O_NONBLOCK: a FIFO named like a notebook must not hang the gateway.
        try:
            fd = fs.open_file_at(self.dir_fd, self.name)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise IsADirectoryError(errno.EISDIR, "not a regular file", self.name)
            if info.st_size > MAX_NOTEBOOK_BYTES:
                raise FileTooLarge(self.name, info.st_size, MAX_NOTEBOOK_BYTES)
            data = handle.read(MAX_NOTEBOOK_BYTES + 1)
            if len(data) > MAX_NOTEBOOK_BYTES:
                raise FileTooLarge(self.name, len(data), MAX_NOTEBOOK_BYTES)
            return data

    def replace(self, old: bytes | None, new: bytes) -> bool:
        """Write ``new`` to a temporary file, fsync it and rename it over the file.

        Returns False, writing nothing, if the file's content is no longer ``old``.
        """
        why = fs.protected_at(self.dir_fd, self.name, self.protected) if self.protected else None
        if why:
            raise GatewayError(403, "read_only_path", f"{why}: the agent cannot change it",
                               "the operator sets it through the Agent Library on the control socket")
        mode = None
        if old is not None:  # keep the mode the file had
            mode = stat.S_IMODE(fs.lstat_at(self.dir_fd, self.name).st_mode)
        return write_atomically_at(
            self.dir_fd, self.name, new, owner=self.owner, mode=mode, before_rename=lambda: self.read() == old
        )
