"""``python -m hpcllm`` is the ``hpcllm`` command."""

from hpcllm.cli import run

if __name__ == "__main__":
    run()
