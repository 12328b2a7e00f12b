"""``import kvoff`` never needs vLLM; ``import kvoff.vllm`` says which vLLM it needs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def test_import_kvoff_without_vllm_modules() -> None:
    code = "import sys, kvoff; assert 'vllm' not in sys.modules and 'kvoff.vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(_vllm_installed(), reason="vLLM is installed here; this checks the error without it")
def test_import_kvoff_vllm_without_vllm_names_supported_versions() -> None:
    with pytest.raises(ImportError, match=r">=0\.33,<0\.34") as ei:
        import kvoff.vllm  # noqa: F401
    assert "not installed" in str(ei.value)
