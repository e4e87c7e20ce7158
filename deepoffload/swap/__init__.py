"""Swapping tensors and optimizer state to storage: ``SwapConfig``, ``TensorSwapper``, ``OffloadedOptimizer``."""
