"""Text in and out: the GGUF tokenizer, chat templates and incremental detokenization."""
