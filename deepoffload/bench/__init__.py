"""Measuring storage throughput through the async-IO op, and against what users would otherwise use.

The baselines are fio, mmap and torch.save/torch.load. Shared by ``deepoffload bench`` and ``deepoffload tune``;
imports torch on use only through its submodules.
"""
