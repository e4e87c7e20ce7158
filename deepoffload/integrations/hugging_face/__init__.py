"""Hugging Face ``transformers``: ``from_pretrained`` (``pretrained``) and ``trainer_arguments`` (``trainer``).

transformers is imported only when one of them runs.
"""
