"""The detokenizer service: TokenDelta in (one shard of ps:detok:in), RequestOutput to each request's gateway."""
