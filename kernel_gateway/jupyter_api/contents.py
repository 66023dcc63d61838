"""``/api/contents`` of the Jupyter Server API, confined to one agent's tree.

Models, status codes and names follow jupyter_server's ``FileContentsManager``
(notebooks as nbformat v4 JSON, text files, base64 binary, directories;
checkpoints in ``.ipynb_checkpoints/``; ``Untitled``, ``-Copy1``).  Every
touch of the tree goes through the confined helpers of
``kernel_gateway.fs``: lookups with openat2 ``RESOLVE_BENEATH`` from the
agent root, then ``*at`` calls relative to the directory descriptor found, so
a symlink out of the tree, ``..``, an absolute path or another agent's tree is
refused and nothing outside is ever read or written.  Reads are of regular
files only (a FIFO cannot block the gateway) and size-capped before reading;
writes are atomic (temp file, fsync, rename in the same directory).
Symlinks are followed only while they stay inside the tree, as
jupyter_server follows them within its root: the agent's own links are part
of what it sees; every write is then judged by the Library's guard on the
directory descriptor reached.  Listings are capped (``fs.MAX_LIST_ENTRIES``)
and a folder's checkpoints are removed fd-relative without following or
opening anything but directories.  Every method is agent-sized disk work:
the routes call it on a worker thread within the agent's share
(:mod:`kernel_gateway.fs.workers`), never on the event loop.
"""

from __future__ import annotations

import base64
import datetime
import errno
import mimetypes
import os
import stat
from typing import Callable

import nbformat

from ..errors import GatewayError, bad_request, conflict, not_found
from .. import fs as wp

READ_CAP = 64 << 20  # bytes of one file served by GET
CHECKPOINT_DIR = ".ipynb_checkpoints"
CHECKPOINT_ID = "checkpoint"
TYPES = ("notebook", "file", "directory")


def _iso(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def check_api_path(path: str) -> str:
    """A contents path as the API names it: relative, '/'-separated, no '..'; '' is the root."""
    if not isinstance(path, str):
        raise bad_request("a path must be a string", code="invalid_path")
    if path.startswith("/") and path.strip("/"):
        raise bad_request(f"absolute path {path!r} refused", "paths are relative to the agent's tree",
                          code="path_outside_root")
    path = path.strip("/")
    parts = path.split("/") if path else []
    if any(p in ("..", ".") or p == "" for p in parts):
        raise bad_request(f"path {path!r} has '.', '..' or empty components", code="path_outside_root")
    wp.check_path_text(path)  # NUL, over-long, not UTF-8: 400 invalid_path
    return path


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent, name


class Contents:
    """The contents manager of one agent's tree."""

    def __init__(self, root: str, protected: Callable[[str], str | None] | None = None):
        self.root = root
        self.root_real = str(wp.resolve_in_root(root, "."))
        # protected(physical path) -> why the agent may not write it (the Agent Library's documents
        # and installed skills), or None.
        self.protected = protected or (lambda physical: None)

    def _guard(self, dir_fd: int, name: str, path: str) -> None:
        """Refuse a write to what the agent may only read, judged on the directory actually opened."""
        why = wp.protected_at(dir_fd, name, self.protected)
        if why:
            raise GatewayError(403, "read_only", f"{path}: {why}", "")

    # --- confined primitives -------------------------------------------------

    def _open(self, path: str, flags: int) -> int:
        """An fd for ``path`` beneath the root (symlinks followed only while they stay inside)."""
        try:
            return wp.open_in_root(self.root, path or ".", flags)
        except (wp.PathOutsideRoot, OSError) as e:
            raise self._refusal(path, e) from None

    @staticmethod
    def _refusal(path: str, e: Exception) -> Exception:
        """The Jupyter error for a confined lookup that failed (the exception itself if none fits)."""
        if isinstance(e, wp.PathOutsideRoot):
            return GatewayError(403, "path_outside_root", f"path {path!r} leads outside the agent's tree",
                                "symlinks out of the tree are not followed")
        if isinstance(e, (FileNotFoundError, NotADirectoryError)):
            return not_found(f"No such file or directory: {path}", code="not_found")
        if isinstance(e, OSError) and e.errno == errno.ELOOP:
            return GatewayError(403, "path_outside_root", f"path {path!r} is a symlink; refused")
        return e

    def _stat(self, path: str) -> os.stat_result:
        fd = self._open(path, os.O_PATH)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _dir_fd(self, path: str) -> int:
        fd = self._open(path, os.O_PATH | os.O_DIRECTORY)
        return fd

    def _parent_fd(self, path: str) -> tuple[int, str]:
        """(fd of the directory holding ``path``, its last component)."""
        parent, name = _split(path)
        if not name:
            raise bad_request("the root itself cannot be changed", code="invalid_path")
        try:
            return self._dir_fd(parent), name
        except GatewayError as e:
            if e.status == 404:
                raise not_found(f"No such directory: {parent}", code="not_found") from None
            raise

    def _exists_in(self, dir_fd: int, name: str) -> bool:
        return wp.lstat_at(dir_fd, name) is not None

    def _read(self, path: str) -> bytes:
        try:
            return wp.read_regular_in_root(self.root, path or ".", READ_CAP, follow_final=True)
        except wp.NotRegularFile:
            raise bad_request(f"{path} is not a regular file", code="not_a_file") from None
        except wp.FileTooLarge as e:
            raise GatewayError(413, "file_too_large", f"{path} is {e.size} bytes or more; the limit is {READ_CAP}") from None
        except (wp.PathOutsideRoot, OSError) as e:
            raise self._refusal(path, e) from None

    def _write(self, path: str, data: bytes) -> None:
        """Replace the file at ``path`` atomically; a symlink there is replaced, never followed."""
        dir_fd, name = self._parent_fd(path)
        try:
            self._guard(dir_fd, name, path)
            st = wp.lstat_at(dir_fd, name)
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise bad_request(f"{path} is a directory", code="is_a_directory")
            owner = os.fstat(dir_fd)  # the agent's file, not root's
            wp.write_atomically_at(dir_fd, name, data, owner=(owner.st_uid, owner.st_gid))
        finally:
            os.close(dir_fd)

    def _mkdir(self, path: str) -> None:
        dir_fd, name = self._parent_fd(path)
        try:
            self._guard(dir_fd, name, path)
            wp.mkdir_at(dir_fd, name, 0o755)
        except FileExistsError:
            raise conflict(f"{path} already exists", code="exists") from None
        finally:
            os.close(dir_fd)

    # --- models ----------------------------------------------------------------

    def _base_model(self, path: str, info: os.stat_result, type_: str) -> dict:
        return {
            "name": path.rpartition("/")[2],
            "path": path,
            "type": type_,
            "writable": not self.protected(os.path.join(self.root_real, path)),
            "created": _iso(info.st_ctime),
            "last_modified": _iso(info.st_mtime),
            "size": info.st_size if type_ != "directory" else None,
            "mimetype": None,
            "content": None,
            "format": None,
        }

    @staticmethod
    def _type_of(path: str, info: os.stat_result) -> str:
        if stat.S_ISDIR(info.st_mode):
            return "directory"
        return "notebook" if path.endswith(".ipynb") else "file"

    def get(self, path: str, *, content: bool = True, type_: str | None = None, format_: str | None = None) -> dict:
        path = check_api_path(path)
        if type_ is not None and type_ not in TYPES:
            raise bad_request(f"Type {type_!r} is invalid", f"one of {', '.join(TYPES)}", code="invalid_type")
        if format_ is not None and format_ not in ("text", "base64", "json"):
            raise bad_request(f"Format {format_!r} is invalid", "text or base64", code="invalid_format")
        info = self._stat(path)
        actual = self._type_of(path, info)
        if actual == "directory" and type_ not in (None, "directory"):
            raise bad_request(f"{path} is a directory, not a {type_}", code="wrong_type")
        if actual != "directory" and type_ == "directory":
            raise bad_request(f"{path} is not a directory", code="wrong_type")
        if actual == "notebook" and type_ == "file":
            actual = "file"
        if actual == "directory":
            return self._dir_model(path, info, content)
        if not stat.S_ISREG(info.st_mode):
            raise bad_request(f"{path} is not a regular file", code="not_a_file")
        if actual == "notebook":
            return self._notebook_model(path, info, content)
        return self._file_model(path, info, content, format_)

    def _dir_model(self, path: str, info: os.stat_result, content: bool) -> dict:
        model = self._base_model(path, info, "directory")
        if not content:
            return model
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK)
        items = []
        try:
            try:
                entries = wp.list_dir_at(fd, wp.MAX_LIST_ENTRIES, path)
            except wp.TooManyEntries:
                raise GatewayError(413, "too_many_entries",
                                   f"{path or 'the top folder'} holds more than {wp.MAX_LIST_ENTRIES} entries",
                                   "list it with a command (ls), or split it into folders") from None
            for name, child_info in entries:
                if name.startswith("."):
                    continue  # hidden, as jupyter_server hides them
                child = f"{path}/{name}" if path else name
                if stat.S_ISLNK(child_info.st_mode):
                    try:
                        child_info = self._stat(child)  # a symlink out of the tree is not listed
                    except GatewayError:
                        continue
                kind = self._type_of(child, child_info)
                if kind != "directory" and not stat.S_ISREG(child_info.st_mode):
                    continue  # FIFOs, sockets, devices
                items.append(self._base_model(child, child_info, kind))
        finally:
            os.close(fd)
        model.update(content=sorted(items, key=lambda m: m["name"]), format="json")
        return model

    def _notebook_model(self, path: str, info: os.stat_result, content: bool) -> dict:
        model = self._base_model(path, info, "notebook")
        if not content:
            return model
        data = self._read(path)
        try:
            nb = nbformat.reads(data.decode("utf-8"), as_version=4)
        except Exception as e:  # nbformat raises many kinds of error for a broken file
            raise bad_request(f"Unreadable Notebook: {path} {e!r}", code="unreadable_notebook") from None
        model.update(content=nb, format="json", mimetype=None)
        return model

    def _file_model(self, path: str, info: os.stat_result, content: bool, format_: str | None) -> dict:
        model = self._base_model(path, info, "file")
        mimetype = mimetypes.guess_type(path)[0]
        model["mimetype"] = mimetype or "text/plain"
        if not content:
            return model
        data = self._read(path)
        if format_ in (None, "text", "json"):
            try:
                model.update(content=data.decode("utf-8"), format="text", mimetype=mimetype or "text/plain")
                return model
            except UnicodeDecodeError:
                if format_ == "text":
                    raise bad_request(f"{path} is not UTF-8 encoded", "ask for format=base64",
                                      code="not_utf8") from None
        model.update(content=base64.b64encode(data).decode("ascii"), format="base64",
                     mimetype=mimetype or "application/octet-stream")
        return model

    # --- writes ----------------------------------------------------------------

    def exists(self, path: str) -> bool:
        try:
            self._stat(check_api_path(path))
            return True
        except GatewayError as e:
            if e.status == 404:
                return False
            raise

    def save(self, path: str, model: dict) -> dict:
        """Write a model (PUT): a notebook, a file (text or base64) or a directory."""
        path = check_api_path(path)
        if not path:
            raise bad_request("the root cannot be replaced", code="invalid_path")
        allowed = {"type", "format", "content", "name", "path", "mimetype", "chunk",
                   "created", "last_modified", "writable", "size", "hash", "hash_algorithm"}
        unknown = sorted(set(model) - allowed)
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}", code="unknown_field")
        if "copy_from" in model:
            raise bad_request("Cannot copy with PUT, only POST", code="bad_request")
        if model.get("chunk") is not None:
            raise bad_request("chunked uploads are not supported", "send the whole file", code="unsupported")
        type_ = model.get("type")
        if type_ not in TYPES:
            raise bad_request("No file type provided" if type_ is None else f"Unhandled contents type: {type_}",
                              code="invalid_type")
        if type_ == "directory":
            info = None
            try:
                info = self._stat(path)
            except GatewayError as e:
                if e.status != 404:
                    raise
            if info is None:
                self._mkdir(path)
            elif not stat.S_ISDIR(info.st_mode):
                raise bad_request(f"{path} exists and is not a directory", code="wrong_type")
            return self.get(path, content=False)
        if "content" not in model or model["content"] is None:
            raise bad_request("No file content provided", code="missing_field")
        self._write(path, self._encode(path, type_, model))
        result = self.get(path, content=False)
        if type_ == "notebook":
            try:
                nbformat.validate(nbformat.from_dict(model["content"]))
            except nbformat.ValidationError as e:
                result["message"] = f"Notebook validation failed: {e.message}"
        return result

    @staticmethod
    def _encode(path: str, type_: str, model: dict) -> bytes:
        content, format_ = model["content"], model.get("format")
        if type_ == "notebook":
            if not isinstance(content, dict):
                raise bad_request("a notebook's content must be a JSON object", code="wrong_type")
            try:
                nb = nbformat.from_dict(content)
                if nb.get("nbformat") != 4:
                    raise ValueError("only nbformat 4 notebooks are written")
                return nbformat.writes(nb, version=4).encode("utf-8")
            except Exception as e:  # a structurally broken notebook
                raise bad_request(f"Unable to save notebook {path}: {e}", code="invalid_notebook") from None
        if not isinstance(content, str):
            raise bad_request("a file's content must be a string", code="wrong_type")
        if format_ in (None, "text"):
            return content.encode("utf-8", "surrogateescape") if format_ else content.encode("utf-8")
        if format_ == "base64":
            try:
                return base64.b64decode(content.encode("ascii"), validate=True)
            except (ValueError, UnicodeEncodeError):
                raise bad_request(f"Encoding error saving {path}: not valid base64", code="bad_base64") from None
        raise bad_request(f"Must specify format of file contents as 'text' or 'base64', not {format_!r}",
                          code="invalid_format")

    def new_untitled(self, path: str, type_: str = "", ext: str = "") -> dict:
        """POST to a directory: ``Untitled.ipynb``, ``untitled.txt`` or ``Untitled Folder``, numbered."""
        path = check_api_path(path)
        if not isinstance(type_, str) or not isinstance(ext, str):
            raise bad_request("type and ext must be strings", code="wrong_type")
        info = self._stat(path)
        if not stat.S_ISDIR(info.st_mode):
            raise bad_request(f"Cannot POST to files, use PUT instead: {path}", code="not_a_directory")
        if ext and ("/" in ext or not ext.startswith(".") or len(ext) > 32):
            raise bad_request(f"invalid extension {ext!r}", code="invalid_ext")
        if not type_:
            type_ = "notebook" if ext in ("", ".ipynb") else "file"
        if type_ not in TYPES:
            raise bad_request(f"Unhandled contents type: {type_}", code="invalid_type")
        if type_ == "directory":
            stem, ext, sep = "Untitled Folder", "", " "
        elif type_ == "notebook":
            stem, ext, sep = "Untitled", ".ipynb", ""
        else:
            stem, ext, sep = "untitled", ext or ".txt", ""
        name = self._free_name(path, stem, ext, sep)
        target = f"{path}/{name}" if path else name
        if type_ == "directory":
            self._mkdir(target)
            return self.get(target, content=False)
        empty = {"type": type_, "format": "text", "content": nbformat.v4.new_notebook() if type_ == "notebook" else ""}
        return self.save(target, empty)

    def _free_name(self, directory: str, stem: str, ext: str, sep: str, first: str = "") -> str:
        fd = self._dir_fd(directory)
        try:
            for i in range(10000):
                suffix = first if i == 0 else f"{sep}{i}" if not first else f"{first[:-1]}{i + 1}"
                name = f"{stem}{suffix}{ext}"
                if not self._exists_in(fd, name):
                    return name
        finally:
            os.close(fd)
        raise conflict(f"no free name for {stem}{ext} in {directory!r}", code="exists")

    def copy(self, from_path: str, to_dir: str) -> dict:
        """POST {copy_from}: a copy named ``name-Copy1.ext`` in ``to_dir``."""
        from_path, to_dir = check_api_path(from_path), check_api_path(to_dir)
        source = self._stat(from_path)
        if stat.S_ISDIR(source.st_mode):
            raise bad_request(f"{from_path} is a directory; only files are copied", code="is_a_directory")
        target_info = self._stat(to_dir)
        if not stat.S_ISDIR(target_info.st_mode):
            raise bad_request(f"Cannot POST to files, use PUT instead: {to_dir}", code="not_a_directory")
        data = self._read(from_path)
        name = from_path.rpartition("/")[2]
        stem, ext = (name[: -len(".ipynb")], ".ipynb") if name.endswith(".ipynb") else os.path.splitext(name)
        new = self._free_name(to_dir, stem, ext, "", first="-Copy1")
        target = f"{to_dir}/{new}" if to_dir else new
        self._write(target, data)
        return self.get(target, content=False)

    def rename(self, old: str, new: str) -> dict:
        old, new = check_api_path(old), check_api_path(new)
        if not old or not new:
            raise bad_request("the root cannot be renamed", code="invalid_path")
        if old == new:
            return self.get(new, content=False)
        if new.startswith(old + "/"):
            raise bad_request(f"cannot move {old!r} into itself ({new!r})", "choose a path outside it",
                              code="invalid_path")
        self._stat(old)  # 404 if missing, 403 if it leads out
        src_fd, src_name = self._parent_fd(old)
        try:
            dst_fd, dst_name = self._parent_fd(new)
            try:
                self._guard(src_fd, src_name, old)
                self._guard(dst_fd, dst_name, new)
                if self._exists_in(dst_fd, dst_name):
                    raise conflict(f"File already exists: {new}", code="exists")
                try:
                    wp.rename_at(src_fd, src_name, dst_fd, dst_name)
                except OSError as e:  # the tree changed under the checks: the agent's doing, not a bug
                    if e.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    raise conflict(f"cannot rename {old!r} to {new!r}: {e.strerror}", code="rename_failed") from None
            finally:
                os.close(dst_fd)
        finally:
            os.close(src_fd)
        return self.get(new, content=False)

    def delete(self, path: str) -> None:
        path = check_api_path(path)
        if not path:
            raise bad_request("the root cannot be deleted", code="invalid_path")
        dir_fd, name = self._parent_fd(path)
        try:
            st = wp.lstat_at(dir_fd, name)
            if st is None:
                raise not_found(f"File or directory does not exist: {path}", code="not_found")
            self._guard(dir_fd, name, path)
            if stat.S_ISDIR(st.st_mode):
                inner = wp.open_dir_at(dir_fd, name)
                try:
                    # Only the checkpoints may be left, as jupyter_server allows; whatever
                    # .ipynb_checkpoints is (a folder, a symlink, a FIFO), it is removed
                    # without being followed or opened, and within the removal caps.
                    try:
                        names = [n for n, _ in wp.list_dir_at(inner, 1, path)]
                    except wp.TooManyEntries:
                        names = ["", ""]  # two entries or more: not only the checkpoints
                    if [n for n in names if n != CHECKPOINT_DIR]:
                        raise bad_request(f"Directory {path} not empty", "delete what it holds first",
                                          code="not_empty")
                    if names:
                        wp.remove_tree_at(inner, CHECKPOINT_DIR, path=f"{path}/{CHECKPOINT_DIR}")
                except wp.TooManyEntries as e:
                    raise GatewayError(413, "too_many_entries", f"{path}/{CHECKPOINT_DIR} holds {e.strerror}",
                                       "delete its contents with a command first") from None
                finally:
                    os.close(inner)
                wp.rmdir_at(dir_fd, name)
            else:
                wp.unlink_at(dir_fd, name)  # a symlink itself, never its target
        finally:
            os.close(dir_fd)

    # --- checkpoints -------------------------------------------------------------

    def _checkpoint_path(self, path: str) -> str:
        parent, name = _split(path)
        stem, ext = (name[: -len(".ipynb")], ".ipynb") if name.endswith(".ipynb") else os.path.splitext(name)
        folder = f"{parent}/{CHECKPOINT_DIR}" if parent else CHECKPOINT_DIR
        return f"{folder}/{stem}-{CHECKPOINT_ID}{ext}"

    def _checkpoint_model(self, path: str) -> dict:
        info = self._stat(self._checkpoint_path(path))
        return {"id": CHECKPOINT_ID, "last_modified": _iso(info.st_mtime)}

    def _check_file(self, path: str) -> str:
        path = check_api_path(path)
        info = self._stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise bad_request(f"{path} is not a file: only files have checkpoints", code="not_a_file")
        return path

    def list_checkpoints(self, path: str) -> list[dict]:
        path = self._check_file(path)
        try:
            return [self._checkpoint_model(path)]
        except GatewayError as e:
            if e.status == 404:
                return []
            raise

    def create_checkpoint(self, path: str) -> dict:
        path = self._check_file(path)
        parent = _split(path)[0]
        folder = f"{parent}/{CHECKPOINT_DIR}" if parent else CHECKPOINT_DIR
        try:
            self._stat(folder)
        except GatewayError as e:
            if e.status != 404:
                raise
            self._mkdir(folder)
        self._write(self._checkpoint_path(path), self._read(path))
        return self._checkpoint_model(path)

    def _check_checkpoint(self, path: str, checkpoint_id: str) -> str:
        path = self._check_file(path)
        if checkpoint_id != CHECKPOINT_ID:
            raise not_found(f"checkpoint does not exist: {path}@{checkpoint_id}", code="unknown_checkpoint")
        try:
            self._stat(self._checkpoint_path(path))
        except GatewayError as e:
            if e.status == 404:
                raise not_found(f"checkpoint does not exist: {path}@{checkpoint_id}",
                                code="unknown_checkpoint") from None
            raise
        return path

    def restore_checkpoint(self, path: str, checkpoint_id: str) -> None:
        path = self._check_checkpoint(path, checkpoint_id)
        self._write(path, self._read(self._checkpoint_path(path)))

    def delete_checkpoint(self, path: str, checkpoint_id: str) -> None:
        path = self._check_checkpoint(path, checkpoint_id)
        checkpoint = self._checkpoint_path(path)
        dir_fd, name = self._parent_fd(checkpoint)
        try:
            self._guard(dir_fd, name, checkpoint)  # the Library's files have no checkpoint to delete
            wp.unlink_at(dir_fd, name)
        finally:
            os.close(dir_fd)
