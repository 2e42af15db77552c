"""Activation sparsity: profiling which FFN neurons fire, and predicting them."""
