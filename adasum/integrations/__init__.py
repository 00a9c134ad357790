"""Framework integrations: the Lightning strategy (``adasum.lightning``) and the Hugging Face Trainer callback (``adasum.hf``)."""
