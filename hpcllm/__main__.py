"""``python -m hpcllm`` is the ``hpcllm`` command."""

import sys

from hpcllm.cli import main

if __name__ == "__main__":
    sys.exit(main())
