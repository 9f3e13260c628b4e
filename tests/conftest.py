import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def stdlib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in corpus prepared with the byte tokenizer, once per session (read only)."""
    # Imported here: test_kernels must set TRITON_INTERPRET before anything imports Triton.
    from hpcllm.datasets.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("data") / "stdlib"
    prepare(PrepareOptions(out=out, corpus="python-stdlib", tokenizer="byte"), progress=False)
    return out
