"""The tokenizer service: GenerateRequest in (group "tokenizer"), EngineRequest out. Any number of replicas."""
