"""How much memory `hpcllm convert --from-hf` takes: the peak growth of the process's anonymous
memory (RssAnon, polled every 5 ms) while it imports a random bf16 LlamaForCausalLM saved in
shards, against the size of one fp32 copy of the weights (what the run keeps).

    python scripts/hf_import_memory.py [--layers 8] [--hidden 1024] [--vocab 32000]

An import that read every tensor before converting them would grow by the bf16 files plus the
fp32 copy (1.5 copies); reading a tensor at a time grows by about one.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import threading
import time
from pathlib import Path


def anonymous_mib() -> float:
    """Return this process's anonymous resident memory in MiB (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def save(folder: Path, layers: int, hidden: int, vocab: int) -> int:
    """Save a random bf16 Llama in shards of 100 MB into ``folder``; return its parameters."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="100MB")
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    """Save a model, import it while polling memory, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()

    from hpcllm.convert import from_hf

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "hf"
        # Saved by another process, whose memory does not count here.
        spawn = multiprocessing.get_context("spawn")
        with spawn.Pool(1) as pool:
            parameters = pool.apply(save, (source, args.layers, args.hidden, args.vocab))
        base = anonymous_mib()
        peak, done = [base], threading.Event()

        def poll() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], anonymous_mib())
                time.sleep(0.005)

        watcher = threading.Thread(target=poll)
        watcher.start()
        started = time.perf_counter()
        from_hf(source, Path(tmp) / "run")
        seconds = time.perf_counter() - started
        done.set()
        watcher.join()
    fp32 = parameters * 4 / 2**20
    growth = peak[0] - base
    print(
        f"{parameters / 1e6:.0f} M parameters (bf16 files {parameters * 2 / 2**20:.0f} MiB, "
        f"one fp32 copy {fp32:.0f} MiB): import grew anonymous memory by {growth:.0f} MiB "
        f"= {growth / fp32:.2f} fp32 copies, in {seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
