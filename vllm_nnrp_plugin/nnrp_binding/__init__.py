"""NNRP side: listeners, session pumps and the frozen Preview4 wire mapping, over nnrp-py's native API."""
