"""The command line: `specbatch generate | verify | bench | demo | check-trace | conform | ...`.

- `commands`: the parser and one function per command (`main` is the console script).
- `resume`: what `--out` keeps and when a run may resume; `bench`, `calibration`, `machine`: the
  benchmark, its load check and the machine record; `demo`: the side-by-side demo.
"""
