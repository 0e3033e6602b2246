"""Multi-LoRA serving: PEFT adapters as side paths beside the shared base
weights, batched by adapter (``layers.py``), loaded and evicted by the
engine's ``LoRAManager`` (``manager.py``)."""
