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


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short documents (3 to 40 characters, byte tokenizer), several to a 32-token sample, so
    that the document masks (data.reset_attention_at_eos, data.mask_eod_loss) act often."""
    import json
    import random

    from hpcllm.datasets.prepare import PrepareOptions, prepare

    root = tmp_path_factory.mktemp("short-docs")
    words = ["def", "x", "return", "the", "a", "loop", "(", ")", ":", "=", "1", "if", "else"]
    draw = random.Random(0)
    lines = [
        json.dumps({"text": " ".join(draw.choices(words, k=draw.randint(1, 8)))})
        for _ in range(1500)
    ]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    out = root / "prepared"
    prepare(
        PrepareOptions(out=out, inputs=(str(root / "docs.jsonl"),), tokenizer="byte"),
        progress=False,
    )
    return out
