"""The Agent Library: the builtin skill per agent, the skills and documents API, narrowing
jupyter-live-kernel.  Real gateway, real bwrap, real kernels, real files."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile

import pytest

from kernel_gateway import library, workspace
from kernel_gateway.library import Builtins, Library
from support import GatewayProcess, pid_alive, wait_until

SKILL = "jupyter-live-kernel"
PACKAGE_SKILL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "skills", SKILL)
GOOD_SKILL_MD = "---\nname: csv-tools\ndescription: Read and clean CSV files.\n---\n# CSV tools\n"


def tree_bytes(top: str) -> dict[str, bytes]:
    found = {}
    for dirpath, _dirs, files in os.walk(top):
        for name in files:
            full = os.path.join(dirpath, name)
            assert not os.path.islink(full), full
            with open(full, "rb") as f:
                found[os.path.relpath(full, top)] = f.read()
    return found


def package_files() -> dict[str, bytes]:
    return {k: v for k, v in tree_bytes(PACKAGE_SKILL).items() if "__pycache__" not in k}


def tar_gz(members) -> bytes:
    """members: (name, kind, data-or-linkname)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                info.type = {"symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE,
                             "chr": tarfile.CHRTYPE}[kind]
                info.linkname = payload or ""
                tar.addfile(info)
    return buffer.getvalue()


def snapshot(top: str) -> dict:
    """Every path under `top` with its bytes (files) or None (directories)."""
    seen = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs:
            seen[os.path.relpath(os.path.join(dirpath, name), top)] = None
        for name in files:
            full = os.path.join(dirpath, name)
            seen[os.path.relpath(full, top)] = os.readlink(full) if os.path.islink(full) else open(full, "rb").read()
    return seen


# --- the core, without a server ------------------------------------------------------------


def test_front_matter_of_the_builtin_skill():
    with open(os.path.join(PACKAGE_SKILL, "SKILL.md")) as f:
        meta = library.parse_front_matter(f.read())
    assert meta["name"] == SKILL and meta["metadata"] == {"default_enabled": True}
    assert meta["description"].startswith("Run Python in a live, stateful Jupyter kernel")
    info = Builtins().info[SKILL]
    assert info.default_enabled is True


def test_front_matter_subset():
    meta = library.parse_front_matter(
        "---\n# a comment\nname: 'it''s'\ndescription: \"two\\nlines\"\nlicense: MIT # trailing\n"
        "metadata:\n  default_enabled: false\n  owner: ops\n---\nbody\n"
    )
    assert meta == {"name": "it's", "description": "two\nlines", "license": "MIT",
                    "metadata": {"default_enabled": False, "owner": "ops"}}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("# no front matter\n", "no YAML front matter"),
        ("---\nname: x\n", "not closed"),
        ("---\nname x\n---\n", "is not `key: value`"),
        ("---\n  name: x\n---\n", "indented under no key"),
        ("---\nname: [a, b]\n---\n", "not a plain string"),
        ("---\nname: a\nname: b\n---\n", "twice"),
        ("---\nname: 'open\n---\n", "unterminated"),
    ],
)
def test_front_matter_refusals_name_the_problem(text, words):
    with pytest.raises(library.GatewayError) as refused:
        library.parse_front_matter(text)
    assert refused.value.code == "invalid_skill" and words in refused.value.message


@pytest.mark.parametrize(
    ("files", "status", "words"),
    [
        ({"README.md": b"x"}, 400, "no SKILL.md"),
        ({"SKILL.md": b"just text\n"}, 400, "no YAML front matter"),
        ({"SKILL.md": b"---\nname: other\ndescription: d\n---\n"}, 400, "names the skill 'other'"),
        ({"SKILL.md": b"---\ndescription: d\n---\n"}, 400, "has no name"),
        ({"SKILL.md": b"---\nname: csv-tools\n---\n"}, 400, "has no description"),
        ({"SKILL.md": GOOD_SKILL_MD.encode(), "../escape.py": b""}, 400, "contains '..'"),
        ({"SKILL.md": GOOD_SKILL_MD.encode(), "/etc/x": b""}, 400, "is absolute"),
        ({"SKILL.md": GOOD_SKILL_MD.encode(), "a//b": b""}, 400, "not a plain relative path"),
        ({"SKILL.md": GOOD_SKILL_MD.encode(), "big.bin": b"0" * (library.MAX_SKILL_FILE + 1)}, 413, "at most"),
        ({"SKILL.md": GOOD_SKILL_MD.encode(), "a": b"", "a/b": b""}, 400, "both a file and a directory"),
    ],
)
def test_bad_skill_files_are_refused(files, status, words):
    with pytest.raises(library.GatewayError) as refused:
        library.check_skill_files("csv-tools", files)
    assert refused.value.status == status and words in refused.value.message


def test_total_size_is_capped():
    files = {"SKILL.md": GOOD_SKILL_MD.encode()}
    files.update({f"data/{i}.bin": b"0" * library.MAX_SKILL_FILE for i in range(library.MAX_SKILL_TOTAL // library.MAX_SKILL_FILE)})
    with pytest.raises(library.GatewayError) as refused:
        library.check_skill_files("csv-tools", files)
    assert refused.value.code == "skill_too_large" and "in all" in refused.value.message


@pytest.mark.parametrize(
    ("members", "words"),
    [
        ([("SKILL.md", "symlink", "/etc/passwd")], "is a symlink"),
        ([("SKILL.md", "file", GOOD_SKILL_MD.encode()), ("x", "hardlink", "SKILL.md")], "is a hard link"),
        ([("SKILL.md", "file", GOOD_SKILL_MD.encode()), ("p", "fifo", None)], "device or FIFO"),
        ([("SKILL.md", "file", GOOD_SKILL_MD.encode()), ("d", "chr", None)], "device or FIFO"),
        ([("../SKILL.md", "file", GOOD_SKILL_MD.encode())], "contains '..'"),
        ([("/SKILL.md", "file", GOOD_SKILL_MD.encode())], "is absolute"),
    ],
)
def test_bad_tar_members_are_refused(members, words):
    with pytest.raises(library.GatewayError) as refused:
        library.files_from_tar_gz("csv-tools", tar_gz(members))
    assert refused.value.code == "invalid_skill" and words in refused.value.message


def test_a_tar_of_the_directory_itself_is_taken_from_inside_it():
    data = tar_gz([("csv-tools/SKILL.md", "file", GOOD_SKILL_MD.encode()), ("csv-tools/s/x.py", "file", b"1")])
    assert library.files_from_tar_gz("csv-tools", data) == {"SKILL.md": GOOD_SKILL_MD.encode(), "s/x.py": b"1"}


def test_an_oversized_tar_member_is_refused_before_it_is_read():
    data = tar_gz([("SKILL.md", "file", GOOD_SKILL_MD.encode()), ("big", "file", b"\0" * (library.MAX_SKILL_FILE + 1))])
    with pytest.raises(library.GatewayError) as refused:
        library.files_from_tar_gz("csv-tools", data)
    assert refused.value.status == 413


@pytest.fixture
def lib(tmp_path):
    root, state = str(tmp_path / "agents"), str(tmp_path / "state")
    workspace.create_agent_tree(root, "alice")
    lib = Library(root, state)
    lib.ensure_agent("alice")
    return lib


def test_ensure_agent_installs_the_builtin_skill_byte_identical(lib):
    installed = os.path.join(lib.agent_root("alice"), "installed-skills", SKILL)
    assert tree_bytes(installed) == package_files()
    assert not [n for n in os.listdir(os.path.dirname(installed)) if n.startswith(".")]


def test_ensure_agent_restores_a_tampered_host_copy(lib):
    installed = os.path.join(lib.agent_root("alice"), "installed-skills", SKILL)
    with open(os.path.join(installed, "SKILL.md"), "a") as f:
        f.write("tampered\n")
    with open(os.path.join(installed, "extra.md"), "w") as f:
        f.write("extra\n")
    os.unlink(os.path.join(installed, "agents", "openai.yaml"))
    os.symlink("/etc/passwd", os.path.join(installed, "agents", "openai.yaml"))
    lib.ensure_agent("alice")
    assert tree_bytes(installed) == package_files()


def test_ensure_agent_moves_aside_documents_that_are_not_plain_files(lib, tmp_path):
    top = lib.agent_root("alice")
    os.unlink(os.path.join(top, "SOUL.md"))
    os.symlink("/etc/passwd", os.path.join(top, "SOUL.md"))  # a read-only bind would follow it
    with open(os.path.join(top, "user-files", "mine"), "w") as f:
        f.write("the agent's")
    os.unlink(os.path.join(top, "MISSION.md"))
    os.link(os.path.join(top, "user-files", "mine"), os.path.join(top, "MISSION.md"))  # a second name
    lib.ensure_agent("alice")
    for name in ("SOUL.md", "MISSION.md"):
        st = os.lstat(os.path.join(top, name))
        assert os.path.isfile(os.path.join(top, name)) and not os.path.islink(os.path.join(top, name))
        assert st.st_nlink == 1 and st.st_size == 0
    assert open(os.path.join(top, "user-files", "mine")).read() == "the agent's"
    assert open("/etc/passwd").read()  # untouched, and no longer reachable as SOUL.md
    assert lib.get_document("alice", "SOUL.md")["text"] == ""


def test_an_interrupted_document_write_is_finished_at_the_next_start(lib):
    journal = os.path.join(lib.state_dir, "alice", "pending-SOUL.md")
    os.makedirs(os.path.dirname(journal), exist_ok=True)
    with open(journal, "wb") as f:
        f.write(b"# Soul\nwritten before the crash\n")
    lib.ensure_agent("alice")
    assert lib.get_document("alice", "SOUL.md")["text"] == "# Soul\nwritten before the crash\n"
    assert not os.path.exists(journal)


def test_materialize_skills_copies_the_enabled_skills_for_a_job(lib):
    files = {"SKILL.md": GOOD_SKILL_MD.encode(), "scripts/clean.py": b"print('clean')\n"}
    lib.install_skill("alice", "csv-tools", files)
    other = GOOD_SKILL_MD.replace("csv-tools", "off-skill").encode()
    lib.install_skill("alice", "off-skill", {"SKILL.md": other})
    lib.set_enabled("alice", "off-skill", False)
    top = lib.agent_root("alice")
    copied = lib.materialize_skills("alice", top, "jobs/j1/skills")
    assert copied == [SKILL, "csv-tools"]
    skills = os.path.join(top, "jobs", "j1", "skills")
    assert sorted(os.listdir(skills)) == ["csv-tools", SKILL]
    assert tree_bytes(os.path.join(skills, SKILL)) == package_files()
    assert tree_bytes(os.path.join(skills, "csv-tools")) == files
    # Narrowed: a job of this agent gets no jupyter-live-kernel either.
    lib.set_enabled("alice", SKILL, False)
    assert lib.materialize_skills("alice", top, "jobs/j2/skills") == ["csv-tools"]


def test_materialize_refuses_a_destination_that_climbs_out(lib):
    with pytest.raises(library.wp.PathOutsideRoot):
        lib.materialize_skills("alice", lib.agent_root("alice"), "../bob/skills")


def test_writes_for_the_agent_are_checked_on_what_is_opened_not_on_a_name(lib):
    """The check a route makes first can be raced (a symlink swapped in); this one cannot."""
    top = lib.agent_root("alice")
    with open(os.path.join(top, "SOUL.md"), "w") as f:
        f.write("operator's\n")
    os.symlink("../SOUL.md", os.path.join(top, "user-files", "soul"))
    os.symlink(f"../installed-skills/{SKILL}", os.path.join(top, "user-files", "skill"))
    refuse = lambda path: lib.protected("alice", path) is not None  # noqa: E731
    wp = library.wp
    for path, flags in (("user-files/soul", os.O_WRONLY | os.O_TRUNC), ("user-files/skill/new.md", os.O_WRONLY | os.O_CREAT)):
        with pytest.raises(PermissionError):
            wp.open_in_root_unless(top, path, flags, refuse)
    with pytest.raises(PermissionError):
        wp.unlink_in_root_unless(top, "user-files/skill/SKILL.md", refuse)
    assert open(os.path.join(top, "SOUL.md")).read() == "operator's\n"
    assert tree_bytes(os.path.join(top, "installed-skills", SKILL)) == package_files()
    # Everything else opens as open_in_root would.
    fd = wp.open_in_root_unless(top, "user-files/new.txt", os.O_WRONLY | os.O_CREAT | os.O_EXCL, refuse)
    os.close(fd)
    wp.unlink_in_root_unless(top, "user-files/new.txt", refuse)
    os.symlink("made.txt", os.path.join(top, "user-files", "dangling"))  # followed, beneath the root
    os.close(wp.open_in_root_unless(top, "user-files/dangling", os.O_WRONLY | os.O_CREAT, refuse))
    assert os.path.isfile(os.path.join(top, "user-files", "made.txt"))
    # apply_patch with the check, and no route in front of it: the write is refused.
    from kernel_gateway.tools import apply_patch

    patch = "*** Begin Patch\n*** Update File: user-files/soul\n@@\n-operator's\n+the agent's\n*** End Patch\n"
    result = apply_patch.apply_patch(patch, top, root=top, refuse=refuse)
    assert not result.ok and "Failed to write file" in result.output
    assert open(os.path.join(top, "SOUL.md")).read() == "operator's\n"


# --- through the real gateway ----------------------------------------------------------


GATEWAY_AGENTS = ("alice", "bob", "carol")


def run(gw, code, agent="alice", session="s1"):
    status, body = gw.client.execute(agent, session, code)
    assert status == 200, body
    return body


def command(gw, line, agent="alice"):
    status, body = gw.client.call("POST", f"/v1/agents/{agent}/commands", {"command": line})
    assert status == 200, body
    return body


def skill_dir(gw, agent="alice"):
    return os.path.join(gw.root, agent, "installed-skills", SKILL)


def test_a_new_agent_has_the_builtin_skill_byte_identical_to_the_package(gw):
    assert tree_bytes(skill_dir(gw)) == package_files()
    # ... and inside its sandboxes, kernel and command alike.
    digests = {path: hashlib.sha256(data).hexdigest() for path, data in package_files().items()}
    listing = command(gw, f"cd {skill_dir(gw)} && find . -type f | sort | xargs sha256sum")["stdout"]
    assert {line.split()[1][2:]: line.split()[0] for line in listing.splitlines()} == digests
    inside = run(gw, f"print(open({os.path.join(skill_dir(gw), 'SKILL.md')!r}, 'rb').read() == "
                     f"{package_files()['SKILL.md']!r})")
    assert inside["text"] == "True\n"


ATTEMPTS = {
    "write": "echo x >> {d}/SKILL.md",
    "replace": "echo x > {d}/agents/openai.yaml",
    "add": "touch {d}/new.md",
    "delete": "rm -f {d}/SKILL.md",
    "rename the skill": "mv {d} {d}.moved",
    "rename installed-skills": "mv {top}/installed-skills {top}/moved-skills",
    "remove the tree": "rm -rf {d}",
    "chmod": "chmod 777 {d}/SKILL.md",
    "add a user skill": "mkdir {top}/installed-skills/mine",
    "write a document": "echo x >> {top}/SOUL.md",
    "replace a document": "mv {top}/MISSION.md {top}/user-files/m",
    "delete a document": "rm -f {top}/DESIGN.md",
}


def assert_read_only_mounts(gw, agent, paths):
    """Each path is a read-only mount inside the agent's sandbox (whatever refuses a write first)."""
    mounts = command(gw, "cat /proc/self/mountinfo", agent=agent)["stdout"]
    options = {line.split()[4]: line.split()[5].split(",") for line in mounts.splitlines()}
    for path in paths:
        assert "ro" in options.get(path, []), (path, options.get(path))


def test_the_library_is_mounted_read_only_in_every_sandbox(gw):
    top = os.path.join(gw.root, "alice")
    assert_read_only_mounts(
        gw, "alice", [os.path.join(top, "installed-skills"), skill_dir(gw)] + [os.path.join(top, n) for n in ("SOUL.md", "MISSION.md", "DESIGN.md")]
    )
    mounts = run(gw, "print(open('/proc/self/mountinfo').read())")["text"]
    options = {line.split()[4]: line.split()[5].split(",") for line in mounts.splitlines() if line.strip()}
    assert "ro" in options[skill_dir(gw)] and "ro" in options[os.path.join(top, "SOUL.md")]


@pytest.mark.parametrize("what", sorted(ATTEMPTS))
def test_the_agent_cannot_change_its_library_from_a_command(gw, what):
    before = snapshot(os.path.join(gw.root, "alice"))
    line = ATTEMPTS[what].format(d=skill_dir(gw), top=os.path.join(gw.root, "alice"))
    result = command(gw, line + "; echo rc=$?")
    assert "rc=0" not in result["stdout"], result
    # The sandbox runs as the agent's own uid: files of the operator's also refuse by ownership first.
    assert any(why in result["stderr"] for why in ("Read-only file system", "busy", "Permission denied")), result
    after = snapshot(os.path.join(gw.root, "alice"))
    assert {k: v for k, v in after.items() if not k.startswith(".kernel-gateway")} == {
        k: v for k, v in before.items() if not k.startswith(".kernel-gateway")}


def test_the_agent_cannot_change_its_library_from_a_kernel(gw):
    top = os.path.join(gw.root, "alice")
    code = f"""
import os, shutil
errors = []
d = {skill_dir(gw)!r}
for attempt in (
    lambda: open(d + '/SKILL.md', 'a').write('x'),
    lambda: os.rename(d, d + '.moved'),
    lambda: os.rename(os.path.dirname(d), {top!r} + '/elsewhere'),
    lambda: shutil.rmtree(d),
    lambda: os.unlink(d + '/SKILL.md'),
    lambda: open({top!r} + '/SOUL.md', 'w'),
    lambda: os.rename({top!r} + '/SOUL.md', {top!r} + '/user-files/soul'),
    lambda: os.symlink('/etc/passwd', d + '/evil'),
):
    try:
        attempt()
        errors.append('allowed')
    except OSError as e:
        errors.append(e.errno)
print(errors)
"""
    import errno
    text = run(gw, code)["text"]
    assert "allowed" not in text, text
    assert set(eval(text)) <= {errno.EROFS, errno.EBUSY, errno.EACCES}, text
    assert tree_bytes(skill_dir(gw)) == package_files()
    assert open(os.path.join(top, "SOUL.md")).read() == ""


def test_host_side_tools_of_the_agent_cannot_write_its_library(gw):
    before = snapshot(os.path.join(gw.root, "alice"))
    for patch in (
        "*** Begin Patch\n*** Delete File: SOUL.md\n*** End Patch\n",
        "*** Begin Patch\n*** Add File: installed-skills/mine/SKILL.md\n+x\n*** End Patch\n",
        f"*** Begin Patch\n*** Update File: installed-skills/{SKILL}/SKILL.md\n@@\n-name: {SKILL}\n+name: evil\n*** End Patch\n",
        "*** Begin Patch\n*** Add File: user-files/a.txt\n+a\n*** Update File: user-files/a.txt\n*** Move to: MISSION.md\n@@\n-a\n+b\n*** End Patch\n",
    ):
        status, body = gw.agent_client("alice").call("POST", "/v1/agents/me/patch", raw=patch.encode(),
                                                     headers={"Content-Type": "text/plain"})
        assert status == 403 and body["error"]["code"] == "read_only_path", body
    # A relative symlink the agent made into its library is resolved, and refused too.
    command(gw, "ln -sfn ../SOUL.md user-files/soul-link")
    patch = "*** Begin Patch\n*** Update File: user-files/soul-link\n@@\n+x\n*** End Patch\n"
    status, body = gw.client.call("POST", "/v1/agents/alice/patch", raw=patch.encode())
    assert status == 403 and body["error"]["code"] == "read_only_path"
    nb = {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    status, body = gw.client.call("PUT", f"/v1/agents/alice/notebooks/installed-skills/{SKILL}/x.ipynb", nb)
    assert status == 403 and body["error"]["code"] == "read_only_path"
    os.unlink(os.path.join(gw.root, "alice", "user-files", "soul-link"))
    after = snapshot(os.path.join(gw.root, "alice"))
    assert {k: v for k, v in after.items() if not k.startswith(".kernel-gateway")} == {
        k: v for k, v in before.items() if not k.startswith(".kernel-gateway")}


def test_skills_list_on_both_sockets(gw):
    expected = {
        "name": SKILL,
        "description": Builtins().info[SKILL].description,
        "builtin": True,
        "default_enabled": True,
        "enabled": True,
        "path": skill_dir(gw, "bob"),
    }
    assert gw.client.call("GET", "/v1/agents/bob/skills") == (200, {"skills": [expected]})
    assert gw.agent_client("bob").call("GET", "/v1/agents/me/skills") == (200, {"skills": [expected]})
    assert gw.client.call("GET", f"/v1/agents/bob/skills/{SKILL}") == (200, expected)


def jlk(gw, agent, *args):
    """jlk inside the agent's own command sandbox, as the agent runs it."""
    line = "jlk " + " ".join(args) + "; echo rc=$?"
    return command(gw, line, agent=agent)


KERNEL_ROUTES = [
    ("POST", "/sessions", {"session": "fresh"}),
    ("POST", "/sessions/s1/execute", {"code": "1"}),
    ("POST", "/sessions/new-one/execute", {"code": "1"}),
    ("POST", "/sessions/s1/interrupt", {}),
    ("POST", "/sessions/s1/restart", {}),
    ("GET", "/sessions/s1/variables", None),
    ("GET", "/sessions/s1/variables/x", None),
    ("POST", "/notebooks/user-files/n.ipynb/cells/c1/execute", {}),
    ("POST", "/notebooks/user-files/n.ipynb/run-all", {}),
    ("POST", "/notebooks/user-files/n.ipynb/run-all", {"restart": True}),
]


def test_disabling_the_kernel_skill_narrows_one_agent_and_enabling_restores_it(gw):
    c = gw.client
    nb = {"cells": [{"cell_type": "code", "id": "c1", "source": "x = 1", "metadata": {}, "outputs": [],
                     "execution_count": None}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    assert c.call("PUT", "/v1/agents/carol/notebooks/user-files/n.ipynb", nb)[0] == 201
    assert run(gw, "x = 5", agent="carol")["status"] == "ok"
    assert run(gw, "y = 1", agent="carol", session="s2")["status"] == "ok"
    assert run(gw, "z = 1", agent="bob")["status"] == "ok"
    pids = [s["pid"] for s in c.call("GET", "/v1/agents/carol/sessions")[1]["sessions"]]
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    bob_pid = c.call("GET", "/v1/agents/bob/sessions/s1")[1]["pid"]

    status, body = c.call("PATCH", f"/v1/agents/carol/skills/{SKILL}", {"enabled": False})
    assert status == 200 and body["enabled"] is False and body["default_enabled"] is True
    # Its kernels are shut down, its spare is not kept.
    assert wait_until(lambda: not any(pid_alive(p) for p in pids))
    carol = c.call("GET", "/v1/agents/carol")[1]
    assert carol["sessions"] == [] and carol["spare_kernel_ready"] is False

    for method, route, body in KERNEL_ROUTES:
        for client, agent in ((c, "carol"), (gw.agent_client("carol"), "me")):
            status, answer = client.call(method, f"/v1/agents/{agent}{route}", body)
            assert status == 403, (route, answer)
            error = answer["error"]
            assert error["code"] == "skill_disabled" and SKILL in error["message"], error
            assert f'PATCH /v1/agents/carol/skills/{SKILL} {{"enabled": true}}' in error["hint"]

    # jlk says so, with its own exit code.
    result = jlk(gw, "carol", "execute", "--code", "'1 + 1'")
    assert "rc=5" in result["stdout"]
    assert "jupyter-live-kernel skill is disabled" in result["stderr"] and "hint: " in result["stderr"]
    listed = jlk(gw, "carol", "skills")["stdout"]
    assert listed.splitlines()[0].split() == ["name", "builtin", "enabled", "description"]
    assert listed.splitlines()[1].split()[:3] == [SKILL, "yes", "no"]

    # The computer tools and notebook editing keep working.
    assert command(gw, "echo hi > user-files/a.txt && cat user-files/a.txt", agent="carol")["stdout"] == "hi\n"
    assert c.call("GET", "/v1/agents/carol/files?path=user-files/a.txt")[1]["content"].startswith("hi")
    patch = "*** Begin Patch\n*** Update File: user-files/a.txt\n@@\n-hi\n+ho\n*** End Patch\n"
    assert c.call("POST", "/v1/agents/carol/patch", raw=patch.encode())[1]["ok"] is True
    status, body = c.call("PATCH", "/v1/agents/carol/notebooks/user-files/n.ipynb/cells/c1", {"source": "x = 2"})
    assert status == 200, body
    status, body = c.call("POST", "/v1/agents/carol/notebooks/user-files/n.ipynb/cells", {"index": 1, "source": "x"})
    assert status == 201, body
    assert [cell["source"] for cell in c.call("GET", "/v1/agents/carol/notebooks/user-files/n.ipynb")[1]["cells"]] == [
        "x = 2", "x"]
    # No spare came back meanwhile, and another agent is untouched.
    assert c.call("GET", "/v1/agents/carol")[1]["spare_kernel_ready"] is False
    assert pid_alive(bob_pid) and run(gw, "z + 1", agent="bob")["text"] == "2\n"
    assert c.call("GET", "/v1/agents/bob/skills")[1]["skills"][0]["enabled"] is True

    status, body = c.call("PATCH", f"/v1/agents/carol/skills/{SKILL}", {"enabled": True})
    assert status == 200 and body["enabled"] is True
    assert run(gw, "x = 3; x * 2", agent="carol")["text"] == "6\n"
    status, body = c.call("POST", "/v1/agents/carol/notebooks/user-files/n.ipynb/run-all", {})
    assert status == 200 and body["status"] == "ok", body
    assert "rc=0" in jlk(gw, "carol", "execute", "--code", "'1 + 1'")["stdout"]


def test_user_skill_install_list_disable_replace_remove(gw):
    c = gw.client
    files = {"SKILL.md": GOOD_SKILL_MD, "scripts/clean.py": "print('clean')\n"}
    status, body = c.call("PUT", "/v1/agents/bob/skills/csv-tools", {"files": files})
    assert status == 201, body
    installed = os.path.join(gw.root, "bob", "installed-skills", "csv-tools")
    assert body == {"name": "csv-tools", "description": "Read and clean CSV files.", "builtin": False,
                    "default_enabled": True, "enabled": True, "path": installed}
    assert tree_bytes(installed) == {k: v.encode() for k, v in files.items()}
    names = [s["name"] for s in c.call("GET", "/v1/agents/bob/skills")[1]["skills"]]
    assert names == [SKILL, "csv-tools"]
    # Read-only to the agent, like the builtin one (and the operator's file, not the agent's).
    refused = command(gw, f"echo x >> {installed}/SKILL.md", agent="bob")["stderr"]
    assert "Read-only" in refused or "Permission denied" in refused, refused
    assert_read_only_mounts(gw, "bob", [os.path.join(gw.root, "bob", "installed-skills")])

    status, body = c.call("PATCH", "/v1/agents/bob/skills/csv-tools", {"enabled": False})
    assert status == 200 and body["enabled"] is False
    listed = jlk(gw, "bob", "skills")["stdout"].splitlines()
    assert listed[2].split()[:3] == ["csv-tools", "no", "no"]

    # Replaced by a tar.gz, here of the directory itself; the old files go.
    data = tar_gz([("csv-tools/SKILL.md", "file", GOOD_SKILL_MD.replace("Read", "Parse").encode()),
                   ("csv-tools/README.md", "file", b"readme\n")])
    status, body = c.call("PUT", "/v1/agents/bob/skills/csv-tools", raw=data,
                          headers={"Content-Type": "application/gzip"})
    assert status == 200 and body["description"] == "Parse and clean CSV files." and body["enabled"] is False
    assert sorted(tree_bytes(installed)) == ["README.md", "SKILL.md"]

    status, body = c.call("DELETE", "/v1/agents/bob/skills/csv-tools")
    assert status == 200 and not os.path.exists(installed)
    assert [s["name"] for s in c.call("GET", "/v1/agents/bob/skills")[1]["skills"]] == [SKILL]
    assert sorted(os.listdir(os.path.dirname(installed))) == [SKILL]


BAD_SKILLS = [
    # (name, body as JSON or bytes, status, code, words)
    ("csv-tools", {"files": {"SKILL.md": "no front matter\n"}}, 400, "invalid_skill", "no YAML front matter"),
    ("csv-tools", {"files": {"SKILL.md": GOOD_SKILL_MD.replace("csv-tools", "other")}}, 400, "invalid_skill",
     "names the skill 'other'"),
    ("csv-tools", {"files": {"SKILL.md": GOOD_SKILL_MD, "../x.py": "1"}}, 400, "invalid_skill", "contains '..'"),
    ("csv-tools", {"files": {"SKILL.md": GOOD_SKILL_MD, "big": "x" * (library.MAX_SKILL_FILE + 1)}}, 413,
     "skill_too_large", "at most"),
    ("csv-tools", tar_gz([("SKILL.md", "file", GOOD_SKILL_MD.encode()), ("s", "symlink", "/etc/passwd")]), 400,
     "invalid_skill", "is a symlink"),
    ("csv-tools", b"\x1f\x8bnot really gzip", 400, "invalid_skill", "not a readable tar.gz"),
    ("csv-tools", {"files": {"SKILL.md": 7}}, 400, "wrong_type", "must be a string"),
    ("csv-tools", {"files": {}, "extra": 1}, 400, "invalid_body", '{"files"'),
    ("csv-tools", b"{not json", 400, "malformed_json", "not valid JSON"),
    ("Bad_Name", {"files": {"SKILL.md": GOOD_SKILL_MD}}, 400, "invalid_skill_name", "invalid skill name"),
    (SKILL, {"files": {"SKILL.md": GOOD_SKILL_MD.replace("csv-tools", SKILL)}}, 403, "builtin_skill",
     "cannot be replaced"),
]


@pytest.mark.parametrize(("name", "body", "status", "code", "words"), BAD_SKILLS,
                         ids=[f"{case[3]}:{case[4]}" for case in BAD_SKILLS])
def test_bad_skills_are_refused_naming_the_problem_and_write_nothing(gw, name, body, status, code, words):
    top = os.path.join(gw.root, "bob")
    before = snapshot(top)
    settings_before = gw.client.call("GET", "/v1/agents/bob/skills")[1]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = gw.client.call("PUT", f"/v1/agents/bob/skills/{name}", raw=raw)
    assert got == status, answer
    assert answer["error"]["code"] == code and words in answer["error"]["message"], answer
    assert snapshot(top) == before
    assert gw.client.call("GET", "/v1/agents/bob/skills")[1] == settings_before


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("PATCH", f"/v1/agents/bob/skills/{SKILL}", {"enabled": "no"}, 400, "wrong_type"),
        ("PATCH", f"/v1/agents/bob/skills/{SKILL}", {}, 400, "missing_field"),
        ("PATCH", f"/v1/agents/bob/skills/{SKILL}", {"enabled": True, "x": 1}, 400, "unknown_field"),
        ("PATCH", "/v1/agents/bob/skills/nope", {"enabled": False}, 404, "unknown_skill"),
        ("DELETE", "/v1/agents/bob/skills/nope", None, 404, "unknown_skill"),
        ("DELETE", f"/v1/agents/bob/skills/{SKILL}", None, 403, "builtin_skill"),
        ("GET", "/v1/agents/nobody/skills", None, 404, "unknown_agent"),
        ("PUT", "/v1/agents/nobody/skills/csv-tools", {"files": {"SKILL.md": GOOD_SKILL_MD}}, 404, "unknown_agent"),
        ("GET", "/v1/agents/bob/documents/NOTES.md", None, 404, "unknown_document"),
        ("PUT", "/v1/agents/bob/documents/../SOUL.md", None, 404, "no_route"),
    ],
)
def test_bad_library_requests_change_nothing(gw, method, path, body, status, code):
    before = snapshot(os.path.join(gw.root, "bob"))
    listed = gw.client.call("GET", "/v1/agents/bob/skills")[1]
    got, answer = gw.client.call(method, path, body)
    assert got == status and answer["error"]["code"] == code, answer
    assert snapshot(os.path.join(gw.root, "bob")) == before
    assert gw.client.call("GET", "/v1/agents/bob/skills")[1] == listed


def test_the_library_is_read_only_on_the_agent_socket(gw):
    bob = gw.agent_client("bob")
    before = snapshot(os.path.join(gw.root, "bob"))
    for method, path, body in (
        ("PUT", "/v1/agents/me/skills/csv-tools", {"files": {"SKILL.md": GOOD_SKILL_MD}}),
        ("PATCH", f"/v1/agents/me/skills/{SKILL}", {"enabled": False}),
        ("DELETE", f"/v1/agents/me/skills/{SKILL}", None),
        ("PUT", "/v1/agents/me/documents/SOUL.md", {"text": "I am free"}),
    ):
        status, answer = bob.call(method, path, body, headers={"Content-Type": "application/json"})
        assert status == 403 and answer["error"]["code"] == "read_only_library", answer
    status, answer = bob.call("PUT", "/v1/agents/me", {"documents": {"SOUL.md": "I am free"}})
    assert status == 403 and answer["error"]["code"] == "forbidden"
    assert bob.call("GET", "/v1/agents/me/documents/SOUL.md")[0] == 200
    assert snapshot(os.path.join(gw.root, "bob")) == before
    assert gw.client.call("GET", f"/v1/agents/bob/skills/{SKILL}")[1]["enabled"] is True


def test_documents_round_trip_with_etags(gw):
    c = gw.client
    status, body = c.call("GET", "/v1/agents/bob/documents/MISSION.md")
    assert status == 200 and body["text"] == "" and body["bytes"] == 0
    empty_etag = body["etag"]
    text = "# Mission\nKeep the reports correct.\n"
    status, put = c.call("PUT", "/v1/agents/bob/documents/MISSION.md", raw=text.encode(),
                         headers={"If-Match": empty_etag, "Content-Type": "text/markdown"})
    assert status == 200 and put["bytes"] == len(text)
    status, got = c.call("GET", "/v1/agents/bob/documents/MISSION.md")
    assert got["text"] == text and got["etag"] == put["etag"] != empty_etag
    assert open(os.path.join(gw.root, "bob", "MISSION.md")).read() == text
    # Readable by the agent in its tree, through the agent socket too.
    assert command(gw, "cat MISSION.md", agent="bob")["stdout"] == text
    assert gw.agent_client("bob").call("GET", "/v1/agents/me/documents/MISSION.md")[1]["text"] == text
    # A running kernel sees the new text at once, and still cannot write it.
    path = os.path.join(gw.root, "bob", "MISSION.md")
    assert run(gw, f"open({path!r}).read()", agent="bob", session="doc")["status"] == "ok"
    c.call("PUT", "/v1/agents/bob/documents/MISSION.md", {"text": "v3\n"}, headers={"Content-Type": "application/json"})
    seen = run(gw, f"print(open({path!r}).read(), end='')\ntry:\n    open({path!r}, 'a')\nexcept OSError as e:\n"
                   f"    print(e.strerror)", agent="bob", session="doc")
    # Refused by the root-owned file before the read-only mount is reached (both hold; the
    # mount is checked on its own in test_the_library_is_mounted_read_only_in_every_sandbox).
    assert seen["text"] in ("v3\nRead-only file system\n", "v3\nPermission denied\n"), seen

    # A stale If-Match: 409, the file untouched.
    status, body = c.call("PUT", "/v1/agents/bob/documents/MISSION.md", raw=b"lost update",
                          headers={"If-Match": put["etag"]})
    assert status == 409 and body["error"]["code"] == "stale_etag"
    assert open(path).read() == "v3\n"


@pytest.mark.parametrize(
    ("raw", "headers", "status", "code"),
    [
        (b"\xff\xfe", {}, 400, "not_utf8"),
        (b"x" * (library.MAX_DOCUMENT + 1), {}, 413, "document_too_large"),
        (b'{"txt": "x"}', {"Content-Type": "application/json"}, 400, "unknown_field"),
        (b'["x"]', {"Content-Type": "application/json"}, 400, "malformed_json"),
    ],
)
def test_bad_document_writes_change_nothing(gw, raw, headers, status, code):
    path = os.path.join(gw.root, "bob", "DESIGN.md")
    before = open(path, "rb").read()
    got, body = gw.client.call("PUT", "/v1/agents/bob/documents/DESIGN.md", raw=raw, headers=headers)
    assert got == status and body["error"]["code"] == code, body
    assert open(path, "rb").read() == before


def test_an_agent_is_created_with_its_documents_in_one_call(gw):
    c = gw.client
    docs = {"SOUL.md": "# Soul\nCareful.\n", "DESIGN.md": "# Design\nQuiet colours.\n"}
    status, body = c.call("PUT", "/v1/agents/dora", {"documents": docs})
    assert status == 201, body
    for name, text in docs.items():
        assert c.call("GET", f"/v1/agents/dora/documents/{name}")[1]["text"] == text
    assert c.call("GET", "/v1/agents/dora/documents/MISSION.md")[1]["text"] == ""
    # Refused before anything is created.
    for bad, code in (({"documents": {"NOTES.md": "x"}}, "unknown_document"),
                      ({"documents": {"SOUL.md": 1}}, "wrong_type"),
                      ({"documents": ["SOUL.md"]}, "wrong_type"),
                      ({"docs": {}}, "unknown_field")):
        status, body = c.call("PUT", "/v1/agents/erin", bad)
        assert 400 <= status < 500 and body["error"]["code"] == code, body
        assert not os.path.exists(os.path.join(gw.root, "erin"))
        assert c.call("GET", "/v1/agents/erin")[0] == 404


def test_everything_survives_a_gateway_restart(tmp_path):
    gateway = GatewayProcess(tmp_path).start()
    try:
        c = gateway.client
        assert c.call("PUT", "/v1/agents/alice", {"documents": {"SOUL.md": "kept\n"}})[0] == 201
        assert c.call("PUT", "/v1/agents/alice/skills/csv-tools", {"files": {"SKILL.md": GOOD_SKILL_MD}})[0] == 201
        assert c.call("PATCH", "/v1/agents/alice/skills/csv-tools", {"enabled": False})[0] == 200
        assert c.call("PATCH", f"/v1/agents/alice/skills/{SKILL}", {"enabled": False})[0] == 200
    finally:
        gateway.stop()
    # A newer package, or a copy changed behind the gateway's back: made right at start.
    installed = os.path.join(gateway.root, "alice", "installed-skills", SKILL)
    with open(os.path.join(installed, "SKILL.md"), "w") as f:
        f.write("an older version\n")
    gateway = GatewayProcess(tmp_path).start()
    try:
        c = gateway.client
        assert tree_bytes(installed) == package_files()
        skills = {s["name"]: s["enabled"] for s in c.call("GET", "/v1/agents/alice/skills")[1]["skills"]}
        assert skills == {SKILL: False, "csv-tools": False}
        assert c.call("GET", "/v1/agents/alice/documents/SOUL.md")[1]["text"] == "kept\n"
        status, body = c.execute("alice", "s1", "1")
        assert status == 403 and body["error"]["code"] == "skill_disabled"
        assert c.call("PATCH", f"/v1/agents/alice/skills/{SKILL}", {"enabled": True})[0] == 200
        assert c.execute("alice", "s1", "40 + 2")[1]["text"] == "42\n"
    finally:
        gateway.stop()


def test_the_package_ships_the_skill_as_package_data(tmp_path):
    """A wheel (a non-editable install) holds the builtin skill the gateway installs."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "wheel"
    subprocess.run(
        [os.path.join(os.path.dirname(os.sys.executable), "pip"), "wheel", "--no-deps",
         "-q", "-w", str(out), repo],
        check=True, capture_output=True, cwd=tmp_path,
    )
    import zipfile

    (wheel,) = out.iterdir()
    with zipfile.ZipFile(wheel) as z:
        shipped = {n[len("kernel_gateway/builtin_skills/jupyter-live-kernel/"):]: z.read(n) for n in z.namelist()
                   if n.startswith("kernel_gateway/builtin_skills/jupyter-live-kernel/")}
    assert shipped == package_files()


def agent_processes(root: str) -> list[int]:
    """Pids of sandboxes (bwrap and what runs in it) whose command line names this agent's tree."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if root.encode() in f.read() and pid_alive(int(pid)):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_a_kernel_starting_while_the_skill_is_disabled_does_not_outlive_the_switch(gw):
    import threading

    c = gw.client
    assert c.call("PUT", "/v1/agents/frank")[0] == 201
    root = os.path.join(gw.root, "frank")
    answers = []
    thread = threading.Thread(target=lambda: answers.append(c.execute("frank", "s1", "1")))
    thread.start()
    assert wait_until(lambda: agent_processes(root), interval=0.01)  # its kernel is starting
    assert c.call("PATCH", f"/v1/agents/frank/skills/{SKILL}", {"enabled": False})[0] == 200
    thread.join(60)
    (status, body), = answers
    assert status in (200, 403), body  # the cell died with its kernel, or the start was refused
    assert wait_until(lambda: not agent_processes(root))
    assert c.call("GET", "/v1/agents/frank")[1]["sessions"] == []
