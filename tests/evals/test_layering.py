"""jaxlp.evals is the top layer, and the optional-dependency modules are imported only on demand."""

import re
import subprocess
import sys
from pathlib import Path

import jaxlp

PACKAGES = ("jaxlp", "jaxlp.models", "jaxlp.testbed", "jaxlp.sampling", "jaxlp.kvcache", "jaxlp.quantization",
            "jaxlp.generation", "jaxlp.data")


def test_the_library_does_not_import_evals_gguf_or_training():
    code = (f"import sys; import {', '.join(PACKAGES)}; "
            "print(sorted(m for m in sys.modules if m.startswith(('jaxlp.evals', 'jaxlp.models.gguf', "
            "'jaxlp.testbed.training'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_no_module_outside_evals_imports_it():
    """(The command line may, later.)"""
    imports = re.compile(r"^\s*(from jaxlp\.evals|import jaxlp\.evals|from jaxlp import .*\bevals\b)", re.M)
    root = Path(jaxlp.__file__).parent
    users = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if not {"evals", "cli"} & set(p.relative_to(root).parts) and imports.search(p.read_text())]
    assert users == []
