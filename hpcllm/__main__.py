"""``python -m hpcllm`` is the ``hpcllm`` command."""

import sys

from hpcllm.cli import main

sys.exit(main())
