"""The data: the built-in datasets and users' factories, the sampling order every loop shares, the two input
paths, and the fast image readers (jpeg, pack)."""
