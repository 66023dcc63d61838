"""The kernelspec ships its logos: JupyterLab's launcher shows them instead of a bare letter."""

from __future__ import annotations

import os
import struct
import subprocess

from jupyter_client.kernelspec import KernelSpecManager

from kernel_gateway.kernels import LOGO_FILES, write_kernelspec
from support import BIN


def png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def check_logos(spec_dir: str) -> None:
    assert png_size(os.path.join(spec_dir, "logo-32x32.png")) == (32, 32)
    assert png_size(os.path.join(spec_dir, "logo-64x64.png")) == (64, 64)
    with open(os.path.join(spec_dir, "logo-svg.svg")) as f:
        assert f.read().startswith("<svg ")


def test_install_kernelspec_installs_the_logos(tmp_path):
    result = subprocess.run([os.path.join(BIN, "kernel-gateway"), "install-kernelspec", "--prefix", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    spec_dir = tmp_path / "share" / "jupyter" / "kernels" / "python3-sandboxed"
    check_logos(str(spec_dir))
    # jupyter_server offers the logo-* files of the kernelspec's resource directory.
    found = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)]).get_all_specs()["python3-sandboxed"]
    assert set(LOGO_FILES) <= set(os.listdir(found["resource_dir"]))


def test_the_gateways_own_kernelspec_has_the_logos(tmp_path):
    kernels = write_kernelspec(str(tmp_path))
    check_logos(os.path.join(kernels, "python3"))
