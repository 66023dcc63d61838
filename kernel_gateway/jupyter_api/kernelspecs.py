"""The kernelspec models of the Jupyter Server API: the gateway's one sandboxed Python kernel.

The spec is the gateway's own (``<state>/kernels/python3``), shown without
host paths or provisioner settings: clients need its display name, language
and metadata, not how the sandbox is built.  Resources are whatever logo,
``kernel.js`` and ``kernel.css`` files that directory holds, as
jupyter_server's ``kernelspec_model`` lists them.
"""

from __future__ import annotations

import json
import mimetypes
import os

from ..errors import not_found
from ..kernels import KERNEL_NAME

RESOURCE_CAP = 1 << 20  # a logo is small; anything bigger is not served


def _resource_names(spec_dir: str) -> list[str]:
    try:
        names = os.listdir(spec_dir)
    except FileNotFoundError:
        return []
    return sorted(
        n for n in names
        if (n.startswith("logo-") or n in ("kernel.js", "kernel.css"))
        and os.path.isfile(os.path.join(spec_dir, n)) and not os.path.islink(os.path.join(spec_dir, n))
    )


class KernelSpecs:
    """Models of ``GET /api/kernelspecs`` and the files of ``GET /kernelspecs/{name}/{resource}``."""

    def __init__(self, kernelspec_dir: str):
        self.spec_dir = os.path.join(kernelspec_dir, KERNEL_NAME)

    def _spec(self) -> dict:
        with open(os.path.join(self.spec_dir, "kernel.json")) as f:
            spec = json.load(f)
        metadata = {k: v for k, v in spec.get("metadata", {}).items() if k != "kernel_provisioner"}
        return {
            "argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": spec.get("display_name", "Python 3 (sandboxed)"),
            "language": spec.get("language", "python"),
            "interrupt_mode": spec.get("interrupt_mode", "message"),
            "env": {},
            "metadata": metadata,
        }

    def model(self, name: str, base_url: str) -> dict:
        self._check(name)
        resources = {}
        for fname in _resource_names(self.spec_dir):
            key = os.path.splitext(fname)[0] if fname.startswith("logo-") else fname
            resources[key] = f"{base_url}kernelspecs/{name}/{fname}"
        return {"name": name, "spec": self._spec(), "resources": resources}

    def all(self, base_url: str) -> dict:
        return {"default": KERNEL_NAME, "kernelspecs": {KERNEL_NAME: self.model(KERNEL_NAME, base_url)}}

    def resource(self, name: str, resource: str) -> tuple[bytes, str]:
        """(bytes, content type) of one listed resource file."""
        self._check(name)
        if resource not in _resource_names(self.spec_dir):
            raise not_found(f"kernelspec {name!r} has no resource {resource!r}", code="unknown_resource")
        path = os.path.join(self.spec_dir, resource)
        with open(path, "rb") as f:
            data = f.read(RESOURCE_CAP + 1)
        if len(data) > RESOURCE_CAP:
            raise not_found(f"resource {resource!r} is too large to serve", code="unknown_resource")
        return data, mimetypes.guess_type(resource)[0] or "application/octet-stream"

    @staticmethod
    def _check(name: str) -> None:
        if name != KERNEL_NAME:
            raise not_found(f"no kernelspec {name!r}", f"available: {KERNEL_NAME}", code="unknown_kernelspec")
