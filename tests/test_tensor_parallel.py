import json

import pytest
from mpirun import python, run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gpt_equals_the_serial_gpt(tp):
    result = run_mpi(tp, python("tests/mpi_scripts/tp_equivalence.py"), timeout=300).check()
    for rank in range(tp):
        out = json.loads(result.rank_stdout[rank].splitlines()[-1])
        assert out["tp"] == tp
        # A vocabulary of 250 divides by no t: padded to 128·t, split in equal shards.
        assert out["padded_vocab"] == 128 * tp and out["vocab_rows"] == 128
        assert out["init"] == 0.0, "shards are not slices of the t = 1 weights"
        assert out["logits"] <= 1e-5
        assert out["loss"] <= 1e-5, "loss differs from the unpadded serial loss"
        assert out["grad"] <= 1e-5, out["grad_worst"]
        for serial, parallel in zip(out["serial_losses"], out["parallel_losses"], strict=True):
            assert parallel == pytest.approx(serial, rel=1e-5)
