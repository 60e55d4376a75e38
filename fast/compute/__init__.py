"""What the engine computes with: its attention (`attention`), caches (`cache` for rectangles,
`slot_cache` and `slot_forward` for ragged slots), packed prefill (`prefill`), prepacked linears
and compiled blocks (`kernels`), the lean Llama forward (`lean_llama`), and the speed choices that
depend on the device (`backend`)."""
