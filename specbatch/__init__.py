"""specbatch: batch speculative decoding that is provably output-equivalent."""
__version__ = "0.1.0"
