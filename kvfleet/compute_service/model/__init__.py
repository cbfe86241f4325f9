"""The model room: reading a model directory (``config.json`` → ``ModelConfig``, RoPE settings,
sliding windows, the tokenizer), loading ``*.safetensors`` into the one decoder implementation
(``causal_lm``) and its oneDNN linears. What differs between architectures lives in one table,
``architectures``; everything here reads it."""
