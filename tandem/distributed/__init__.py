"""Tensor parallelism: how a model is split across ranks, and the processes that run them."""
