"""The Llama-style decoder on megatron-core's GPTModel: layer specs (TransformerEngine or local), core attention
(SDPA, ring attention under context parallelism), the fused output layer, building this rank's chunks, and
sampling text from a built model."""
