"""Saved activations on storage: ``offload_activations`` (``offload.py``) over a run's file (``store.py``)."""

from .offload import ActivationOffload, offload_activations

__all__ = ["ActivationOffload", "offload_activations"]
