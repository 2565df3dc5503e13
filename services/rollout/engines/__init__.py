"""The rollout worker's generation backends.

- `base`: the `Engine` interface and the types every backend shares (`TokenEvent`, `Sequence`);
- `hf`: `HFEngine`, plain transformers/torch, exact and simple;
- `vllm`: `VLLMEngine`, vLLM's async engine, for production sizes;
- `factory`: `make_engine(settings)`, which imports only the backend it builds;
- `tensors`: named tensors read from a pulled folder (what a load of changed tensors reads);
- `vllm_worker`: the method vLLM's workers gain to load changed tensors in place.

Imports go one way: a backend imports `base`, `factory` imports a backend lazily, and nothing
here imports the worker. Importing the package imports none of its modules.
"""
