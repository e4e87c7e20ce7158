"""PEFT (LoRA) over a streamed base: ``save_merged`` writes base plus adapters merged into a new folder.

``peft.get_peft_model`` and ``PeftModel.from_pretrained`` work on a streamed model as they are (the offload takes the
adapter layers: ``deepoffload/swap/params/guards/structure.py``); ``merge_and_unload`` would write into the base, which
a served base refuses, so ``save_merged`` is the way to a merged model. peft is imported only when it runs.
"""

from .merge import save_merged

__all__ = ["save_merged"]
