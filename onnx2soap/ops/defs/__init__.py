"""One module per op or small family of ops, each with a ``DEFINITIONS`` tuple."""
