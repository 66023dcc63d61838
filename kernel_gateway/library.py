"""The Agent Library: an agent's skills and its SOUL.md, MISSION.md and DESIGN.md.

Each agent's tree holds ``installed-skills/<name>/`` (Agent Skills: a
``SKILL.md`` with YAML front matter, and the files it references) and the
three documents at its top.  The operator sets them through the control
socket; the agent reads them and cannot change them:

- inside every sandbox ``installed-skills/`` and each document are read-only
  binds of themselves (:func:`read_only_binds`), and the builtin
  ``jupyter-live-kernel`` skill is a read-only bind of the package's own copy,
  so it cannot drift from what the package ships.  A mount point cannot be
  renamed or removed, so the agent cannot swap any of them for its own.
- the host copy in the tree is written only here, through the confined
  helpers of :mod:`kernel_gateway.fs`, and the builtin one is rewritten at
  gateway start and agent creation whenever its digest differs from the
  package's.
- a document is rewritten in place, never renamed over: replacing the file
  would lazily detach the read-only bind in every running sandbox and leave
  the new file writable there.  A journal in the state directory makes the
  in-place write survive a crash.

Skills are enabled per agent (``enabled`` starts as the skill's
``default_enabled``); the settings live in the state directory.  Disabling
``jupyter-live-kernel`` narrows the agent: :meth:`Library.require_kernel`
refuses every route that needs a live kernel with 403 ``skill_disabled``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import secrets
import stat
import tarfile
from dataclasses import dataclass
from typing import Any

from . import workspace
from .errors import GatewayError, bad_request, conflict, not_found
from . import fs as wp
from . import state_files

KERNEL_SKILL = "jupyter-live-kernel"
SKILLS_DIR = "installed-skills"
DOCUMENTS = workspace.DOCUMENTS
BUILTIN_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_skills")

MAX_SKILL_FILE = 1 << 20  # bytes of one file of a skill
MAX_SKILL_TOTAL = 8 << 20  # bytes of all files of a skill
MAX_SKILL_FILES = 256
MAX_SKILL_DEPTH = 8
MAX_DOCUMENT = 1 << 20
MAX_DESCRIPTION = 1024
# The Agent Skills name: lowercase letters, digits and single hyphens, at most 64.
SKILL_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){0,63}$")
_STAGING = ".staging-"  # dot-names in installed-skills are never skills


def _invalid(message: str, hint: str = "") -> GatewayError:
    return bad_request(message, hint or "an Agent Skill is a directory with a SKILL.md starting with "
                       "YAML front matter: ---, name: <the directory's name>, description: ..., ---",
                       code="invalid_skill")


# --- front matter -------------------------------------------------------------------


def _scalar(raw: str, where: str) -> Any:
    raw = raw.strip()
    if raw[:1] in ('"', "'"):
        quote = raw[0]
        if len(raw) < 2 or raw[-1] != quote:
            raise _invalid(f"SKILL.md front matter: unterminated quoted value of {where}")
        inner = raw[1:-1]
        if quote == "'":
            return inner.replace("''", "'")
        try:
            return json.loads('"' + inner + '"')
        except ValueError:
            raise _invalid(f"SKILL.md front matter: bad escape in the value of {where}") from None
    if raw[:1] in ("[", "{", "&", "*", "!", "|", ">", "@", "`"):
        raise _invalid(f"SKILL.md front matter: the value of {where} is not a plain string",
                       "write it as a plain or quoted string")
    if raw.split(" #", 1)[0].strip() in ("true", "false"):
        return raw.split(" #", 1)[0].strip() == "true"
    return raw.split(" #", 1)[0].rstrip()


def parse_front_matter(text: str) -> dict:
    """The YAML front matter of a SKILL.md, in the small subset skills use.

    ``key: value`` lines with plain, quoted or boolean values, and one level
    of nested ``key:`` mappings (such as ``metadata:``).  Anything else is
    refused rather than guessed at.
    """
    lines = text.split("\n")
    if not lines or lines[0].rstrip("\r") != "---":
        raise _invalid("SKILL.md has no YAML front matter: its first line must be ---")
    try:
        end = next(i for i, line in enumerate(lines[1:], 1) if line.rstrip("\r") == "---")
    except StopIteration:
        raise _invalid("SKILL.md front matter is not closed: add a line --- after it") from None
    result: dict[str, Any] = {}
    parent: str | None = None
    for number, line in enumerate(lines[1:end], 2):
        line = line.rstrip("\r")
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indented = line[:1] in (" ", "\t")
        match = re.match(r"^\s*([A-Za-z0-9_-]+):(?:\s+(.*))?$", line)
        if not match:
            raise _invalid(f"SKILL.md front matter line {number} is not `key: value`: {line.strip()[:80]!r}")
        key, value = match.group(1), match.group(2)
        if indented:
            if parent is None:
                raise _invalid(f"SKILL.md front matter line {number} is indented under no key")
            if not value:
                raise _invalid(f"SKILL.md front matter line {number}: nesting deeper than one level")
            result[parent][key] = _scalar(value, f"{parent}.{key}")
        elif value is None or not value.strip():
            parent = key
            result[key] = {}
        else:
            parent = None
            if key in result:
                raise _invalid(f"SKILL.md front matter names {key!r} twice")
            result[key] = _scalar(value, key)
    return result


@dataclass(frozen=True)
class SkillInfo:
    name: str
    description: str
    default_enabled: bool


def check_skill_md(name: str, data: bytes) -> SkillInfo:
    """The skill's front matter checked against the Agent Skills rules."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _invalid("SKILL.md is not UTF-8 text") from None
    meta = parse_front_matter(text)
    declared = meta.get("name")
    if declared is None:
        raise _invalid("SKILL.md front matter has no name", f"add the line: name: {name}")
    if declared != name:
        raise _invalid(f"SKILL.md names the skill {declared!r} but it is installed as {name!r}",
                       f"the name in the front matter must match the directory: name: {name}")
    description = meta.get("description")
    if not isinstance(description, str) or not description.strip():
        raise _invalid("SKILL.md front matter has no description",
                       "add a line description: <what the skill does and when to use it>")
    if len(description) > MAX_DESCRIPTION:
        raise _invalid(f"SKILL.md description is {len(description)} characters; at most {MAX_DESCRIPTION}")
    extra = meta.get("metadata", {})
    default = extra.get("default_enabled", True) if isinstance(extra, dict) else True
    if isinstance(default, str) and default in ("true", "false"):
        default = default == "true"
    if not isinstance(default, bool):
        raise _invalid("SKILL.md metadata.default_enabled must be true or false")
    return SkillInfo(name=name, description=description.strip(), default_enabled=default)


def check_skill_name(name: str) -> str:
    if not isinstance(name, str) or not SKILL_NAME.match(name):
        raise bad_request(
            f"invalid skill name {name!r}",
            "1-64 lowercase letters, digits and single hyphens, not starting or ending with a hyphen",
            code="invalid_skill_name",
        )
    return name


def check_skill_files(name: str, files: dict[str, bytes]) -> SkillInfo:
    """A skill's files are confined to its directory, capped, and hold a valid SKILL.md."""
    if not files:
        raise _invalid("the skill has no files", "send at least SKILL.md")
    if len(files) > MAX_SKILL_FILES:
        raise _invalid(f"the skill has {len(files)} files; at most {MAX_SKILL_FILES}")
    total = 0
    for path, data in files.items():
        check_skill_path(path)
        if len(data) > MAX_SKILL_FILE:
            raise GatewayError(413, "skill_too_large",
                               f"{path} is {len(data)} bytes; a skill's file may have at most {MAX_SKILL_FILE}")
        total += len(data)
    if total > MAX_SKILL_TOTAL:
        raise GatewayError(413, "skill_too_large",
                           f"the skill's files hold {total} bytes; at most {MAX_SKILL_TOTAL} in all")
    dirs = {"/".join(p.split("/")[:i]) for p in files for i in range(1, p.count("/") + 1)}
    clash = sorted(dirs & set(files))
    if clash:
        raise _invalid(f"{clash[0]!r} is both a file and a directory")
    if "SKILL.md" not in files:
        raise _invalid("the skill has no SKILL.md at its top")
    return check_skill_md(name, files["SKILL.md"])


def check_skill_path(path: Any) -> str:
    if not isinstance(path, str) or not path:
        raise _invalid(f"a file name must be a non-empty string, got {path!r}")
    if path.startswith("/"):
        raise _invalid(f"file name {path!r} is absolute; names are relative to the skill's directory")
    parts = path.split("/")
    if ".." in parts:
        raise _invalid(f"file name {path!r} contains '..': a skill's files stay in its directory")
    if any(p in ("", ".") for p in parts) or "\\" in path or "\0" in path or not path.isprintable():
        raise _invalid(f"file name {path!r} is not a plain relative path", "write names like scripts/run.py")
    if len(parts) > MAX_SKILL_DEPTH or len(path) > 512 or any(len(p.encode()) > 255 for p in parts):
        raise _invalid(f"file name {path[:80]!r} is too long or too deep")
    return path


def files_from_json(body: Any) -> dict[str, bytes]:
    """{"files": {"SKILL.md": "...", ...}} -> path: bytes."""
    if not isinstance(body, dict) or set(body) != {"files"} or not isinstance(body["files"], dict):
        raise bad_request('the body must be {"files": {"SKILL.md": "...", "scripts/x.py": "..."}}',
                          "or send the skill as a tar.gz (Content-Type: application/gzip)", code="invalid_body")
    files = {}
    for path, text in body["files"].items():
        check_skill_path(path)
        if not isinstance(text, str):
            raise bad_request(f"the content of {path!r} must be a string, got {type(text).__name__}",
                              "send binary files in a tar.gz", code="wrong_type")
        files[path] = text.encode("utf-8")
    return files


def files_from_tar_gz(name: str, data: bytes) -> dict[str, bytes]:
    """The regular files of a tar.gz; links, devices and FIFOs are refused, sizes capped before reading."""
    files: dict[str, bytes] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for count, member in enumerate(tar, 1):
                if count > MAX_SKILL_FILES * 2:
                    raise _invalid(f"the archive has more than {MAX_SKILL_FILES * 2} entries")
                path = member.name[2:] if member.name.startswith("./") else member.name
                path = path.rstrip("/")
                if member.issym() or member.islnk():
                    raise _invalid(f"{member.name!r} in the archive is a {'symlink' if member.issym() else 'hard link'}"
                                   f" (to {member.linkname!r}); a skill may hold only regular files")
                if member.isdir():
                    if path not in ("", "."):
                        check_skill_path(path)
                    continue
                if not member.isreg():
                    raise _invalid(f"{member.name!r} in the archive is a device or FIFO; only regular files")
                check_skill_path(path)
                if member.size > MAX_SKILL_FILE:
                    raise GatewayError(413, "skill_too_large", f"{path} is {member.size} bytes; a skill's file "
                                       f"may have at most {MAX_SKILL_FILE}")
                total += member.size
                if total > MAX_SKILL_TOTAL:
                    raise GatewayError(413, "skill_too_large", f"the archive's files hold more than "
                                       f"{MAX_SKILL_TOTAL} bytes in all")
                if path in files:
                    raise _invalid(f"{path!r} appears twice in the archive")
                extracted = tar.extractfile(member)
                files[path] = extracted.read(MAX_SKILL_FILE + 1) if extracted else b""
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as e:
        raise _invalid(f"the body is not a readable tar.gz: {e}") from None
    # An archive of the directory itself (name/SKILL.md ...): take what is inside it.
    if files and "SKILL.md" not in files and all(p.startswith(name + "/") for p in files):
        files = {p[len(name) + 1:]: d for p, d in files.items()}
    return files


# --- the package's own skills ---------------------------------------------------------


def _read_package_tree(top: str) -> dict[str, bytes]:
    files = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for filename in sorted(filenames):
            full = os.path.join(dirpath, filename)
            with open(full, "rb") as f:  # the package's own files, not an agent's
                files[os.path.relpath(full, top)] = f.read()
    return files


def digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return h.hexdigest()


class Builtins:
    """The skills the package ships, read once."""

    def __init__(self, root: str = BUILTIN_ROOT):
        self.root = os.path.realpath(root)
        self.files: dict[str, dict[str, bytes]] = {}
        self.info: dict[str, SkillInfo] = {}
        for name in sorted(os.listdir(self.root)):
            if os.path.isfile(os.path.join(self.root, name, "SKILL.md")):
                self.files[name] = _read_package_tree(os.path.join(self.root, name))
                self.info[name] = check_skill_md(name, self.files[name]["SKILL.md"])
        self.digests = {name: digest(files) for name, files in self.files.items()}

    def path(self, name: str) -> str:
        return os.path.join(self.root, name)


# --- the library of one gateway ---------------------------------------------------------


def etag_of(data: bytes) -> str:
    return '"' + hashlib.sha256(data).hexdigest()[:32] + '"'


def _same_etag(a: str, b: str) -> bool:
    def norm(value: str) -> str:
        value = value.strip()
        return value[2:].strip('"') if value.startswith("W/") else value.strip('"')

    return norm(a) == norm(b)


def check_document_name(name: str) -> str:
    if name not in DOCUMENTS:
        raise not_found(f"no document {name!r}", f"the documents are {', '.join(DOCUMENTS)}", code="unknown_document")
    return name


def check_document_text(name: str, text: Any) -> bytes:
    if not isinstance(text, str):
        raise bad_request(f"the text of {name} must be a string, got {type(text).__name__}", code="wrong_type")
    data = text.encode("utf-8")
    if len(data) > MAX_DOCUMENT:
        raise GatewayError(413, "document_too_large", f"{name} would be {len(data)} bytes; at most {MAX_DOCUMENT}")
    return data


class Library:
    """Skills and documents of every agent under ``root``; settings under ``state_dir``."""

    def __init__(self, root: str, state_dir: str, builtins: Builtins | None = None):
        self.root = root
        self.state_dir = os.path.join(state_dir, "library")
        self.builtins = builtins or Builtins()
        self._settings: dict[str, dict[str, bool]] = {}

    def agent_root(self, agent: str) -> str:
        return workspace.agent_root(self.root, agent)

    # -- per-agent settings (state dir, ours: plain files) --

    def _settings_path(self, agent: str) -> str:
        return os.path.join(self.state_dir, agent, "skills.json")

    def enabled_overrides(self, agent: str) -> dict[str, bool]:
        if agent not in self._settings:
            try:
                with open(self._settings_path(agent)) as f:
                    saved = json.load(f).get("enabled", {})
                self._settings[agent] = {k: v for k, v in saved.items() if isinstance(v, bool)}
            except (OSError, ValueError, AttributeError):
                self._settings[agent] = {}
        return self._settings[agent]

    def _save_settings(self, agent: str, overrides: dict[str, bool]) -> None:
        path = self._settings_path(agent)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        state_files.write_json(path, {"enabled": overrides})
        self._settings[agent] = overrides

    def is_enabled(self, agent: str, name: str, default: bool = True) -> bool:
        return self.enabled_overrides(agent).get(name, default)

    def kernel_enabled(self, agent: str) -> bool:
        info = self.builtins.info.get(KERNEL_SKILL)
        return self.is_enabled(agent, KERNEL_SKILL, info.default_enabled if info else True)

    def require_kernel(self, agent: str) -> None:
        """Refuse a route that needs a live kernel when the agent's jupyter-live-kernel is disabled."""
        if not self.kernel_enabled(agent):
            raise GatewayError(
                403,
                "skill_disabled",
                f"the {KERNEL_SKILL} skill is disabled for agent {agent!r}: it has no live kernels "
                "(command, read_file, apply_patch and notebook editing still work)",
                f"an operator enables it on the control socket: PATCH /v1/agents/{agent}/skills/{KERNEL_SKILL} "
                '{"enabled": true}',
            )

    # -- the agent's tree --

    def read_only_binds(self, agent: str) -> list:
        """Mounts added to every kernel and command sandbox of the agent, read-only.

        Parents come before what is beneath them (compile_profile orders them
        after the read-write agent root).
        """
        top = self.agent_root(agent)
        binds: list = [os.path.join(top, SKILLS_DIR)]
        for name in self.builtins.files:
            binds.append({"from": self.builtins.path(name), "at": os.path.join(top, SKILLS_DIR, name)})
        binds += [os.path.join(top, name) for name in DOCUMENTS]
        return binds

    def ensure_agent(self, agent: str) -> None:
        """Make the tree fit for the read-only binds and bring the builtin skills up to date.

        Called at gateway start and when an agent is created: a document or
        ``installed-skills`` that is not what it must be (a symlink, a FIFO, a
        hard link shared with another file) is moved aside and recreated, so
        the binds never follow a path the agent chose.
        """
        top = self.agent_root(agent)
        st = wp.lstat_in_root(top, SKILLS_DIR)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            wp.rename_in_root(top, SKILLS_DIR, f"{SKILLS_DIR}.displaced-{secrets.token_hex(4)}")
            st = None
        if st is None:
            wp.make_dirs_nofollow(top, SKILLS_DIR, keep_ours=True)
        for name in DOCUMENTS:
            st = wp.lstat_in_root(top, name)
            if st is not None and not (stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
                wp.rename_in_root(top, name, f".{name}.displaced-{secrets.token_hex(4)}")
                st = None
            if st is None:
                try:
                    os.close(wp.open_nofollow(top, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, keep_ours=True))
                except FileExistsError:
                    pass
        self._replay_journal(agent)
        for name, files in self.builtins.files.items():
            where = f"{SKILLS_DIR}/{name}"
            present = wp.read_tree_in_root(top, where, MAX_SKILL_FILES, MAX_SKILL_TOTAL)
            if present is None or digest(present) != self.builtins.digests[name]:
                self._install_files(top, name, files)

    def _install_files(self, top: str, name: str, files: dict[str, bytes]) -> None:
        """Stage the files in installed-skills/.staging-*, then rename the directory into place."""
        token = secrets.token_hex(6)
        staging = f"{SKILLS_DIR}/{_STAGING}{token}"
        # Through no symlink, and the gateway's: the operator manages them, the agent only reads them.
        wp.make_dirs_nofollow(top, staging, keep_ours=True)
        try:
            for path, data in sorted(files.items()):
                if "/" in path:
                    wp.make_dirs_nofollow(top, f"{staging}/{os.path.dirname(path)}", keep_ours=True)
                fd = wp.open_nofollow(top, f"{staging}/{path}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644,
                                      keep_ours=True)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            target = f"{SKILLS_DIR}/{name}"
            old = None
            if wp.lstat_in_root(top, target) is not None:
                old = f"{SKILLS_DIR}/{_STAGING}{token}-old"
                wp.rename_in_root(top, target, old)
            wp.rename_in_root(top, staging, target)
            if old:
                wp.remove_tree_in_root(top, old)
        except BaseException:
            try:
                wp.remove_tree_in_root(top, staging)
            except OSError:
                pass
            raise

    # -- skills --

    def list_skills(self, agent: str) -> list[dict]:
        top = self.agent_root(agent)
        overrides = self.enabled_overrides(agent)
        skills = []
        for info in self.builtins.info.values():
            skills.append(self._skill_json(top, info, True, overrides))
        for name in self._user_skill_names(top):
            item = {"name": name, "description": "", "builtin": False, "default_enabled": True}
            try:
                info = check_skill_md(name, self._read_skill_md(top, name))
            except GatewayError as e:
                skills.append({**item, "enabled": overrides.get(name, True),
                               "path": os.path.join(top, SKILLS_DIR, name), "problem": e.message})
                continue
            skills.append(self._skill_json(top, info, False, overrides))
        return skills

    def _skill_json(self, top: str, info: SkillInfo, builtin: bool, overrides: dict[str, bool]) -> dict:
        return {
            "name": info.name,
            "description": info.description,
            "builtin": builtin,
            "default_enabled": info.default_enabled,
            "enabled": overrides.get(info.name, info.default_enabled),
            "path": os.path.join(top, SKILLS_DIR, info.name),
        }

    def _user_skill_names(self, top: str) -> list[str]:
        try:
            fd = wp.open_in_root(top, SKILLS_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return []
        try:
            names = []
            for name, st in wp.list_dir_at(fd, MAX_SKILL_FILES * 4, SKILLS_DIR):
                if stat.S_ISDIR(st.st_mode) and SKILL_NAME.match(name) and name not in self.builtins.files:
                    names.append(name)
            return sorted(names)
        except wp.TooManyEntries:
            return []
        finally:
            os.close(fd)

    def _read_skill_md(self, top: str, name: str) -> bytes:
        try:
            fd = wp.open_in_root(top, f"{SKILLS_DIR}/{name}/SKILL.md", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (OSError, wp.PathOutsideRoot):
            raise _invalid("it has no readable SKILL.md") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise _invalid("its SKILL.md is not a regular file")
            return f.read(MAX_SKILL_FILE)

    def skill(self, agent: str, name: str) -> dict:
        check_skill_name(name)
        for item in self.list_skills(agent):
            if item["name"] == name:
                return item
        raise not_found(f"agent {agent!r} has no skill {name!r}", f"install it: PUT /v1/agents/{agent}/skills/{name}",
                        code="unknown_skill")

    def install_skill(self, agent: str, name: str, files: dict[str, bytes]) -> tuple[dict, bool]:
        """Install or replace a user skill; (its listing, created).  A refused skill writes nothing."""
        check_skill_name(name)
        if name in self.builtins.files:
            raise GatewayError(403, "builtin_skill", f"{name!r} is a builtin skill: it cannot be replaced",
                               f"disable it instead: PATCH /v1/agents/{agent}/skills/{name} {{\"enabled\": false}}")
        check_skill_files(name, files)
        top = self.agent_root(agent)
        try:
            created = wp.lstat_in_root(top, f"{SKILLS_DIR}/{name}") is None
            self._install_files(top, name, files)
        except wp.PathOutsideRoot as e:  # installed-skills is not the plain directory it was made as
            raise conflict(f"{SKILLS_DIR} of agent {agent!r} cannot be written ({e})",
                           "restart the gateway or re-create the agent (PUT /v1/agents/...) to repair it",
                           code="library_broken") from None
        return self.skill(agent, name), created

    def set_enabled(self, agent: str, name: str, enabled: bool) -> dict:
        self.skill(agent, name)
        overrides = dict(self.enabled_overrides(agent), **{name: enabled})
        self._save_settings(agent, overrides)
        return self.skill(agent, name)

    def remove_skill(self, agent: str, name: str) -> None:
        item = self.skill(agent, name)
        if item["builtin"]:
            raise GatewayError(403, "builtin_skill", f"{name!r} is a builtin skill: it cannot be removed",
                               f"disable it instead: PATCH /v1/agents/{agent}/skills/{name} {{\"enabled\": false}}")
        top = self.agent_root(agent)
        doomed = f"{SKILLS_DIR}/{_STAGING}{secrets.token_hex(6)}-removed"
        wp.rename_in_root(top, f"{SKILLS_DIR}/{name}", doomed)
        wp.remove_tree_in_root(top, doomed)
        overrides = dict(self.enabled_overrides(agent))
        if overrides.pop(name, None) is not None:
            self._save_settings(agent, overrides)

    def materialize_skills(self, agent: str, destination_root: str, destination: str) -> list[str]:
        """Copy the agent's enabled skills into ``destination`` beneath ``destination_root``.

        The seam for a job's ``skills/``: builtin skills come from the package,
        user skills from the agent's tree (read through the confined helpers).
        Returns the names copied.
        """
        top = self.agent_root(agent)
        copied = []
        for item in self.list_skills(agent):
            if not item["enabled"] or "problem" in item:
                continue
            name = item["name"]
            if item["builtin"]:
                files = self.builtins.files[name]
            else:
                files = wp.read_tree_in_root(top, f"{SKILLS_DIR}/{name}", MAX_SKILL_FILES, MAX_SKILL_TOTAL)
                if files is None:
                    continue
            for path, data in sorted(files.items()):
                # Through no symlink at all: the job's skills/ (or a folder in it) replaced by a
                # link, even into the agent's own installed-skills/, is refused, not written through.
                target = f"{destination}/{name}/{path}"
                wp.make_dirs_nofollow(destination_root, os.path.dirname(target))
                fd = wp.open_nofollow(destination_root, target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            copied.append(name)
        return copied

    # -- documents --

    def _journal(self, agent: str, name: str) -> str:
        return os.path.join(self.state_dir, agent, f"pending-{name}")

    def _open_document(self, agent: str, name: str) -> int:
        top = self.agent_root(agent)
        try:
            fd = wp.open_in_root(top, name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (OSError, wp.PathOutsideRoot) as e:
            raise conflict(f"{name} of agent {agent!r} cannot be opened ({e})",
                           "restart the gateway or re-create the agent (PUT /v1/agents/...) to repair it",
                           code="document_broken") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise conflict(f"{name} of agent {agent!r} is not a plain file",
                           "restart the gateway or re-create the agent (PUT /v1/agents/...) to repair it",
                           code="document_broken")
        return fd

    def get_document(self, agent: str, name: str) -> dict:
        check_document_name(name)
        fd = self._open_document(agent, name)
        try:
            data = os.pread(fd, MAX_DOCUMENT + 1, 0)
        finally:
            os.close(fd)
        return {"name": name, "text": data[:MAX_DOCUMENT].decode("utf-8", errors="replace"),
                "bytes": len(data), "etag": etag_of(data),
                "path": os.path.join(self.agent_root(agent), name)}

    def put_document(self, agent: str, name: str, text: Any, if_match: str | None = None) -> dict:
        """Rewrite a document in place (see the module docstring for why not by rename)."""
        check_document_name(name)
        data = check_document_text(name, text)
        fd = self._open_document(agent, name)
        try:
            current = os.pread(fd, MAX_DOCUMENT + 1, 0)
            if if_match is not None and if_match.strip() != "*" and not _same_etag(if_match, etag_of(current)):
                raise conflict(f"{name} changed since you read it (If-Match {if_match} is stale)",
                               "GET it again, and apply your change to what is there now", code="stale_etag")
            self._write_in_place(agent, name, fd, data)
        finally:
            os.close(fd)
        return {"name": name, "bytes": len(data), "etag": etag_of(data)}

    def _write_in_place(self, agent: str, name: str, fd: int, data: bytes) -> None:
        journal = self._journal(agent, name)
        os.makedirs(os.path.dirname(journal), mode=0o700, exist_ok=True)
        with open(journal + ".tmp", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(journal + ".tmp", journal)
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            offset += os.pwrite(fd, view[offset:], offset)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
        os.unlink(journal)

    def _replay_journal(self, agent: str) -> None:
        """Finish a document write a crash interrupted."""
        for name in DOCUMENTS:
            journal = self._journal(agent, name)
            try:
                with open(journal, "rb") as f:
                    data = f.read(MAX_DOCUMENT + 1)
            except FileNotFoundError:
                continue
            try:
                fd = self._open_document(agent, name)
            except GatewayError:
                os.unlink(journal)
                continue
            try:
                self._write_in_place(agent, name, fd, data)
            finally:
                os.close(fd)

    # -- protection of host-side writes made for the agent --

    def protected(self, agent: str, resolved: str) -> str | None:
        """Why the agent may not write ``resolved`` (a path with symlinks resolved), or None."""
        top = os.path.realpath(self.agent_root(agent))
        rel = os.path.relpath(os.path.realpath(resolved), top)
        if rel.startswith(".."):
            return None
        first = rel.split("/", 1)[0]
        if rel in DOCUMENTS:
            return f"{rel} is set by the operator and read-only to the agent"
        if first == SKILLS_DIR:
            return f"{SKILLS_DIR}/ is managed through the Agent Library and read-only to the agent"
        return None
