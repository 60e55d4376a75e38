"""`python tests/kill_at_rewrite.py CLI-ARGS...`: the specbatch CLI, killed by SIGKILL part-way
through writing the in-order rewrite of the file named by $KILL_AT_REWRITE_OF (the final step of
`generate --out`, in one process or by rank 0 of a torchrun run). Used by the resume tests: what
was on disk before the rewrite must be enough for `--resume` to finish the same file."""
import os
import signal
import sys

import specbatch.io
from specbatch.cli.commands import main

original = specbatch.io.replace_atomically


def dying(path, lines):
    if str(path) != os.environ["KILL_AT_REWRITE_OF"]:
        return original(path, lines)
    lines = list(lines)

    def half_then_die():
        yield from lines[: len(lines) // 2]
        os.kill(os.getpid(), signal.SIGKILL)
    original(path, half_then_die())


specbatch.io.replace_atomically = dying
sys.exit(main(sys.argv[1:]))
