"""The conformance kit: what another engine runs to check itself against specbatch.

- `greedy`: greedy vectors (`make_vectors`) and their checker (`check_outputs`); public name
  `specbatch.conform`.
- `sampled`: sampled vectors and the distribution checker; `processor_vectors`: vectors with
  penalties, bias, `min_tokens`, `min_p` and stop strings.
- `sampling_engines`: the textbook sampler and the deliberately broken engines the checker must
  reject.
- `serving`: adapters for engines deployed as servers (OpenAI-style HTTP); `stub_server`: a local
  server used by the kit's own tests.
- `testing`: the engine protocol, adapters and the pytest plugin; public name `specbatch.testing`.
"""
