"""The HTTP schema: OpenAI's request bodies (``request_bodies``) and response bodies
(``response_bodies``), importable from here.

The service messages live in ``shared.protocol``; nothing here crosses a process wall.
"""

from gateway.openai_protocol.request_bodies import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    ContentPart,
    DetokenizeRequest,
    ResponseFormat,
    ServerOptions,
    StreamOptions,
    StructuredOutputsBody,
    TokenizeRequest,
    Tool,
)
from gateway.openai_protocol.response_bodies import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FunctionCall,
    PromptTokensDetails,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)

__all__ = [
    "ChatChoice",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatLogprobs",
    "ChatMessageIn",
    "ChatMessageOut",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "ContentPart",
    "DeltaMessage",
    "DetokenizeRequest",
    "FunctionCall",
    "PromptTokensDetails",
    "ResponseFormat",
    "ServerOptions",
    "StreamOptions",
    "StructuredOutputsBody",
    "TokenizeRequest",
    "Tool",
    "ToolCallOut",
    "TopLogprob",
    "UsageInfo",
]
