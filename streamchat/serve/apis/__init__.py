"""The wire formats `streamchat serve` speaks, each a request read into a ChatRequest and replies in its shapes.

    request              what every API reads a request into (ChatRequest), its errors (ApiError), the body parsed
                         within bounds, the checks the readers share
    openai_chat          POST /v1/chat/completions: OpenAI's chat completions
    openai_responses     POST /v1/responses: OpenAI's Responses API (response_ids: previous_response_id)
    anthropic_messages   POST /v1/messages: Anthropic's Messages API

Every API runs the same Turn on the same conversations (matched by history, journaled), and
formats the reply its own way.
"""
