"""The memory plan: every automatic memory choice of a run, made once before any weight loads (plan.py), with what
it rests on: the model's parts (model_size.py), activations (activations.py), the KV cache (kv_cache.py), what vLLM
holds beside them (engine.py), and the checks of a running job against it (watch.py)."""
