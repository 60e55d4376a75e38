"""Pure-NumPy reference of batch speculative decoding: the executable specification.

It never imports torch. `state` holds the layouts, `rounds` one round's arithmetic, `pool` the
schedulers, `toy_lm` a small causal LM with a KV cache, `drafts` scripted drafts, `engine` the
rounds with real caches, `strategies` one function per strategy (the registry `STRATEGIES`),
`api` the twin of specbatch.generate, and `trees` token-tree rounds (several candidates per
position in one verify).
"""
from .drafts import ScriptedDraft, confidence_hashed, deviate_at, deviate_hashed
from .api import generate
from .engine import ReferenceResult
from .pool import ExspecPool, FixedBatches, SlotQueue
from .rounds import commit_counts, eqspec_update, greedy_accept, ragged_commit, realign_source
from .state import RaggedState, RectState, query_mask
from .strategies import STRATEGIES
from .toy_lm import ToyLM, greedy_decode
from .trees import Tree, best_first_tree, tree_generate

__all__ = ["ToyLM", "greedy_decode", "ScriptedDraft", "deviate_at", "deviate_hashed", "confidence_hashed", "generate", "STRATEGIES",
           "ReferenceResult", "ExspecPool", "FixedBatches", "SlotQueue", "greedy_accept", "commit_counts", "eqspec_update",
           "realign_source", "ragged_commit", "RectState", "RaggedState", "query_mask", "Tree", "best_first_tree",
           "tree_generate"]
