"""`torchrun --nproc-per-node T tests/tp_worker.py TARGET DRAFT DTYPE OUT`: the target sharded over T
ranks (specbatch.tensor_parallel), then greedy decoding with every strategy, target-only greedy
decoding, and coupled sampling with and without the draft, all through specbatch.generate on the
sharded target. Rank 0 writes the sequences to OUT (JSON); the other ranks check they decoded the same."""
import json
import os
import sys

import specbatch
from specbatch import distributed
from specbatch.fast.loading import load_model
from specbatch.fast.compute.backend import sharded
from specbatch.tensor_parallel import layout, shard

target_dir, draft_dir, dtype, out = sys.argv[1:5]
rank, size = distributed.init_from_env("cpu")
parallel = layout(rank, size, size)
target = shard(load_model(target_dir, dtype)[0], parallel)
draft = load_model(draft_dir, dtype)[0]  # replicated: every rank holds it whole
assert sharded(target) and not sharded(draft)
prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12], [13, 14, 15, 16], [17, 18, 19]]
common = dict(max_new_tokens=10, batch_size=3, num_draft_tokens=3)
runs = {"target-only": specbatch.generate(target, None, prompts, batch_size=1, max_new_tokens=10).sequences}
for strategy in ("eqspec", "exspec", "ragged"):
    runs[strategy] = specbatch.generate(target, draft, prompts, strategy=strategy, **common).sequences
runs["distributed ragged"] = specbatch.distributed.generate(target, draft, prompts, strategy="ragged", **common).sequences
sampled = dict(temperature=0.9, top_k=20, sampling="coupled", seed=[5, 6, 7, 8, 9, 10])
runs["coupled target-only"] = specbatch.generate(target, None, prompts, **sampled, **common).sequences
runs["coupled ragged"] = specbatch.generate(target, draft, prompts, strategy="ragged", **sampled, **common).sequences
everyone = distributed.gather(runs)
assert all(other == runs for other in everyone), "the ranks of the group decoded differently"
if rank == 0:
    with open(out, "w") as f:
        json.dump(runs, f)
distributed.shutdown()
sys.stdout.flush()
os._exit(0)  # past gloo's teardown at interpreter exit (specbatch.cli.commands.leave)
